"""The generated stubs match proto/ (regenerated and compared), and the API keeps its names."""

import subprocess
import sys
from pathlib import Path

from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc

ROOT = Path(__file__).resolve().parent.parent


def test_generated_stubs_are_current(tmp_path):
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_proto.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    fresh = {p.name: p.read_text() for p in tmp_path.iterdir() if p.is_file()}
    committed = {p.name: p.read_text() for p in (ROOT / "pdserve_proto").iterdir() if p.is_file()}
    stale = sorted(n for n in fresh.keys() | committed.keys() if fresh.get(n) != committed.get(n))
    assert not stale, f"pdserve_proto is stale: run `python scripts/gen_proto.py` ({stale})"


def test_request_field_names_clients_rely_on():
    fields = {
        "GenerateRequest": [
            "request_id",
            "prompt",
            "prompt_token_ids",
            "messages",
            "sampling",
            "slo",
            "path",
        ],
        "ChatMessage": ["role", "content"],
        "SamplingParams": [
            "max_tokens",
            "temperature",
            "top_p",
            "top_k",
            "min_p",
            "seed",
            "stop",
            "stop_token_ids",
            "ignore_eos",
            "logprobs",
        ],
        "SloHint": ["ttft_ms", "itl_ms"],
    }
    for message, names in fields.items():
        have = [f.name for f in getattr(pb, message).DESCRIPTOR.fields]
        assert have[: len(names)] == names, message
    assert [v.name for v in pb.Path.DESCRIPTOR.values] == [
        "PATH_AUTO",
        "PATH_COLOCATED",
        "PATH_DISAGGREGATED",
    ]
    assert pb.Path.Value("PATH_DISAGGREGATED") == 2


def test_unset_sampling_fields_are_distinguishable_from_zero():
    sp = pb.SamplingParams(temperature=0.0)
    assert sp.HasField("temperature") and not sp.HasField("max_tokens")
    req = pb.GenerateRequest(prompt="hi", sampling=sp)
    again = pb.GenerateRequest.FromString(req.SerializeToString())
    assert again.sampling.HasField("temperature") and again.sampling.temperature == 0.0


def test_service_has_streaming_and_unary_methods():
    methods = {m.name: m for m in pb.DESCRIPTOR.services_by_name["Generation"].methods}
    assert methods["Generate"].server_streaming and not methods["Complete"].server_streaming
    assert hasattr(pb_grpc, "GenerationServicer") and hasattr(
        pb_grpc, "add_GenerationServicer_to_server"
    )

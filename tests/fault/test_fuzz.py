"""Hostile input, fuzzed with hypothesis against one real server (tiny-llama, 1 prefill + 1
decode Ray worker on 127.0.0.1, a bearer token, a per-client stream limit): every field of
GenerateRequest with out-of-range, huge, empty, NaN and infinite values, and wrong or oversized
tokens; raw bytes that are not a valid message (invalid UTF-8 included); floods of stop strings
and chat messages; floods of streams cancelled or dropped with their channel.

Every answer is OK, INVALID_ARGUMENT (naming a field), RESOURCE_EXHAUSTED, UNAUTHENTICATED or
CANCELLED, and a completed one is well formed; after every example the health service answers
SERVING and every worker's KV pool is full again. The status counts print per test (`-rP`).

PDSERVE_FUZZ_EXAMPLES sets the examples per test (default 200; the full run is 10000). The run
is derandomized and keeps no example database, so CI sees the same examples every time.
"""

from __future__ import annotations

import os
import random
import time
from collections import Counter, deque

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.config import CacheConfig, EngineConfig, SchedulerConfig
from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc
from router.cluster import ClusterConfig
from router.security import SecurityConfig
from router.serve_config import ServeConfig
from tests.grpc_server import ServerThread
from tests.test_router_grpc import assert_pools_full

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "200"))
MAX_NEW = 4  # the server's --max-tokens-limit: a valid request generates at most this many
VOCAB, CONTEXT = 259, 1024  # tiny-llama
ALLOWED = {
    grpc.StatusCode.OK,
    grpc.StatusCode.INVALID_ARGUMENT,
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    grpc.StatusCode.UNAUTHENTICATED,
    grpc.StatusCode.CANCELLED,
}
GENERATE = "/pdserve.v1.Generation/Generate"
COMPLETE = "/pdserve.v1.Generation/Complete"
STREAMS_PER_CLIENT = 64  # the server's --max-streams-per-client; the cancel flood goes past it
CALL_TIMEOUT_S = 120  # a hang shows as DEADLINE_EXCEEDED, which is not allowed
STATUSES: Counter[tuple[str, str]] = Counter()  # (test, status), printed per test


def fuzz_settings(examples: int = EXAMPLES) -> settings:
    return settings(
        max_examples=max(1, examples),
        deadline=None,
        derandomize=True,
        database=None,
        print_blob=True,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.large_base_example,
            HealthCheck.function_scoped_fixture,
        ],
    )


TOKEN = "fuzz-token"
AUTH = (("authorization", f"Bearer {TOKEN}"),)
# What a client may put in `authorization`: mostly the right token (None: no metadata).
auth = st.sampled_from(
    [AUTH] * 24
    + [
        None,
        (("authorization", "Bearer"),),
        (("authorization", TOKEN),),
        (("authorization", f"Bearer {TOKEN}x"),),
        (("authorization", "Bearer " + "t" * (16 << 10)),),  # past gRPC's metadata limit
        (("authorization", "Bearer wrong"), AUTH[0]),
        (AUTH[0], ("authorization", "Bearer wrong")),
    ]
)


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("fuzz") / "token"
    token_file.write_text(TOKEN + "\n")
    engine = EngineConfig(
        cache=CacheConfig(block_size=4, num_blocks=512),
        scheduler=SchedulerConfig(max_num_batched_tokens=256, max_num_seqs=16),
    )
    config = ServeConfig(
        cluster=ClusterConfig(
            model="tiny-llama", num_prefill=1, num_decode=1, engine=engine,
            kv_transfer_deadline_s=10,
        ),
        port=0,
        metrics_port=None,
        drain_timeout_s=5,
        security=SecurityConfig(auth_token_file=token_file),
        max_streams_per_client=STREAMS_PER_CLIENT,
        max_tokens_limit=MAX_NEW,
    )  # fmt: skip
    s = ServerThread(config)
    yield s
    s.close()


@pytest.fixture(scope="module")
def channel(srv):
    with grpc.insecure_channel(srv.address) as ch:
        yield ch


def healthy(srv, channel, within_s: float = 10.0) -> None:
    """Health SERVING and every pool full, the router's books empty."""
    health = health_pb2_grpc.HealthStub(channel)
    resp = health.Check(health_pb2.HealthCheckRequest(service="pdserve.v1.Generation"), timeout=10)
    assert resp.status == health_pb2.HealthCheckResponse.SERVING
    assert_pools_full(srv, within_s=within_s)


def status(wait) -> tuple[grpc.StatusCode, str]:
    """Run `wait` (a call to its end) and return the call's status and details."""
    try:
        wait()
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def answer_ok(msgs: list[pb.GenerateResponse] | list[pb.CompleteResponse]) -> None:
    """A completed answer: one final (on the last message), at most MAX_NEW tokens, every id in
    the vocabulary, and the usage counting them."""
    assert msgs and all(not m.HasField("final") for m in msgs[:-1]), msgs
    assert msgs[-1].HasField("final"), msgs
    ids = [t for m in msgs for t in m.token_ids]
    assert 1 <= len(ids) <= MAX_NEW and all(0 <= t < VOCAB for t in ids), ids
    assert msgs[-1].final.usage.completion_tokens == len(ids)


def send(channel, raw: bytes, streaming: bool, metadata=AUTH) -> tuple[grpc.StatusCode, str]:
    """Send `raw` as the request body of Generate or Complete (no serializer: any bytes reach the
    server); the status and its details. A completed answer is checked."""
    msgs: list = []
    if streaming:
        call = channel.unary_stream(GENERATE)
        code, detail = status(
            lambda: msgs.extend(call(raw, timeout=CALL_TIMEOUT_S, metadata=metadata))
        )
        msgs = [pb.GenerateResponse.FromString(m) for m in msgs]
    else:
        unary = channel.unary_unary(COMPLETE)
        code, detail = status(
            lambda: msgs.append(unary(raw, timeout=CALL_TIMEOUT_S, metadata=metadata))
        )
        msgs = [pb.CompleteResponse.FromString(m) for m in msgs]
    if code is grpc.StatusCode.OK:
        answer_ok(msgs)
    return code, detail


def book(test: str, code: grpc.StatusCode, ledger, detail: str = "") -> None:
    """Count the answer (INVALID_ARGUMENT by the field it names) and book it in the ledger."""
    key = code.name
    if code is grpc.StatusCode.INVALID_ARGUMENT:
        assert ": " in detail, detail  # "field: why"
        key += " " + detail.split(":")[0].split("[")[0]
    STATUSES[(test, key)] += 1
    ok = code is grpc.StatusCode.OK
    ledger.add(sent=1, completed=int(ok), failed=int(not ok))
    assert code in ALLOWED, f"{code.name}: {detail}"


def check(test: str, srv, channel, ledger, raw: bytes, streaming: bool, metadata=AUTH) -> None:
    """One fuzzed request: an allowed status, then the server healthy with every pool full."""
    code, detail = send(channel, raw, streaming, metadata)
    book(test, code, ledger, f"{detail} (request {raw[:200]!r})")
    healthy(srv, channel)


def report(test: str, started: float) -> None:
    seen = {k[1]: n for k, n in sorted(STATUSES.items()) if k[0] == test}
    print(f"\n{test}: {sum(seen.values())} requests in {time.monotonic() - started:.1f} s: {seen}")


# -- strategies --------------------------------------------------------------------------------

INT32 = (-(2**31), 2**31 - 1)
int32 = st.one_of(
    st.sampled_from([INT32[0], -2, -1, 0, 1, 2, MAX_NEW, MAX_NEW + 1, VOCAB - 1, VOCAB,
                     CONTEXT - 1, CONTEXT, INT32[1]]),
    st.integers(*INT32),
)  # fmt: skip
token_id = st.one_of(st.integers(0, VOCAB - 1), int32)
float32 = st.one_of(
    st.sampled_from([0.0, -0.0, 1.0, 1e-5, 1e-6, 2.0, float("nan"), float("inf"), float("-inf")]),
    st.floats(width=32),
)
HUGE = [1 << 16, 1 << 20, (1 << 20) + 1, 3 << 20]
huge_text = st.sampled_from(HUGE).flatmap(
    lambda n: st.sampled_from(["a" * n, "é" * (n // 2 + 1), "<|eos|>" * (n // 7 + 1)])
)
text = st.one_of(
    st.just(""), st.text(max_size=40), st.sampled_from(["<|eos|>", "<|bos|>", "\x00", "\ufeff"])
)
any_text = st.one_of(text, text, text, huge_text)
long_ids = st.tuples(st.sampled_from([CONTEXT - 2, CONTEXT - 1, CONTEXT, 5000]), token_id).map(
    lambda t: [t[1]] * t[0]
)
ids = st.one_of(st.lists(token_id, max_size=40), long_ids)
roles = st.one_of(st.sampled_from(["system", "user", "assistant"]), text)
messages = st.lists(st.builds(pb.ChatMessage, role=roles, content=any_text), max_size=6)


unit32 = st.floats(0, 1, exclude_min=True, width=32)
short_text = st.text(min_size=1, max_size=200)
chat = st.lists(
    st.builds(pb.ChatMessage, role=st.sampled_from(["system", "user", "assistant"]), content=text),
    min_size=1,
    max_size=4,
)
# Each field: (a valid value, a hostile one). None leaves the field unset.
FIELDS = {
    "request_id": (text, any_text),
    "prompt": (short_text, any_text),
    "prompt_token_ids": (st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=200), ids),
    "messages": (chat, messages),
    "max_tokens": (st.none() | st.integers(1, MAX_NEW), int32),
    "temperature": (st.none() | st.floats(0, 2, width=32), float32),
    "top_p": (st.none() | unit32, float32),
    "top_k": (st.none() | st.integers(-1, 2 * VOCAB), int32),
    "min_p": (st.none() | st.floats(0, 1, width=32), float32),
    "seed": (st.none() | st.integers(0, 2**64 - 1), st.integers(0, 2**64 - 1)),
    "logprobs": (st.none() | st.integers(0, 20), int32),
    "stop": (st.lists(short_text, max_size=3), st.lists(any_text, max_size=4)),
    "stop_token_ids": (st.lists(st.integers(0, VOCAB - 1), max_size=3), st.lists(token_id)),
    "ignore_eos": (st.booleans(), st.booleans()),
    "ttft_ms": (st.floats(0, 1e6, width=32), float32),
    "itl_ms": (st.floats(0, 1e6, width=32), float32),
    "path": (st.sampled_from([0, 1, 2]), int32),
}
PROMPTS = ("prompt", "prompt_token_ids", "messages")


@st.composite
def requests(draw) -> pb.GenerateRequest:
    """A request that is valid, hostile in one field, or hostile anywhere."""
    mode = draw(st.sampled_from(["valid", "one", "any"]))
    hostile = draw(st.sampled_from(sorted(FIELDS))) if mode == "one" else None
    kinds = [draw(st.sampled_from(PROMPTS))]
    if mode == "any" or hostile in PROMPTS:  # none, or several (exactly one is allowed)
        kinds = draw(st.lists(st.sampled_from(PROMPTS), unique=True, max_size=3))

    def value(name: str):
        valid, bad = FIELDS[name]
        if mode == "any":
            return draw(st.one_of(valid, bad))
        return draw(bad if name == hostile else valid)

    req = pb.GenerateRequest(request_id=value("request_id"), path=value("path"))
    req.slo.ttft_ms, req.slo.itl_ms = value("ttft_ms"), value("itl_ms")
    if "prompt" in kinds:
        req.prompt = value("prompt")
    if "prompt_token_ids" in kinds:
        req.prompt_token_ids.extend(value("prompt_token_ids"))
    if "messages" in kinds:
        req.messages.extend(value("messages"))
    sp = req.sampling
    for name in ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "logprobs"):
        v = value(name)
        if v is not None:
            setattr(sp, name, v)
    sp.stop.extend(value("stop"))
    sp.stop_token_ids.extend(value("stop_token_ids"))
    sp.ignore_eos = value("ignore_eos")
    return req


def mutated(raw: bytes, rnd: random.Random) -> bytes:
    """A serialized request with a few bytes flipped, cut short, or spliced with invalid UTF-8."""
    b = bytearray(raw)
    for _ in range(rnd.randint(1, 4)):
        op = rnd.randrange(4)
        i = rnd.randrange(len(b) + 1)
        if op == 0 and b:
            b[min(i, len(b) - 1)] = rnd.randrange(256)
        elif op == 1:
            del b[i:]
        elif op == 2:
            b[i:i] = rnd.choice([b"\xff", b"\xc3", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80"])
        else:
            b[i:i] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 8)))
    return bytes(b)


UTF8_TARGETS = ("request_id", "prompt", "stop", "role", "content")


def invalid_utf8(req: pb.GenerateRequest, target: str) -> bytes:
    """`req` with its `target` string field set to bytes that are not UTF-8 (protobuf will not
    serialize such a string itself)."""
    marker = "\x01MARK\x01"
    if target == "stop":
        req.sampling.stop.append(marker)
    elif target in ("role", "content"):
        req.messages.add(role="user", content="x")
        setattr(req.messages[-1], target, marker)
    else:
        setattr(req, target, marker)
    return req.SerializeToString().replace(marker.encode(), b"\xffMARK\xfe", 1)


raw_bodies = st.one_of(
    st.binary(max_size=256),
    st.tuples(requests(), st.randoms(use_true_random=False)).map(
        lambda t: mutated(t[0].SerializeToString(), t[1])
    ),
    st.tuples(requests(), st.sampled_from(UTF8_TARGETS)).map(lambda t: invalid_utf8(*t)),
    st.just(b""),
)


# -- tests -------------------------------------------------------------------------------------


@pytest.mark.timeout(max(600, EXAMPLES * 2))
def test_every_field_fuzzed(srv, channel, ledger):
    started = time.monotonic()

    @fuzz_settings()
    @given(req=requests(), streaming=st.booleans(), metadata=auth)
    def case(req: pb.GenerateRequest, streaming: bool, metadata) -> None:
        check("fields", srv, channel, ledger, req.SerializeToString(), streaming, metadata)

    case()
    report("fields", started)


@pytest.mark.timeout(max(600, EXAMPLES * 2))
def test_raw_bytes_that_are_not_a_valid_request(srv, channel, ledger):
    started = time.monotonic()

    @fuzz_settings()
    @given(raw=raw_bodies, streaming=st.booleans())
    def case(raw: bytes, streaming: bool) -> None:
        check("raw", srv, channel, ledger, raw, streaming)

    case()
    report("raw", started)


@pytest.mark.timeout(max(600, EXAMPLES))
def test_floods_of_stop_strings_and_chat_messages(srv, channel, ledger):
    started = time.monotonic()

    @fuzz_settings(max(10, EXAMPLES // 10))
    @given(
        stops=st.integers(0, 5000),
        stop=st.one_of(text, st.sampled_from([100, 1 << 16]).map(lambda n: "z" * n)),
        turns=st.one_of(st.integers(0, 120), st.integers(0, 20000)),
        content=text,
        streaming=st.booleans(),
    )
    def case(stops: int, stop: str, turns: int, content: str, streaming: bool) -> None:
        # At most ~70 MB of stop strings: past the server's 64 MB message limit at the top.
        stops = min(stops, (70 << 20) // max(1, len(stop.encode())))
        req = pb.GenerateRequest(sampling=pb.SamplingParams(temperature=0.0))
        req.sampling.stop.extend(f"{stop}{i}" for i in range(stops))
        roles = ["user", "assistant"]
        req.messages.extend(
            pb.ChatMessage(role=roles[i % 2], content=content) for i in range(turns)
        )
        if not turns:
            req.prompt = "the quick brown fox"
        check("floods", srv, channel, ledger, req.SerializeToString(), streaming)

    case()
    report("floods", started)


def flood(address: str, reqs: list[pb.GenerateRequest], delays: list[float], drop: bool):
    """Open every stream at once on a channel of their own, cancel each after its delay (None:
    never), then drop the channel with whatever is still open when `drop`; each call's status."""
    with grpc.insecure_channel(address) as ch:
        stub = pb_grpc.GenerationStub(ch)
        t0 = time.monotonic()
        calls = [stub.Generate(r, timeout=CALL_TIMEOUT_S, metadata=AUTH) for r in reqs]
        timed = sorted((d, i) for i, d in enumerate(delays) if d is not None)
        for delay, i in timed:
            time.sleep(max(0.0, t0 + delay - time.monotonic()))
            calls[i].cancel()
        if drop:
            ch.close()
        return [status(lambda c=c: deque(c, 0))[0] for c in calls]


@pytest.mark.timeout(max(600, EXAMPLES * 3))
def test_floods_of_cancelled_and_dropped_streams(srv, channel, ledger):
    started = time.monotonic()

    @fuzz_settings(max(5, EXAMPLES // 40))
    @given(n=st.integers(50, 300), seed=st.integers(0, 2**32), drop=st.booleans())
    def case(n: int, seed: int, drop: bool) -> None:
        rnd = random.Random(seed)
        reqs = [
            pb.GenerateRequest(
                prompt_token_ids=rnd.choices(range(256), k=rnd.choice([8, 100, 600, 1019])),
                sampling=pb.SamplingParams(temperature=0.0, ignore_eos=True),
                path=rnd.choice([0, 1, 2]),
            )
            for _ in range(n)
        ]
        # Cancelled at once, mid-prefill, mid-transfer, mid-decode, or never; with a dropped
        # channel, those never cancelled go with it if still open.
        delays = [rnd.choice([0.0, 0.001, 0.01, 0.05, 0.2, 1.0, None]) for _ in range(n)]
        codes = flood(srv.address, reqs, delays, drop)
        for code in codes:
            book("cancel flood", code, ledger)
        healthy(srv, channel, within_s=30)

    case()
    report("cancel flood", started)
    # And the server still answers a plain request.
    resp = pb_grpc.GenerationStub(channel).Complete(
        pb.GenerateRequest(prompt="hello", sampling=pb.SamplingParams(temperature=0.0)),
        timeout=CALL_TIMEOUT_S,
        metadata=AUTH,
    )
    assert resp.final.usage.completion_tokens >= 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("top_p", [1e-45, 1e-40, 1e-38], ids=["1e-45", "1e-40", "1e-38"])
def test_a_top_p_that_keeps_no_mass_still_keeps_the_most_likely_token(srv, channel, top_p):
    """Found by the field fuzz: a denormal top_p read as 0 on the worker (its math flushes
    denormals), dropped every token, and the NaN row sampled token 0 every time."""
    stub = pb_grpc.GenerationStub(channel)

    def tokens(**sampling) -> list[int]:
        req = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(**sampling))
        return list(stub.Complete(req, timeout=CALL_TIMEOUT_S, metadata=AUTH).token_ids)

    assert tokens(top_p=top_p, seed=1) == tokens(temperature=0.0)
    healthy(srv, channel)

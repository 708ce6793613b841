"""The gRPC edge's request checks: defaults when unset, refusals that name the field."""

import logging

import pytest

from engine.errors import InvalidRequestError
from pdserve_proto import generation_pb2 as pb
from router.convert import invalid_utf8_field, request_fields
from router.request import ModelLimits, check_request
from router.vocab import RoutePath
from tests.helpers import loaded

TOK = loaded("tiny-llama").tokenizer
LIMITS = ModelLimits(vocab_size=259, max_model_len=1024, max_prompt_bytes=1 << 20)


def parse(**kw):
    return check_request(request_fields(pb.GenerateRequest(**kw)), TOK, LIMITS)


def refused(field, **kw):
    with pytest.raises(InvalidRequestError) as info:
        parse(**kw)
    assert info.value.field == field, str(info.value)
    return str(info.value)


def test_unset_fields_take_the_documented_defaults():
    r = parse(prompt="hello")
    assert r.sampling.max_tokens == 256 and r.sampling.temperature == 1.0
    assert r.sampling.top_p == 1.0 and r.sampling.seed is None and r.sampling.logprobs is None
    assert r.path is RoutePath.AUTO and r.slo_ttft_ms is None and r.request_id
    assert r.prompt_token_ids == tuple(TOK.encode("hello"))


def test_explicit_values_pass_through():
    sp = pb.SamplingParams(
        max_tokens=5, temperature=0.0, top_p=0.5, top_k=3, seed=7, stop=["x"], logprobs=2
    )
    r = parse(
        prompt_token_ids=[1, 2, 3],
        sampling=sp,
        path=pb.PATH_DISAGGREGATED,
        slo=pb.SloHint(ttft_ms=500),
        request_id="mine",
    )
    s = r.sampling
    assert (s.max_tokens, s.temperature, s.top_p, s.top_k, s.seed) == (5, 0.0, 0.5, 3, 7)
    assert s.greedy and s.stop == ("x",) and s.logprobs == 2
    assert r.path is RoutePath.DISAGGREGATED and r.slo_ttft_ms == 500 and r.request_id == "mine"


def test_chat_messages_use_the_template():
    r = parse(messages=[pb.ChatMessage(role="user", content="hi")])
    text = TOK.decode(list(r.prompt_token_ids))
    assert "hi" in text and text != "hi"


def test_the_last_assistant_message_can_be_continued_as_transformers_does():
    """continue_final_message (vLLM's): the assistant's message left open, no new turn, the
    ids transformers' template gives; refused where it cannot mean anything."""
    chat = [{"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "The capital is"}]  # fmt: skip
    msgs = [pb.ChatMessage(**m) for m in chat]
    go_on = parse(messages=msgs, continue_final_message=True)
    want = TOK.apply_chat_template(
        chat, continue_final_message=True, tokenize=True, return_dict=False
    )
    assert list(go_on.prompt_token_ids) == list(want)
    assert TOK.decode(list(go_on.prompt_token_ids)).endswith("The capital is")
    opened = parse(messages=msgs)  # the default: a new assistant turn after it
    want = TOK.apply_chat_template(
        chat, add_generation_prompt=True, tokenize=True, return_dict=False
    )
    assert list(opened.prompt_token_ids) == list(want) != list(go_on.prompt_token_ids)
    closed = parse(messages=msgs, add_generation_prompt=False)
    want = TOK.apply_chat_template(
        chat, add_generation_prompt=False, tokenize=True, return_dict=False
    )
    assert list(closed.prompt_token_ids) == list(want)
    both = refused("continue_final_message", messages=msgs, continue_final_message=True,
                   add_generation_prompt=True)  # fmt: skip
    assert "add_generation_prompt" in both
    # Any last message may be continued, as in vLLM (the user's here).
    mine = parse(messages=msgs[:1], continue_final_message=True)
    assert TOK.decode(list(mine.prompt_token_ids)).endswith("Capital of France?")
    assert "messages" in refused("continue_final_message", prompt="a", continue_final_message=True)
    refused("add_generation_prompt", prompt="a", add_generation_prompt=False)


def test_bad_requests_name_their_field():
    assert "exactly one" in refused("prompt")
    refused("prompt", prompt="a", prompt_token_ids=[1])
    assert "teacher" in refused(
        "messages[1].role",
        messages=[pb.ChatMessage(role="user", content="a"), pb.ChatMessage(role="teacher")],
    )
    assert "[1, " in refused("max_tokens", prompt="a", sampling=pb.SamplingParams(max_tokens=0))
    refused("max_tokens", prompt="a", sampling=pb.SamplingParams(max_tokens=5000))
    refused("temperature", prompt="a", sampling=pb.SamplingParams(temperature=-1))
    assert "(0, 1]" in refused("top_p", prompt="a", sampling=pb.SamplingParams(top_p=0))
    refused("prompt_token_ids", prompt_token_ids=[1, 999])
    refused("stop_token_ids", prompt="a", sampling=pb.SamplingParams(stop_token_ids=[-2]))
    assert "bytes" in refused("prompt", prompt="x" * (10 << 20))  # a 10 MB prompt
    refused("prompt_token_ids", prompt_token_ids=[1] * 1024)  # the whole context
    refused("slo.ttft_ms", prompt="a", slo=pb.SloHint(ttft_ms=-1))
    for bad in (float("inf"), float("nan")):  # non-finite floats are refused, never clamped
        refused("temperature", prompt="a", sampling=pb.SamplingParams(temperature=bad))
        refused("slo.itl_ms", prompt="a", slo=pb.SloHint(itl_ms=bad))
    refused("path", prompt="a", path=7)
    assert "at most 256" in refused("request_id", prompt="a", request_id="x" * 257)
    assert "printable" in refused("request_id", prompt="a", request_id="a\nforged line")
    assert parse(prompt="a", request_id="x" * 256).request_id == "x" * 256


def test_a_prompt_no_workers_kv_cache_can_hold_is_refused_naming_it():
    """8 blocks of 4 tokens hold a prompt of 31 (its first token takes the 32nd slot)."""
    small = ModelLimits(vocab_size=259, max_model_len=1024, kv_blocks=8, block_size=4)
    ok = check_request(request_fields(pb.GenerateRequest(prompt_token_ids=[1] * 31)), TOK, small)
    assert len(ok.prompt_token_ids) == 31
    with pytest.raises(InvalidRequestError) as info:
        check_request(request_fields(pb.GenerateRequest(prompt_token_ids=[1] * 32)), TOK, small)
    assert info.value.field == "prompt" and "at most 31" in str(info.value)


def test_a_request_error_survives_pickling_whole():
    """Ray pickles what a worker raises: the router gets the same error, field and message."""
    import pickle

    back = pickle.loads(pickle.dumps(InvalidRequestError("prompt", "needs 51 KV blocks")))
    assert isinstance(back, InvalidRequestError)
    assert back.field == "prompt" and str(back) == "prompt: needs 51 KV blocks"


@pytest.mark.parametrize("model", ["smollm2-135m", "tiny-llama", "tiny-qwen2"])
def test_fast_encode_gives_the_tokenizers_own_ids(model):
    from engine.config import ModelConfig
    from engine.loader import load_tokenizer
    from router.request import encode

    tok = load_tokenizer(ModelConfig(model=model))
    for text in [
        "What is the capital of France?",
        " two  spaces\n\nx",
        "héllo ✓ 日本",
        "<|im_start|>",
    ]:
        assert encode(tok, text) == tok.encode(text), text


def test_a_message_s_name_reaches_the_template_and_is_checked_as_its_content_is():
    import copy

    named = copy.deepcopy(TOK)
    named.chat_template = (
        "{% for m in messages %}{{ m.role }}{% if m.name is defined %}({{ m.name }})"
        "{% endif %}: {{ m.content }}\n{% endfor %}"
    )

    def text(*msgs):
        req = pb.GenerateRequest(messages=list(msgs), add_generation_prompt=False)
        ids = check_request(request_fields(req), named, LIMITS).prompt_token_ids
        return named.decode(list(ids))

    ana, yo = (
        pb.ChatMessage(role="user", content="hi", name="ana"),
        pb.ChatMessage(role="user", content="yo"),
    )
    said = text(ana, yo)
    assert said == "user(ana): hi\nuser: yo\n", said
    # An empty name is a name given ("" is not unset: the field is optional on the wire).
    assert text(pb.ChatMessage(role="user", content="hi", name="")) == "user(): hi\n"
    huge = "n" * LIMITS.max_prompt_bytes
    refused("messages", messages=[pb.ChatMessage(role="user", content="hi", name=huge)])
    # Bad UTF-8 in a name, on the wire, is named as a content's is.
    raw = pb.GenerateRequest(messages=[yo, pb.ChatMessage(role="user", content="hi", name="XNX")])
    bad = raw.SerializeToString().replace(b"XNX", b"X\xffX")
    assert invalid_utf8_field(bad) == "messages[1].name"


def test_chat_without_a_template_or_refused_by_it_names_messages():
    import copy

    msgs = [pb.ChatMessage(role="user", content="hi")]
    bare = copy.deepcopy(TOK)
    bare.chat_template = None
    with pytest.raises(InvalidRequestError) as info:
        check_request(request_fields(pb.GenerateRequest(messages=msgs)), bare, LIMITS)
    assert info.value.field == "messages" and "no chat template" in str(info.value)
    strict = copy.deepcopy(TOK)
    strict.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(InvalidRequestError) as info:
        check_request(request_fields(pb.GenerateRequest(messages=msgs)), strict, LIMITS)
    assert info.value.field == "messages" and "roles must alternate" in str(info.value)


def test_a_length_the_kv_cache_ended_is_not_a_stop_string(caplog):
    """A request that outgrew its worker's KV cache ends LENGTH with the engine's stop_reason
    kv_cache_capacity: the core's summary, and the wire, say it as length_reason, not as a stop
    string a client would take for one of its own."""
    from dataclasses import replace as _replace

    from prometheus_client import generate_latest

    from pdserve_client.metrics import by_labels, parse
    from router import status
    from router.convert import final_to_wire
    from router.core import RequestCore
    from router.core_types import RouterConfig
    from router.fake_backend import FakeBackend
    from router.http_shapes import pdserve
    from router.metrics import Metrics
    from router.vocab import FinishReason
    from tests.test_router_core import TOKENIZER, consume, request, run

    class Cut(FakeBackend):
        async def generate(self, *args, **kw):  # type: ignore[override]
            async for chunk in super().generate(*args, **kw):
                if chunk.finished:
                    chunk = _replace(chunk, finish_reason="length", stop_reason="kv_cache_capacity")
                yield chunk

    async def main(backend, sink=None):
        core = RequestCore(backend, await backend.infos(), RouterConfig(), TOKENIZER, sink)
        await core.refresh()
        return (await consume(core, request("r")))[-1].final

    metrics = Metrics()
    with caplog.at_level(logging.INFO, "pdserve.router"):
        cut = run(main(Cut(), metrics))
    said = [r.getMessage() for r in caplog.records if "cut short" in r.getMessage()]
    assert len(said) == 1 and "kv_cache_capacity" in said[0] and "--kv-cache-gib" in said[0]
    assert cut.finish_reason is FinishReason.LENGTH and cut.stop_reason is None
    assert cut.length_reason == "kv_cache_capacity"
    # Counted apart from the length finishes of max_tokens, and `pdserve status` says it.
    done = run(main(FakeBackend(), metrics))
    samples = parse(generate_latest(metrics.registry).decode())
    assert by_labels(samples, "pdserve_requests_cut_short_total", "reason") == {
        ("kv_cache_capacity",): 1.0
    }
    assert by_labels(samples, "pdserve_requests_total", "finish_reason") == {("length",): 2.0}
    said = status.render(samples, samples, 1.0, "test")
    assert "finish: length 2 (of them cut short: kv_cache_capacity 1)\n" in said, said
    wire = final_to_wire(cut)
    assert wire.WhichOneof("stop_reason") is None and wire.length_reason == "kv_cache_capacity"
    assert pdserve(cut)["length_reason"] == "kv_cache_capacity"
    assert pdserve(cut)["stop_reason"] is None
    stopped = final_to_wire(_replace(done, finish_reason=FinishReason.STOP, stop_reason="END"))
    assert stopped.stop_string == "END" and stopped.length_reason == ""

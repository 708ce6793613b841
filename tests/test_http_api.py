"""The OpenAI-compatible HTTP API end to end: a real server (1 prefill x 1 decode Ray worker, a
tiny model) with both front doors, the unmodified `openai` client on --http-port, and the gRPC
client on --port, asked the same greedy requests."""

from __future__ import annotations

import time

import grpc
import httpx2 as httpx
import openai
import pytest

from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc
from tests.grpc_server import ServerThread, tiny_config
from tests.helpers import hf_greedy, random_prompts
from tests.test_cluster import kv_block_bytes
from tests.test_router_grpc import assert_pools_full, received

MODEL = "tiny-llama"
MAX_NEW = 12
PROMPT = "The capital of France is"
CHAT = [
    {"role": "system", "content": "You answer briefly."},
    {"role": "user", "content": "What is the capital of France?"},
]
PATHS = {"colocated": pb.PATH_COLOCATED, "disaggregated": pb.PATH_DISAGGREGATED}


@pytest.fixture(scope="module")
def srv():
    s = ServerThread(tiny_config(http_port=0, metrics_port=0))
    yield s
    s.close()


@pytest.fixture(autouse=True)
def pools_full_after_each_test(srv):
    """After each test every live worker's pool is full and idle, and the router's books are
    empty."""
    yield
    assert_pools_full(srv, within_s=5)


@pytest.fixture(scope="module")
def stub(srv):
    with grpc.insecure_channel(srv.address) as channel:
        yield pb_grpc.GenerationStub(channel)


@pytest.fixture(scope="module")
def base(srv) -> str:
    return f"http://127.0.0.1:{srv.server.http_port}"


@pytest.fixture(scope="module")
def client(base):
    with openai.OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0) as c:
        yield c


def grpc_answer(stub, path: str, **kw) -> tuple[str, list[int], pb.FinalInfo]:
    req = pb.GenerateRequest(
        sampling=pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0), path=PATHS[path], **kw
    )
    resp = stub.Complete(req, timeout=60)
    return resp.text, list(resp.token_ids), resp.final


@pytest.mark.timeout(240)
@pytest.mark.parametrize("path", ["colocated", "disaggregated"])
def test_openai_client_gets_the_grpc_text_through_every_call(srv, stub, client, path):
    """completions.create and chat.completions.create, whole and streamed, give the text the
    gRPC API gives for the same greedy request, on both paths (the disaggregated ones move KV and
    never fall back); gRPC's tokens are transformers' own greedy ones."""
    before = received(srv)
    text, ids, final = grpc_answer(stub, path, prompt=PROMPT)
    prompt_ids = list(srv.server.core.tokenizer(PROMPT)["input_ids"])
    assert ids == hf_greedy(MODEL, prompt_ids, MAX_NEW)[: len(ids)] and len(ids) > 0
    chat_text, _, _ = grpc_answer(stub, path, messages=[pb.ChatMessage(**m) for m in CHAT])
    opts = {"max_tokens": MAX_NEW, "temperature": 0, "extra_body": {"pdserve": {"path": path}}}

    whole = client.completions.create(model=MODEL, prompt=PROMPT, **opts)
    assert whole.choices[0].text == text
    assert whole.usage.prompt_tokens == final.usage.prompt_tokens
    assert whole.usage.completion_tokens == len(ids)
    info = whole.model_extra["pdserve"]
    assert info["path"] == path and info["kv_fallback"] is None and info["ttft_ms"] > 0
    assert info["decode_worker"] == "decode-0"
    assert info["prefill_worker"] == ("prefill-0" if path == "disaggregated" else None)

    streamed = client.completions.create(model=MODEL, prompt=PROMPT, stream=True, **opts)
    assert "".join(c.choices[0].text for c in streamed) == text

    chat = client.chat.completions.create(model=MODEL, messages=CHAT, **opts)
    assert chat.choices[0].message.content == chat_text
    assert chat.choices[0].message.role == "assistant"
    assert chat.choices[0].finish_reason in ("stop", "length")

    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=CHAT, stream=True, stream_options={"include_usage": True}, **opts
        )
    )
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat_text
    assert chunks[0].choices[0].delta.role == "assistant"
    usage = chunks[-1].usage  # include_usage: a last chunk with no choices and the usage
    assert not chunks[-1].choices and usage.completion_tokens == chat.usage.completion_tokens
    # The same chat prompt came three times before: its full blocks are in the prefix cache.
    assert usage.prompt_tokens_details.cached_tokens > 0
    n_dis = 6 if path == "disaggregated" else 0
    nbytes, ok = received(srv)
    assert ok - before[1] == n_dis and (nbytes > before[0]) == bool(n_dis)
    assert_pools_full(srv, within_s=2.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["colocated", "disaggregated"])
def test_penalties_and_logit_bias_reach_the_engine_through_both_doors(srv, stub, client, path):
    """A bias of 100 forces its token at every step; penalties and biases sent over HTTP give
    the text gRPC gives for the same request, which is not the plain request's."""
    forced = pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0, logit_bias={42: 100.0})
    resp = stub.Complete(pb.GenerateRequest(prompt=PROMPT, sampling=forced, path=PATHS[path]),
                         timeout=60)  # fmt: skip
    assert list(resp.token_ids) == [42] * MAX_NEW
    sampling = pb.SamplingParams(max_tokens=MAX_NEW, temperature=0.0, repetition_penalty=1.5,
                                 presence_penalty=1.0, frequency_penalty=0.5,
                                 logit_bias={7: 3.0, 1: -100.0})  # fmt: skip
    resp = stub.Complete(pb.GenerateRequest(prompt=PROMPT, sampling=sampling, path=PATHS[path]),
                         timeout=60)  # fmt: skip
    plain, _, _ = grpc_answer(stub, path, prompt=PROMPT)
    assert resp.text != plain
    got = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=MAX_NEW, temperature=0, presence_penalty=1.0,
        frequency_penalty=0.5, logit_bias={"7": 3.0, "1": -100.0},
        extra_body={"repetition_penalty": 1.5, "pdserve": {"path": path}},
    )  # fmt: skip
    assert got.choices[0].text == resp.text
    assert_pools_full(srv, within_s=2.0)


@pytest.mark.timeout(120)
def test_n_choices_whole_and_streamed_are_seeded_apart_and_counted_together(srv, client):
    """n seeded choices: choice 0 is the request with n = 1, the others differ and come back the
    same with the same seed; streamed, each choice's deltas (after its own role chunk) make the
    whole answer's text; usage counts the prompt once and every choice's tokens."""
    opts = {"max_tokens": MAX_NEW, "temperature": 1.0, "seed": 5,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    one = client.completions.create(model=MODEL, prompt=PROMPT, **opts)
    three = client.completions.create(model=MODEL, prompt=PROMPT, n=3, **opts)
    texts = [c.text for c in sorted(three.choices, key=lambda c: c.index)]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert texts[0] == one.choices[0].text and len(set(texts)) == 3
    again = client.completions.create(model=MODEL, prompt=PROMPT, n=3, **opts)
    assert [c.text for c in again.choices] == texts
    assert all("stop_reason" in c.model_extra for c in three.choices)  # per choice, as vLLM's
    assert three.usage.prompt_tokens == one.usage.prompt_tokens
    assert three.usage.completion_tokens == 3 * MAX_NEW

    whole = client.chat.completions.create(model=MODEL, messages=CHAT, n=2, **opts)
    chunks = list(client.chat.completions.create(
        model=MODEL, messages=CHAT, n=2, stream=True, stream_options={"include_usage": True},
        **opts,
    ))  # fmt: skip
    streamed: dict[int, str] = {}
    for c in chunks:
        for choice in c.choices:
            if choice.index not in streamed:
                assert choice.delta.role == "assistant"  # each choice opens with its role
            streamed[choice.index] = streamed.get(choice.index, "") + (choice.delta.content or "")
    assert streamed == {c.index: c.message.content for c in whole.choices}
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 2 * MAX_NEW
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens  # the prompt once
    assert_pools_full(srv, within_s=2.0)


@pytest.mark.timeout(120)
def test_a_batch_of_prompts_answers_each_with_its_n_choices_in_openais_order(srv, client):
    """A completion's list of prompts (text or token ids), n choices each: choice k*n + j is
    prompt k's, the answer it gets alone, whole and streamed, with its own logprobs offsets;
    usage counts each prompt once and every choice's tokens."""
    texts = ["The capital of France is", "Once upon a time"]
    opts = {"max_tokens": MAX_NEW, "temperature": 0, "logprobs": 1,
            "extra_body": {"ignore_eos": True}}  # fmt: skip
    alone = [client.completions.create(model=MODEL, prompt=t, **opts) for t in texts]
    got = client.completions.create(model=MODEL, prompt=texts, n=2, **opts)
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    # How each choice was served, each its own request (the answer's own object: choice 0's).
    assert all(c.model_extra["pdserve"]["decode_worker"] for c in got.choices)
    assert got.model_extra["pdserve"] == got.choices[0].model_extra["pdserve"]
    for c in got.choices:
        single = alone[c.index // 2].choices[0]
        assert c.text == single.text and c.logprobs.text_offset == single.logprobs.text_offset
    assert alone[0].choices[0].logprobs.text_offset != alone[1].choices[0].logprobs.text_offset
    assert got.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert got.usage.completion_tokens == 4 * MAX_NEW
    streamed: dict[int, str] = {}
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=texts, n=2, stream=True, stream_options={"include_usage": True},
            **opts,
        )
    )  # fmt: skip
    for chunk in chunks:
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
    assert streamed == {c.index: c.text for c in got.choices}
    assert chunks[-1].usage.prompt_tokens == got.usage.prompt_tokens  # each prompt once
    ids = random_prompts([9, 23, 14], seed=41)
    by_ids = client.completions.create(model=MODEL, prompt=ids, max_tokens=MAX_NEW,
                                       temperature=0, extra_body={"ignore_eos": True})  # fmt: skip
    for c in by_ids.choices:  # each prompt's own greedy tokens
        want = client.completions.create(
            model=MODEL, prompt=ids[c.index], max_tokens=MAX_NEW, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert c.text == want.choices[0].text
    assert len(by_ids.choices) == 3 and by_ids.usage.prompt_tokens == 9 + 23 + 14
    assert_pools_full(srv, within_s=2.0)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("inline_chars", [0, 1 << 30], ids=["large", "small"])
def test_a_large_batch_is_checked_off_the_event_loop(srv, client, monkeypatch, inline_chars):
    """A batch whose prompts together pass TOKENIZE_INLINE_CHARS is tokenized on a thread, so
    the loop keeps serving; a small one on the loop (a thread's hop costs more than it)."""
    import threading

    import router.http_api
    import router.request

    threads: list[int] = []
    check = router.http_api.check_request

    def noted(*args, **kwargs):
        threads.append(threading.get_ident())
        return check(*args, **kwargs)

    monkeypatch.setattr(router.http_api, "check_request", noted)
    monkeypatch.setattr(router.request, "TOKENIZE_INLINE_CHARS", inline_chars)
    got = client.completions.create(model=MODEL, prompt=["a", "b"], max_tokens=2, temperature=0)
    assert len(got.choices) == 2 and len(threads) == 2
    loop = srv._thread.ident
    assert all((t != loop) is (inline_chars == 0) for t in threads), (threads, loop)


@pytest.mark.timeout(120)
def test_n_greedy_choices_handed_off_move_the_prompts_kv_once(srv, client):
    """Each choice is a request of its own, handed off (each completes a transfer, none falls
    back), each greedy choice the answer to the prompt alone. Choice 0 goes first, so the others
    find the prompt in the prefix caches of the prefill and decode workers and send only its
    last block: four choices move less than twice what one choice of a prompt as long moves
    (started together, each moved the whole prompt: four times)."""
    one, four = random_prompts([41, 41], seed=7)  # 4-token blocks: 10 whole ones, and 1 token
    body = {"model": MODEL, "max_tokens": MAX_NEW, "temperature": 0,
            "extra_body": {"pdserve": {"path": "disaggregated"}}}  # fmt: skip
    before = received(srv)
    client.completions.create(prompt=one, **body)
    after_one = received(srv)
    got = client.completions.create(prompt=four, n=4, **body)
    nbytes, ok = received(srv)
    alone = client.completions.create(prompt=four, **body).choices[0].text
    assert [c.text for c in got.choices] == [alone] * 4
    assert ok - after_one[1] == 4 and got.model_extra["pdserve"]["kv_fallback"] is None
    moved_one, moved_four = after_one[0] - before[0], nbytes - after_one[0]
    assert 0 < moved_one < moved_four < 2 * moved_one, (moved_one, moved_four)
    assert_pools_full(srv, within_s=2.0)


@pytest.mark.timeout(120)
def test_the_choices_bench_measures_both_orders_on_the_servers_workers(srv):
    """router/choices_bench.py's measurement: started together, 3 handed-off choices of a
    41-token prompt move its KV 3 times; choice 0 first, once and a block twice."""
    from router.choices_bench import choices
    from router.vocab import RoutePath

    together, first = random_prompts([41, 41], seed=9)
    cluster = srv.server.cluster
    block = kv_block_bytes("tiny-llama", 4)  # one block of 4 tokens, from the model's config
    assert block > 0
    before, fell = received(srv), list(cluster.fallbacks)
    got = {
        order: srv.run(choices(cluster, ids, RoutePath.DISAGGREGATED, 3, 4, order))
        for order, ids in (("together", together), ("first", first))
    }
    assert got["together"]["all_done_s"] >= got["together"]["all_first_token_s"] > 0
    assert got["together"]["kv_bytes"] == 3 * 11 * block  # 11 blocks of 4 tokens a prompt
    assert got["first"]["kv_bytes"] == (11 + 2) * block
    # All six choices were handed off: six transfers completed, none fell back.
    nbytes, ok = received(srv)
    assert ok - before[1] == 6 and nbytes - before[0] == (3 * 11 + 11 + 2) * block
    assert list(cluster.fallbacks) == fell
    assert_pools_full(srv, within_s=2.0)


def _token_bytes(token: str) -> bytes:
    if token.startswith("bytes:"):
        return bytes(int(h, 16) for h in token[len("bytes:") :].split("\\x")[1:])
    return token.encode()


def test_chat_logprobs_and_completion_logprobs_have_openai_shapes(srv, client):
    chat = client.chat.completions.create(
        model=MODEL, messages=CHAT, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4)  # greedy
    comp = client.completions.create(
        model=MODEL, prompt=[5, 6, 7, 8], max_tokens=8, temperature=0, logprobs=5
    )
    lp = comp.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 8
    # A token that holds part of a character is its bytes ("bytes:\\xf0\\x9f", as OpenAI's):
    # the tokens rebuild the text; and no two alternatives share one key and merge.
    assert any(t.startswith("bytes:") for lp_top in lp.top_logprobs for t in lp_top), "untested"
    rebuilt = b"".join(_token_bytes(t) for t in lp.tokens).decode("utf-8", "replace")
    assert rebuilt == comp.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) >= 5 and top[token] == logprob, (token, logprob, top)
    # The sampled token is always among a completion token's top_logprobs (OpenAI's and
    # vLLM's): with logprobs 0, it alone.
    comp = client.completions.create(
        model=MODEL, prompt=[5, 6, 7, 8], max_tokens=4, temperature=0, logprobs=0
    )
    lp = comp.choices[0].logprobs
    assert lp.top_logprobs == [{t: x} for t, x in zip(lp.tokens, lp.token_logprobs)]


@pytest.mark.timeout(120)
def test_echo_puts_the_prompt_and_its_logprobs_before_the_completion_as_lm_eval_reads_them(
    srv, client
):
    """lm-evaluation-harness's loglikelihood request (echo, logprobs 1, max_tokens 1, token ids,
    a batch): each choice's text is its prompt's then the completion's; its logprobs list the
    prompt's tokens first (the first one's null, the others transformers' logits' log-softmax)
    and then the completion's, their text offsets over the whole text. Streamed, the first chunk
    brings the prompt. Without logprobs, echo only puts the prompt's text first."""
    from tests.test_prompt_logprobs import reference_logprobs

    tok = srv.server.core.tokenizer
    texts = ["The capital of France is", "One, two, three, four, five"]
    prompts = [list(tok(t)["input_ids"]) for t in texts]
    whole = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=1, temperature=0, logprobs=1, echo=True
    )
    streamed = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=1, temperature=0, logprobs=1, echo=True,
        stream=True,
    )  # fmt: skip
    chunks = [c.choices[0] for c in streamed if c.choices]
    for k, (prompt, c) in enumerate(zip(prompts, whole.choices)):
        alone = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, temperature=0)
        prompt_text = tok.decode(prompt, skip_special_tokens=True)
        assert c.index == k and c.text == prompt_text + alone.choices[0].text
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == len(prompt) + 1
        assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        ref = reference_logprobs(prompt)
        for p in range(1, len(prompt)):
            assert lp.token_logprobs[p] == pytest.approx(float(ref[p - 1, prompt[p]]), abs=1e-4)
            assert lp.tokens[p] in lp.top_logprobs[p] and len(lp.top_logprobs[p]) <= 2
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
        assert lp.text_offset[-1] == len(prompt_text)  # the completion's token after the prompt
        mine = [ch for ch in chunks if ch.index == k]
        assert mine[0].text.startswith(prompt_text) and "".join(ch.text for ch in mine) == c.text
        got = [t for ch in mine for t in ch.logprobs.token_logprobs]  # batched apart: float noise
        assert got[0] is None and got[1:] == pytest.approx(lp.token_logprobs[1:], abs=1e-4)
        assert [t for ch in mine for t in ch.logprobs.text_offset] == lp.text_offset
    assert whole.usage.prompt_tokens == sum(map(len, prompts))
    assert whole.usage.completion_tokens == len(prompts)  # the prompts are not completion
    # max_tokens 0 with echo: the prompt alone, as OpenAI's scoring requests ask for it.
    scored = client.completions.create(
        model=MODEL, prompt=prompts, max_tokens=0, temperature=0, logprobs=0, echo=True
    )
    for prompt, c, full in zip(prompts, scored.choices, whole.choices):
        assert c.text == tok.decode(prompt, skip_special_tokens=True)
        assert c.finish_reason == "length" and len(c.logprobs.tokens) == len(prompt)
        assert c.logprobs.token_logprobs == pytest.approx(full.logprobs.token_logprobs[:-1],
                                                          abs=1e-4)  # fmt: skip
    assert scored.usage.completion_tokens == 0
    (only,) = [c.choices[0] for c in client.completions.create(
        model=MODEL, prompt=prompts[0], max_tokens=0, temperature=0, echo=True, stream=True
    ) if c.choices]  # fmt: skip
    assert only.text == tok.decode(prompts[0], skip_special_tokens=True)
    assert only.finish_reason == "length"
    # n choices of a batch: each prompt's choice 0 computes its logprobs (colocated), its other
    # choices get them; whole and streamed, each choice's prompt its own.
    opts = {"model": MODEL, "prompt": prompts, "n": 2, "max_tokens": 2, "temperature": 0.8,
            "seed": 3, "logprobs": 1, "echo": True}  # fmt: skip
    two = client.completions.create(**opts)
    two_streamed: dict[int, list] = {}
    for c in client.completions.create(**opts, stream=True):
        for ch in c.choices:
            two_streamed.setdefault(ch.index, []).extend(ch.logprobs.token_logprobs)
    for c in two.choices:
        k = c.index // 2
        head = c.logprobs.token_logprobs[: len(prompts[k])]
        assert head[1:] == pytest.approx(whole.choices[k].logprobs.token_logprobs[1:-1], abs=1e-4)
        streamed_head = two_streamed[c.index][: len(prompts[k])]
        assert streamed_head[0] is None and streamed_head[1:] == pytest.approx(head[1:], abs=1e-4)
        reason = c.model_extra["pdserve"]["decision_reason"]
        assert ("prompt logprobs" in reason) == (c.index % 2 == 0), (c.index, reason)
    plain = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0, echo=True
    )
    alone = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=3, temperature=0)
    assert plain.choices[0].text == PROMPT + alone.choices[0].text
    assert plain.choices[0].logprobs is None


@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [1, 3])
@pytest.mark.parametrize("path", ["colocated", "disaggregated"])
def test_closing_a_stream_mid_answer_frees_its_blocks_within_a_second(srv, base, path, n):
    body = {
        "model": MODEL,
        "prompt": [3] * 40,
        "max_tokens": 900,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "n": n,
        "pdserve": {"path": path},
    }
    with httpx.Client(timeout=30) as http:
        with http.stream("POST", base + "/v1/completions", json=body) as resp:
            assert resp.status_code == 200
            events = 0
            for line in resp.iter_lines():
                if line.startswith("data: "):
                    events += 1
                    if events >= 3:
                        break
    # the connection is closed here, mid-answer: the router's books and every pool empty at once
    assert_pools_full(srv, within_s=1.0)


def test_bad_requests_get_a_400_naming_the_parameter_and_the_server_keeps_serving(
    srv, base, client
):
    cases = [
        ({"model": MODEL, "prompt": "x", "n": 17}, "n"),
        ({"model": MODEL, "prompt": "x", "n": 0}, "n"),
        ({"model": MODEL, "prompt": "x", "max_tokens": -1}, "max_tokens"),
        ({"model": MODEL, "prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0: only with echo
        ({"model": MODEL, "prompt": "x", "temperature": 2.5}, "temperature"),
        ({"model": MODEL, "prompt": "x", "max_tokens": "ten"}, "max_tokens"),
        ({"model": MODEL, "prompt": 7}, "prompt"),
        # The prompt's logprobs are computed where it is prefilled: not on a handoff.
        (
            {
                "model": MODEL,
                "prompt": "x",
                "echo": True,
                "logprobs": 0,
                "pdserve": {"path": "disaggregated"},
            },
            "echo",
        ),
        ({"model": MODEL, "prompt": [300]}, "prompt"),  # a token id outside the vocabulary
        ({"model": MODEL, "prompt": [[5, 6], [300]]}, "prompt[1]"),  # a batch's second prompt
        ({"model": MODEL, "prompt": ["x"] * 257}, "prompt"),  # past MAX_PROMPTS
        # A batch's prompt too long for max_tokens: the field, and which prompt.
        ({"model": MODEL, "prompt": [[5], [5] * 100], "max_tokens": 1000}, "max_tokens"),
    ]
    with httpx.Client(timeout=30) as http:
        for body, param in cases:
            resp = http.post(base + "/v1/completions", json=body)
            assert resp.status_code == 400, (body, resp.text)
            err = resp.json()["error"]
            assert err["param"] == param and param in err["message"], (body, err)
            if param == "max_tokens" and isinstance(body["prompt"][0], list):  # a batch's
                assert err["message"].endswith("(prompt[1])"), err
            assert err["type"] == "invalid_request_error"
        resp = http.post(
            base + "/v1/completions",
            content=b"{not json",
            headers={"content-type": "application/json"},
        )
        assert resp.status_code == 400 and "JSON" in resp.json()["error"]["message"]
        resp = http.post(base + "/v1/completions", json={"model": "gpt-4", "prompt": "x"})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
        resp = http.post(
            base + "/v1/chat/completions",
            json={"model": MODEL, "messages": CHAT, "max_completion_tokens": 0},
        )
        assert resp.status_code == 400
        assert resp.json()["error"]["param"] == "max_completion_tokens"
        assert http.get(base + "/health").json() == {"status": "ok"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x")
    ok = client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    assert ok.usage.completion_tokens >= 1
    assert_pools_full(srv, within_s=2.0)


def test_tokenize_and_detokenize_give_the_ids_a_request_gets(srv, base, client):
    """vLLM's /tokenize counts what a completion or a chat of the same text is charged as
    prompt tokens, a prompt past the context included; /detokenize gives the ids' text."""
    tok = srv.server.core.tokenizer
    with httpx.Client(timeout=30) as http:
        got = http.post(base + "/tokenize", json={"model": MODEL, "prompt": PROMPT}).json()
        done = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=1)
        assert got["count"] == len(got["tokens"]) == done.usage.prompt_tokens
        assert got["tokens"] == list(tok(PROMPT)["input_ids"])
        context = http.get(base + "/v1/models").json()["data"][0]["max_model_len"]
        assert got["max_model_len"] == context
        chat = http.post(base + "/tokenize", json={"messages": CHAT}).json()
        said = client.chat.completions.create(model=MODEL, messages=CHAT, max_tokens=1)
        assert chat["count"] == said.usage.prompt_tokens
        long = http.post(base + "/tokenize", json={"prompt": "ab " * 1200}).json()
        assert long["count"] > context  # counted, not refused
        strs = http.post(base + "/tokenize", json={"prompt": PROMPT, "return_token_strs": True,
                                                   "add_special_tokens": False}).json()  # fmt: skip
        assert strs["token_strs"] == tok.convert_ids_to_tokens(strs["tokens"])
        assert strs["tokens"] == tok(PROMPT, add_special_tokens=False)["input_ids"]
        text = http.post(base + "/detokenize", json={"tokens": got["tokens"]}).json()
        assert text == {"prompt": tok.decode(got["tokens"])} and PROMPT in text["prompt"]
        for route, body, param, says in [
            ("/tokenize", {"prompt": "x", "messages": CHAT}, "prompt", "exactly one"),
            ("/tokenize", {"prompt": 5}, "prompt", "string"),  # text only, not a batch's shapes
            ("/tokenize", {"prompt": "x", "add_generation_prompt": True}, "add_generation_prompt",
             "only with messages"),
            ("/tokenize", {"messages": CHAT, "add_special_tokens": True}, "add_special_tokens",
             "only false"),
            ("/detokenize", {"tokens": [5, 259]}, "tokens", "outside"),
            ("/detokenize", {"tokens": ["5"]}, "tokens", "integer"),
            ("/detokenize", {"tokens": [5] * ((1 << 20) + 1)}, "tokens", "at most 1048576"),
        ]:  # fmt: skip
            resp = http.post(base + route, json=body)
            assert resp.status_code == 400, (route, body, resp.text)
            err = resp.json()["error"]
            assert err["param"].startswith(param) and says in err["message"], err
        wrong = http.post(base + "/tokenize", json={"model": "other", "prompt": "x"})
        assert wrong.status_code == 404 and wrong.json()["error"]["code"] == "model_not_found"


def test_models_health_and_openapi(base, client):
    assert [m.id for m in client.models.list().data] == [MODEL]
    with httpx.Client(timeout=30) as http:
        assert http.get(base + "/health").status_code == 200
        doc = http.get(base + "/openapi.json").json()
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models"} <= set(doc["paths"])


def test_http_requests_are_labelled_in_the_metrics(srv, stub, client):
    client.completions.create(model=MODEL, prompt="x", max_tokens=2, temperature=0)
    grpc_answer(stub, "colocated", prompt="x")
    deadline = time.monotonic() + 5
    port = srv.server.metrics_port
    while True:
        text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        lines = [ln for ln in text.splitlines() if ln.startswith("pdserve_requests_total{")]
        counted = {door for door in ("http", "grpc") for ln in lines
                   if f'frontend="{door}"' in ln and not ln.endswith(" 0.0")}  # fmt: skip
        if counted == {"http", "grpc"}:
            break
        assert time.monotonic() < deadline, lines
        time.sleep(0.1)


def test_stop_reason_names_a_stop_token_and_is_null_at_the_models_own_end(srv, client):
    """As vLLM's: null where EOS ended it, the id where a stop_token_ids entry did (both here the
    same token, made certain with a bias); gRPC's FinalInfo leaves stop_reason unset."""
    from engine.config import ModelConfig
    from engine.loader import load_tokenizer

    eos = load_tokenizer(ModelConfig(model=MODEL)).eos_token_id
    forced = {"logit_bias": {str(eos): 100}}
    end = client.completions.create(model=MODEL, prompt=[5, 6, 7], max_tokens=5, extra_body=forced)
    assert (end.choices[0].finish_reason, end.choices[0].model_extra["stop_reason"]) == (
        "stop",
        None,
    )
    asked = client.completions.create(
        model=MODEL, prompt=[5, 6, 7], max_tokens=5,
        extra_body={**forced, "stop_token_ids": [eos]},
    )  # fmt: skip
    assert asked.choices[0].model_extra["stop_reason"] == eos
    with grpc.insecure_channel(srv.address) as ch:
        sampling = pb.SamplingParams(max_tokens=5, logit_bias={eos: 100})
        req = pb.GenerateRequest(prompt_token_ids=[5, 6, 7], sampling=sampling)
        final = pb_grpc.GenerationStub(ch).Complete(req, timeout=60).final
    assert final.finish_reason == pb.FINISH_REASON_STOP and final.WhichOneof("stop_reason") is None

"""The HTTP API's edges, on a server whose pools are the instant fake backend (no Ray): TLS and
mutual TLS, the bearer token (health stays open), 429 with Retry-After from admission and from
the per-client limit, 503 with no decode worker and when a worker fails mid-answer, and the
OpenAPI document."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import threading
import time
from dataclasses import replace

import grpc
import httpx2 as httpx
import openai
import pytest

from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc
from router import client_limit, http_conn
from router.core_types import RouterConfig
from router.errors import WorkerLost
from router.fake_backend import FakeBackend
from router.refusal_log import Said
from router.security import SecurityConfig
from router.serve_config import ServeConfig
from tests.grpc_server import ServerThread
from tests.test_security import TOKENIZER, pki  # noqa: F401 (a fixture)

MODEL = "smollm2-135m"  # the name the server reports (ServeConfig's cluster model)
BODY = {"model": MODEL, "prompt": [1, 2, 3], "max_tokens": 4}


def server(backend: FakeBackend | None = None, **kw) -> ServerThread:
    config = ServeConfig(**{"port": 0, "metrics_port": None, "http_port": 0, **kw})
    return ServerThread(config, backend=backend or FakeBackend(), tokenizer=TOKENIZER)


def base(s: ServerThread, scheme: str = "http") -> str:
    return f"{scheme}://127.0.0.1:{s.server.http_port}"


def _ctx(pki, client_cert: bool = False) -> ssl.SSLContext:  # noqa: F811
    ctx = ssl.create_default_context(cafile=str(pki["ca.pem"]))
    if client_cert:
        ctx.load_cert_chain(str(pki["client.pem"]), str(pki["client.key"]))
    return ctx


@pytest.mark.timeout(120)
def test_tls_and_mutual_tls(pki):  # noqa: F811
    s = server(security=SecurityConfig(tls_cert=pki["server.pem"], tls_key=pki["server.key"]))
    try:
        with httpx.Client(verify=_ctx(pki), timeout=30) as http:
            c = openai.OpenAI(base_url=base(s, "https") + "/v1", api_key="x", http_client=http)
            assert c.completions.create(**BODY).usage.completion_tokens == 4
        with httpx.Client(timeout=30) as plain, pytest.raises(httpx.TransportError):
            plain.post(base(s) + "/v1/completions", json=BODY)  # plaintext to a TLS port
    finally:
        s.close()
    s = server(
        security=SecurityConfig(
            tls_cert=pki["server.pem"], tls_key=pki["server.key"], tls_client_ca=pki["ca.pem"]
        )
    )
    try:
        url = base(s, "https") + "/v1/completions"
        with httpx.Client(verify=_ctx(pki, client_cert=True), timeout=30) as http:
            assert http.post(url, json=BODY).status_code == 200
        with httpx.Client(verify=_ctx(pki), timeout=30) as http:
            with pytest.raises(httpx.TransportError):
                http.post(url, json=BODY)  # no client certificate
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_a_bearer_token_is_checked_on_every_route_but_health(pki):  # noqa: F811
    s = server(security=SecurityConfig(auth_token_file=pki["token"]))
    try:
        token = pki["token"].read_text().strip()
        good = openai.OpenAI(base_url=base(s) + "/v1", api_key=token, max_retries=0)
        assert good.completions.create(**BODY).usage.completion_tokens == 4
        assert [m.id for m in good.models.list().data] == [MODEL]
        for key in ("wrong", ""):
            bad = openai.OpenAI(base_url=base(s) + "/v1", api_key=key or "-", max_retries=0)
            with pytest.raises(openai.AuthenticationError) as err:
                bad.completions.create(**BODY)
            assert err.value.status_code == 401
            assert err.value.body["code"] == "invalid_api_key"
        with httpx.Client(timeout=30) as http:
            assert http.post(base(s) + "/v1/chat/completions", json={}).status_code == 401
            assert http.get(base(s) + "/v1/models").status_code == 401
            assert http.get(base(s) + "/health").status_code == 200
            doc = http.get(base(s) + "/openapi.json").json()
            assert http.get(base(s) + "/docs").status_code == 200
            for closed in ("/redoc", "/docs/oauth2-redirect", "/nowhere", "/health/"):
                assert http.get(base(s) + closed).status_code == 401, closed
            # The scheme in any case (HTTP's rule); what follows it is the token exactly.
            lower = http.get(base(s) + "/v1/models", headers={"authorization": f"bearer {token}"})
            assert lower.status_code == 200
            # Refused before the body is read: neither its size nor its JSON is looked at.
            junk = http.post(base(s) + "/v1/completions", content=b"{not json")
            assert junk.status_code == 401 and junk.json()["error"]["code"] == "invalid_api_key"
        assert "HTTPBearer" in doc["components"]["securitySchemes"]
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_a_body_over_the_limit_is_refused_before_it_is_read_whole():
    from router.http_guard import MAX_BODY_BYTES

    s = server()
    url = base(s) + "/v1/completions"
    try:
        with httpx.Client(timeout=60, headers={"content-type": "application/json"}) as http:
            pad = " " * (MAX_BODY_BYTES - len(json.dumps(BODY)))
            ok = http.post(url, content=json.dumps(BODY) + pad)  # at the limit: served
            assert ok.status_code == 200, ok.text

            def chunks():  # no Content-Length: counted as it arrives
                yield json.dumps(BODY).encode()
                for _ in range(MAX_BODY_BYTES // (1 << 20) + 1):
                    yield b" " * (1 << 20)

            for body in (json.dumps(BODY) + pad + " ", chunks()):
                big = http.post(url, content=body)
                assert big.status_code == 413, big.text
                err = big.json()["error"]
                assert (err["param"], err["code"]) == ("body", "request_too_large")
                assert err["message"] == "body: over 16 MiB"
            assert http.post(url, json=BODY).status_code == 200  # still serving
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_admission_and_the_client_limit_answer_429_with_retry_after():
    gate = asyncio.Event()
    s = server(FakeBackend(gate=gate), router=RouterConfig(max_pending=1), max_streams_per_client=2)
    url = base(s) + "/v1/completions"
    try:
        with httpx.Client(timeout=30) as http:
            held = _hold(s, url, 1)  # waits at the gate: the one request allowed to wait
            full = http.post(url, json=BODY)
            assert full.status_code == 429, full.text
            assert int(full.headers["retry-after"]) >= 1 and int(full.headers["retry-after-ms"]) > 0
            assert full.json()["error"]["code"] == "queue_full"
            # Choices stand or fall together: two that the queue cannot hold are refused once,
            # and none of them runs (nor counts as a request cancelled); more than
            # --max-pending could never be admitted (400 naming n).
            sample = s.server.metrics.registry.get_sample_value
            counted = {"reason": "queue_full", "frontend": "http"}
            refused = sample("pdserve_admission_rejections_total", counted)
            started = len(s.server.core.backend.started)
            s.server.core.config = RouterConfig(max_pending=2)
            s.server.clients.limit = None  # the queue alone: room for one choice, not two
            both = http.post(url, json={**BODY, "n": 2})
            assert both.status_code == 429 and both.json()["error"]["code"] == "queue_full"
            assert sample("pdserve_admission_rejections_total", counted) == refused + 1
            assert len(s.server.core.backend.started) == started  # neither choice ran
            labels = {"path": "colocated", "finish_reason": "abort", "frontend": "http"}
            assert not sample("pdserve_requests_total", labels)
            s.server.core.config = RouterConfig(max_pending=1)
            many = http.post(url, json={**BODY, "n": 2})
            assert many.status_code == 400 and many.json()["error"]["param"] == "n", many.text
            assert "at most 1 wait for a first token at once (--max-pending)" in many.text
            s.server.clients.limit = 2
            _release(s, gate, held)
            # Two requests of this client wait; a third is over --max-streams-per-client.
            s.server.core.config = RouterConfig(max_pending=64)
            held = _hold(s, url, 2)
            third = http.post(url, json=BODY)
            assert third.status_code == 429 and third.json()["error"]["code"] == "client_limit"
            # The client is the socket's peer: a header naming another is not taken.
            forwarded = http.post(url, json=BODY, headers={"x-forwarded-for": "10.0.0.9"})
            assert forwarded.status_code == 429, forwarded.text
            assert forwarded.json()["error"]["code"] == "client_limit"
            _release(s, gate, held)
            s.run(_set(gate))
            assert http.post(url, json=BODY).status_code == 200
            # Each choice counts: three could never run under a limit of two (400 naming n),
            # two are served, and two more while one runs are over the limit (429).
            many = http.post(url, json={**BODY, "n": 3})
            assert many.status_code == 400 and many.json()["error"]["param"] == "n", many.text
            assert len(http.post(url, json={**BODY, "n": 2}).json()["choices"]) == 2
            gate.clear()
            held = _hold(s, url, 1)
            more = http.post(url, json={**BODY, "n": 2})
            assert more.status_code == 429 and "2 choices" in more.json()["error"]["message"]
            _release(s, gate, held)
            assert not s.server.clients._running  # every slot was given back
    finally:
        s.run(_set(gate))
        s.close()


def _hold(s: ServerThread, url: str, n: int) -> list[threading.Thread]:
    """n requests started on threads, once all of them wait for their first token."""
    threads = [
        threading.Thread(target=httpx.post, args=(url,), kwargs={"json": BODY, "timeout": 30})
        for _ in range(n)
    ]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while s.server.core.pending < n:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    return threads


def _release(s: ServerThread, gate: asyncio.Event, threads: list[threading.Thread]) -> None:
    s.run(_set(gate))
    for t in threads:
        t.join(30)
    gate.clear()


async def _set(event: asyncio.Event) -> None:
    event.set()


@pytest.mark.timeout(120)
def test_no_decode_worker_is_a_503_and_health_says_so():
    backend = FakeBackend()
    s = server(backend)
    try:
        backend.decode_ids = []
        with httpx.Client(timeout=30) as http:
            for gone in ("/redoc", "/docs/oauth2-redirect"):  # only /openapi.json and /docs
                assert http.get(base(s) + gone).status_code == 404, gone
            resp = http.post(base(s) + "/v1/completions", json=BODY)
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "no_workers"
            assert resp.headers["retry-after"] == "5"
            assert http.get(base(s) + "/health").status_code == 503
            assert http.head(base(s) + "/health").status_code == 503  # as load balancers probe
            backend.decode_ids = ["decode-0"]
            assert http.head(base(s) + "/health").status_code == 200
    finally:
        s.close()


class _SmallCache(FakeBackend):
    """Workers whose KV cache holds 2 blocks of 16 tokens: a prompt of at most 31 tokens."""

    def worker_info(self, worker_id):  # type: ignore[override]
        return replace(super().worker_info(worker_id), num_blocks=2)


@pytest.mark.timeout(120)
def test_a_prompt_the_kv_cache_cannot_hold_is_a_400_naming_it_on_both_doors(caplog):
    s = server(_SmallCache())
    # Said at start: a cache smaller than the context.
    assert "KV cache holds 32 tokens, less than the model's context" in caplog.text
    try:
        with httpx.Client(timeout=30) as http:
            resp = http.post(base(s) + "/v1/completions", json={**BODY, "prompt": [1] * 32})
            assert resp.status_code == 400, resp.text
            err = resp.json()["error"]
            assert err["param"] == "prompt" and "at most 31" in err["message"], err
            ok = http.post(base(s) + "/v1/completions", json={**BODY, "prompt": [1] * 31})
            assert ok.status_code == 200, ok.text  # and it goes on serving
            # A chat's prompt is what the chat template makes of its messages: named so.
            chat = {"model": MODEL, "messages": [{"role": "user", "content": "word " * 40}]}
            resp = http.post(base(s) + "/v1/chat/completions", json=chat)
            err = resp.json()["error"]
            assert resp.status_code == 400 and err["param"] == "messages", err
            assert err["message"].startswith("messages: has "), err
        with grpc.insecure_channel(s.address) as ch:
            req = pb.GenerateRequest(prompt_token_ids=[1] * 32)
            with pytest.raises(grpc.RpcError) as info:
                list(pb_grpc.GenerationStub(ch).Generate(req, timeout=30))
        assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
        assert "prompt" in info.value.details() and "at most 31" in info.value.details()
    finally:
        s.close()


class _Failing(FakeBackend):
    """A decode worker that dies after two tokens, every time (resumes fail too)."""

    async def generate(self, prompt_token_ids, params, *args, **kw):  # type: ignore[override]
        n = 0
        async for chunk in super().generate(prompt_token_ids, params, *args, **kw):
            yield chunk
            n += len(chunk.token_ids)
            if n >= 2:
                raise WorkerLost("decode-0", "killed")


@pytest.mark.timeout(120)
def test_a_worker_failing_mid_answer_is_a_503_or_an_error_event():
    s = server(_Failing(num_decode=1))
    try:
        with httpx.Client(timeout=30) as http:
            body = {**BODY, "max_tokens": 10}
            whole = http.post(base(s) + "/v1/completions", json=body)
            assert whole.status_code == 503, whole.text
            assert whole.json()["error"]["code"] == "worker_failed"
            with http.stream(
                "POST", base(s) + "/v1/completions", json={**body, "stream": True}
            ) as resp:
                lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
            assert resp.status_code == 200
            assert '"error"' in lines[-2] and "worker_failed" in lines[-2]
            assert lines[-1] == "data: [DONE]"  # the stream ends as an answer's does
            assert s.server.core.active == 0 and s.server.core.pending == 0
    finally:
        s.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True])
def test_a_client_leaving_before_its_first_token_aborts_the_request(stream):
    gate = asyncio.Event()
    backend = FakeBackend(gate=gate)
    s = server(backend)
    try:
        with httpx.Client(timeout=0.5) as http, pytest.raises(httpx.ReadTimeout):
            http.post(base(s) + "/v1/completions", json={**BODY, "stream": stream})
        deadline = time.monotonic() + 10  # the gate holds it: only the abort ends it
        while s.server.core.active or len(backend.closed) < 1:
            assert time.monotonic() < deadline, (s.server.core.active, backend.closed)
            time.sleep(0.02)
        assert s.server.core.pending == 0 and backend.closed == backend.started
    finally:
        s.run(_set(gate))
        s.close()


@pytest.mark.timeout(120)
def test_the_client_limit_counts_both_front_doors_together():
    """One request waits on gRPC and one on HTTP: with --max-streams-per-client 2 a third is
    refused on either door, and every slot comes back."""
    gate = asyncio.Event()
    s = server(FakeBackend(gate=gate), max_streams_per_client=2, metrics_port=0)
    url = base(s) + "/v1/completions"
    req = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(max_tokens=4))
    try:
        with grpc.insecure_channel(s.address) as ch, httpx.Client(timeout=30) as http:
            stub = pb_grpc.GenerationStub(ch)
            on_grpc = stub.Complete.future(req, timeout=30)
            on_http = threading.Thread(target=httpx.post, args=(url,), kwargs={"json": BODY})
            on_http.start()
            deadline = time.monotonic() + 10
            while s.server.core.pending < 2:
                assert time.monotonic() < deadline
                time.sleep(0.02)
            third = http.post(url, json=BODY)
            assert third.status_code == 429 and third.json()["error"]["code"] == "client_limit"
            with pytest.raises(grpc.RpcError) as err:
                stub.Complete(req, timeout=30)
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            s.run(_set(gate))
            assert len(on_grpc.result(30).token_ids) == 4
            on_http.join(30)
        assert not s.server.clients._running
        sample = s.server.metrics.registry.get_sample_value
        for door in ("grpc", "http"):
            labels = {"reason": "client_limit", "frontend": door}
            assert sample("pdserve_admission_rejections_total", labels) == 1
    finally:
        s.run(_set(gate))
        s.close()


@pytest.mark.timeout(120)
def test_values_the_engine_cannot_take_are_a_400_not_a_failed_worker():
    s = server()
    try:
        with httpx.Client(timeout=30) as http:
            cases = [
                ({**BODY, "seed": 2**64}, "seed"),
                ({**BODY, "prompt": "caf\ud800"}, "prompt"),
                ({**BODY, "stop": ["\udfff"]}, "stop[0]"),
                ({"model": MODEL, "messages": [{"role": "user", "content": "\ud800"}]},
                 "messages[0].content"),
                ({"model": MODEL, "messages": [{"role": "wizard", "content": "hi"}]},
                 "messages[0].role"),
                ({"model": MODEL, "messages": [{"role": "user", "content": "hi", "name": 5}]},
                 "messages[0].name"),
                ({"model": MODEL,
                  "messages": [{"role": "user", "content": "hi", "name": "\udfff"}]},
                 "messages[0].name"),
                ({"model": MODEL, "messages": []}, "messages"),
            ]  # fmt: skip
            for body, param in cases:
                route = "/v1/chat/completions" if "messages" in body else "/v1/completions"
                raw = json.dumps(body)  # a lone surrogate is written "\\ud800", as JSON allows
                resp = http.post(
                    base(s) + route, content=raw, headers={"content-type": "application/json"}
                )
                assert resp.status_code == 400, (body, resp.text)
                assert resp.json()["error"]["param"] == param, resp.text
            ok = http.post(base(s) + "/v1/completions", json={**BODY, "seed": 2**64 - 1})
            assert ok.status_code == 200
            # A participant's name is taken (OpenAI's field; this template leaves it out).
            named = {"model": MODEL, "max_tokens": 2,
                     "messages": [{"role": "user", "content": "hi", "name": "ana"}]}  # fmt: skip
            ok = http.post(base(s) + "/v1/chat/completions", json=named)
            assert ok.status_code == 200, ok.text
            # seed -1 is no seed (vLLM's reading, which clients send for "random").
            for n in (1, 3):
                ok = http.post(base(s) + "/v1/completions", json={**BODY, "seed": -1, "n": n})
                assert ok.status_code == 200 and len(ok.json()["choices"]) == n, ok.text
            # Both of chat's maxima (some clients send both): max_completion_tokens wins.
            both = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}],
                    "max_tokens": 7, "max_completion_tokens": 3}  # fmt: skip
            ok = http.post(base(s) + "/v1/chat/completions", json=both)
            assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_nulls_and_openai_fields_at_their_no_op_values_are_served_and_other_values_refused():
    """As OpenAI reads a body: null is not given; fields pdserve does not implement are served at
    the value that asks for nothing and refused, naming them, at any other; a value of the
    wrong type is refused, not coerced ("5" is not an integer, 1 not a boolean)."""
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    served = [
        ("completions", {**BODY, "n": None, "seed": None, "stream": None, "stop": None,
                         "echo": False, "best_of": 1, "logit_bias": {}, "user": "u-1",
                         "store": False, "suffix": None, "metadata": None,
                         "presence_penalty": None, "logprobs": None}),
        ("chat/completions", {**chat, "tools": None, "tool_choice": "none", "store": False,
                              "response_format": {"type": "text"}, "logit_bias": None,
                              "messages": [{"role": "developer", "content": "Be brief."},
                                           {"role": "user", "content": "hi"}]}),
        ("chat/completions", {**chat, "tools": [], "parallel_tool_calls": False}),
        ("completions", {**BODY, "presence_penalty": -2, "frequency_penalty": 2,
                         "repetition_penalty": 1.2, "logit_bias": {"5": -100, "7": 3.5}}),
    ]  # fmt: skip
    refused = [
        ("completions", {**BODY, "echo": True, "logprobs": 1, "pdserve": {"path": "disaggregated"}},
         "echo", "colocated path"),
        ("completions", {**BODY, "best_of": 2}, "best_of", "only 1"),
        ("completions", {**BODY, "n": 2, "best_of": 1}, "best_of", "at least n (2)"),
        ("completions", {**BODY, "logit_bias": {"x": 10}}, "logit_bias", "token ids"),
        ("completions", {**BODY, "logit_bias": {"9" * 5000: 1}}, "logit_bias", "5000 characters"),
        ("completions", {**BODY, "stop": [f"s{i}" for i in range(65)]}, "stop", "at most 64"),
        ("completions", {**BODY, "logit_bias": {"5": 101}}, "logit_bias", "[-100, 100]"),
        ("chat/completions", {**chat, "logit_bias": {"99999999": 1}}, "logit_bias", "outside"),
        ("completions", {**BODY, "suffix": "end"}, "suffix", 'only ""'),
        ("completions", {**BODY, "max_tokens": "5"}, "max_tokens", "integer"),
        ("completions", {**BODY, "max_tokens": True}, "max_tokens", "integer"),
        ("completions", {**BODY, "stream": "yes"}, "stream", "boolean"),
        ("completions", {**BODY, "stream": 1}, "stream", "boolean"),
        ("completions", {**BODY, "logprobs": True}, "logprobs", "integer"),
        ("completions", {**BODY, "prompt": [True]}, "prompt", "token ids"),
        ("completions", {**BODY, "prompt": [1.5]}, "prompt", "token ids"),
        ("chat/completions", {**chat, "store": True}, "store", "only false"),
        ("chat/completions", {**chat, "tools": [{"type": "function"}]}, "tools", "only []"),
        ("chat/completions", {**chat, "response_format": {"type": "json_object"}},
         "response_format", "only"),
        ("chat/completions", {**chat, "logprobs": True, "top_logprobs": 21}, "top_logprobs",
         "[0, 20]"),
        ("chat/completions", {**chat, "prompt": "x"}, "prompt", "is not supported"),
        ("completions", {"model": MODEL}, "prompt", "is required"),
        ("completions", {**BODY, "frequency_penalty": 2.5}, "frequency_penalty", "2"),
        ("chat/completions", {**chat, "presence_penalty": -3}, "presence_penalty", "-2"),
        ("completions", {**BODY, "repetition_penalty": 0}, "repetition_penalty", "0"),
        ("completions", {"model": MODEL, "prompt": None}, "prompt", "is required"),
    ]  # fmt: skip
    s = server()
    try:
        with httpx.Client(timeout=30) as http:
            for route, body in served:
                resp = http.post(f"{base(s)}/v1/{route}", json=body)
                assert resp.status_code == 200, (body, resp.text)
            for route, body, param, says in refused:
                resp = http.post(f"{base(s)}/v1/{route}", json=body)
                assert resp.status_code == 400, (body, resp.text)
                err = resp.json()["error"]
                assert err["param"] == param and says in err["message"], (body, err)
            url = f"{base(s)}/v1/completions"
            nan = b'{"model": "%s", "prompt": [1], "temperature": NaN}' % MODEL.encode()
            err = http.post(url, content=nan, headers={"content-type": "application/json"})
            assert err.json()["error"]["param"] == "temperature", err.text
            assert "finite" in err.json()["error"]["message"]
            plain = http.post(url, content=json.dumps(BODY).encode())  # no content type
            assert plain.status_code == 400 and "application/json" in plain.text, plain.text
            latin = http.post(url, content=b'{"prompt": "caf\xe9"}',
                              headers={"content-type": "application/json"})  # fmt: skip
            assert latin.status_code == 400 and latin.json()["error"]["param"] == "body"
            assert "UTF-8" in latin.json()["error"]["message"], latin.text
            assert http.post(url, json=BODY).status_code == 200  # and it goes on serving
    finally:
        s.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("door", ["port", "metrics_port"])
def test_a_port_that_is_taken_stops_the_start_naming_its_flag(door):
    import socket

    from router.server import Server

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    config = ServeConfig(
        **{"port": 0, "metrics_port": None, "http_port": None, door: taken.getsockname()[1]}
    )

    async def start() -> None:
        s = Server(config, backend=FakeBackend(), tokenizer=TOKENIZER)
        try:
            await s.start()
        finally:
            await s.stop()

    try:
        with pytest.raises(OSError, match=f"--{door.replace('_', '-')}"):
            asyncio.run(start())
    finally:
        taken.close()


@pytest.mark.timeout(120)
def test_what_openai_clients_send_and_read_beside_the_plain_request():
    """`model` may be left out (the served one); an image part is refused naming the part; a
    chat's stream opens with a role chunk that has every key; tokens whose text is held back
    (a stop string may begin there) make no empty event."""
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    s = server()
    try:
        with httpx.Client(timeout=30) as http:
            no_model = {k: v for k, v in BODY.items() if k != "model"}
            resp = http.post(base(s) + "/v1/completions", json=no_model)
            assert resp.status_code == 200 and resp.json()["model"] == MODEL, resp.text
            image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
            body = {**chat, "messages": [{"role": "user", "content": [image]}]}
            resp = http.post(base(s) + "/v1/chat/completions", json=body)
            err = resp.json()["error"]
            assert resp.status_code == 400 and err["param"] == "messages[0].content", err
            assert 'part 0: only text parts are supported, got type "image_url"' in err["message"]
            for message, param, said in [
                ({"role": "user", "content": ["hi"]}, "content", "part 0: must be an object"),
                ({"role": "user", "content": [{"type": "text"}]}, "content", 'needs "text"'),
                ({"role": "tool", "content": "4", "tool_call_id": "1"}, "role", "must be one"),
            ]:
                body = {**chat, "messages": [message]}
                resp = http.post(base(s) + "/v1/chat/completions", json=body)
                err = resp.json()["error"]
                assert resp.status_code == 400 and err["param"] == f"messages[0].{param}", err
                assert said in err["message"], err
            with http.stream(
                "POST", base(s) + "/v1/chat/completions", json={**chat, "stream": True}
            ) as r:
                events = [json.loads(ln[6:]) for ln in r.iter_lines() if ln.startswith("data: {")]
            assert events[0]["choices"][0] == {
                "index": 0,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
            # The text of each token alone, then a stop string that the second token's text
            # begins: its event waits for the third token's, which shows the match broke.
            whole = {**BODY, "max_tokens": 6, "stream": True}
            pieces = completion_events(http, s, whole)
            assert len(pieces) == 6 and all(pieces), pieces
            held = completion_events(http, s, {**whole, "stop": [pieces[1] + "\x00"]})
            assert "".join(held) == "".join(pieces)
            assert len(held) == 5 and all(held[:-1]), held  # one event fewer, none empty
    finally:
        s.close()


def completion_events(http, s, body) -> list[str]:
    """The text of each event of a streamed completion, the last (final) one included."""
    with http.stream("POST", base(s) + "/v1/completions", json=body) as r:
        lines = [ln for ln in r.iter_lines() if ln.startswith("data: {")]
    return [json.loads(ln[6:])["choices"][0]["text"] for ln in lines]


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes `sock` within `seconds` (reading whatever it sends first)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(4096):
            pass
    except TimeoutError:
        return False
    except ConnectionResetError:
        pass
    return True


@pytest.mark.timeout(60)
def test_connections_that_send_little_are_closed_and_their_number_is_bounded(monkeypatch, caplog):
    """Idle, slowloris and stalled-body connections would hold the file descriptors the gRPC
    and metrics ports share until every door stopped answering."""
    monkeypatch.setattr(http_conn, "HEAD_TIMEOUT_S", 0.6)
    monkeypatch.setattr(http_conn, "BODY_IDLE_S", 0.6)
    s = server()
    where = ("127.0.0.1", s.server.http_port)
    try:
        idle = socket.create_connection(where)
        assert _closed_within(idle, 5)  # sent nothing
        slow = socket.create_connection(where)
        slow.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n")
        started = time.monotonic()
        while time.monotonic() - started < 0.9:  # a header line every 0.1 s, never the end
            time.sleep(0.1)
            with contextlib.suppress(OSError):
                slow.sendall(b"x-a: b\r\n")
        assert _closed_within(slow, 5)
        stalled = socket.create_connection(where)
        stalled.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-length: 100\r\n"
                        b"content-type: application/json\r\n\r\n{\"model\"")  # fmt: skip
        assert _closed_within(stalled, 5)
        # A kept-alive connection is answered, then awaited as long as a new one.
        kept = socket.create_connection(where)
        kept.sendall(b"GET /health HTTP/1.1\r\nhost: x\r\n\r\n")
        kept.settimeout(5)
        assert kept.recv(4096).startswith(b"HTTP/1.1 200")
        assert _closed_within(kept, 5)
        # A flood of them is one line in the log, not one each.
        monkeypatch.setattr(http_conn, "_SLOW", Said(http_conn.log))
        with caplog.at_level(logging.INFO, "pdserve.http"):
            flood = [socket.create_connection(where) for _ in range(5)]
            assert all(_closed_within(f, 5) for f in flood)
        said = [r.getMessage() for r in caplog.records if "sent no whole request head" in r.message]
        assert len(said) == 1 and said[0].endswith("(1 such since the last line)"), said
        # The number open at once: one past it is closed as it opens; the others are served.
        monkeypatch.setattr(http_conn, "HEAD_TIMEOUT_S", 30.0)
        monkeypatch.setattr(client_limit, "CONNECTIONS_CAP", 2)
        held = [socket.create_connection(where) for _ in range(2)]
        time.sleep(0.2)
        past = socket.create_connection(where)
        assert _closed_within(past, 5)
        for h in held:
            h.close()
        deadline = time.monotonic() + 10
        while True:  # served once the server has seen them closed, a moment after
            try:
                with httpx.Client(timeout=10) as http:
                    assert http.get(base(s) + "/health").status_code == 200
                break
            except httpx.TransportError:  # closed as it opened: not seen yet
                assert time.monotonic() < deadline, "a connection under the cap was refused"
                time.sleep(0.1)
    finally:
        s.close()


H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes(3) + b"\x04" + bytes(5)  # + SETTINGS


@pytest.mark.timeout(60)
def test_grpc_connections_that_never_handshake_are_closed_and_their_number_is_bounded(
    monkeypatch,
):
    import router.grpc_ports

    monkeypatch.setattr(router.grpc_ports, "GRPC_HANDSHAKE_TIMEOUT_S", 1.0)
    monkeypatch.setattr(client_limit, "CONNECTIONS_CAP", 2)
    s = server(admin_port=0)
    try:
        for port in (s.server.port, s.server.admin_port):
            silent = socket.create_connection(("127.0.0.1", port))
            assert _closed_within(silent, 5), port
            silent.close()
            time.sleep(1.0)  # its count is given back a little after it is closed
            # Two that speak HTTP/2 are held; one past them is closed as it opens.
            held = [socket.create_connection(("127.0.0.1", port)) for _ in range(2)]
            for h in held:
                h.sendall(H2_PREFACE)
            time.sleep(1.2)  # past the handshake's deadline: these are not closed for it
            past = socket.create_connection(("127.0.0.1", port))
            past.sendall(H2_PREFACE)
            assert _closed_within(past, 5), port
            assert not any(_closed_within(h, 0.2) for h in held), port
            for h in held:
                h.close()
        time.sleep(0.3)
        with grpc.insecure_channel(f"127.0.0.1:{s.server.port}") as ch:  # a client that speaks
            res = pb_grpc.GenerationStub(ch).Complete(
                pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=2)),
                timeout=30,
            )
        assert len(res.token_ids) == 2
    finally:
        s.close()


def test_where_the_system_allows_less_than_asked_the_file_limit_is_raised_by_halves(
    monkeypatch,
):
    import resource

    tried = []

    def setrlimit(which, limits):
        tried.append(limits[0])
        if limits[0] > 10240:  # as macOS's cap under an unlimited hard limit
            raise ValueError("not allowed")

    monkeypatch.setattr(resource, "getrlimit", lambda which: (256, resource.RLIM_INFINITY))
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    client_limit.raise_file_limit()
    assert tried == [65536, 32768, 16384, 8192]
    assert client_limit.max_connections() == 64  # a quarter of 256 (getrlimit is the fake's)


def test_the_file_limit_is_raised_at_start_toward_the_hard_limit():
    """A soft limit of 1,024 would hold each door to 256 connections."""
    import resource
    import subprocess
    import sys

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and hard <= 1024:
        pytest.skip(f"the hard file limit here is {hard}: nothing to raise to")
    code = (  # a process that starts at 1,024 (lowered in it: no preexec_fn beside threads)
        "import resource; from router.client_limit import raise_file_limit, max_connections;"
        f"resource.setrlimit(resource.RLIMIT_NOFILE, (1024, {hard}));"
        "raise_file_limit(); print(resource.getrlimit(resource.RLIMIT_NOFILE)[0], "
        "max_connections())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout.split()
    want = min(65536, hard) if hard != resource.RLIM_INFINITY else 65536
    assert int(out[0]) == want
    assert int(out[1]) == min(4096, want // 4)


def _all_running_then_none(sample, n: int, within_s: float = 30) -> None:
    deadline = time.monotonic() + within_s
    while (sample("pdserve_requests_active") or 0) < n:
        assert time.monotonic() < deadline, sample("pdserve_requests_active")
        time.sleep(0.05)
    while sample("pdserve_requests_active"):
        assert time.monotonic() < deadline, sample("pdserve_requests_active")
        time.sleep(0.1)


@pytest.mark.timeout(60)
def test_a_client_that_reads_nothing_of_its_answer_is_cut_and_its_requests_end(monkeypatch):
    """Its 16 choices would stay active, their slots held and the rest of their answer kept in
    the router, for as long as it kept the connection open."""
    monkeypatch.setattr(client_limit, "SEND_STALL_S", 1.0)
    made = http_conn.BoundedH11Protocol.connection_made

    def small_buffers(self, transport):  # the kernel's share small: the answer waits in pdserve
        transport.get_extra_info("socket").setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        made(self, transport)

    monkeypatch.setattr(http_conn.BoundedH11Protocol, "connection_made", small_buffers)
    s = server()
    sample = s.server.metrics.registry.get_sample_value
    try:
        body = json.dumps({**BODY, "max_tokens": 1000, "n": 16, "stream": True}).encode()
        head = (f"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                f"content-length: {len(body)}\r\n\r\n").encode()  # fmt: skip
        stalled = socket.socket()
        stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # a window that fills
        stalled.connect(("127.0.0.1", s.server.http_port))
        stalled.sendall(head + body)
        _all_running_then_none(sample, 16)
        ended = {"path": "colocated", "finish_reason": "abort", "frontend": "http"}
        assert sample("pdserve_requests_total", ended) == 16
        assert _closed_within(stalled, 10)  # what it had buffered, then the cut
        with httpx.Client(timeout=10) as http:  # the others are served as before
            assert http.post(base(s) + "/v1/completions", json=BODY).status_code == 200
    finally:
        s.close()


@pytest.mark.timeout(60)
def test_a_grpc_client_that_reads_nothing_of_its_stream_is_cut_and_its_requests_end(monkeypatch):
    """As over HTTP: its streams would stay active, their slots held, while it kept the
    connection open without reading."""
    monkeypatch.setattr(client_limit, "SEND_STALL_S", 1.0)
    s = server(max_streams_per_client=4)  # the cut streams' slots are given back
    sample = s.server.metrics.registry.get_sample_value
    # Many tokens with 20 logprobs each: more than HTTP/2's window holds.
    req = pb.GenerateRequest(
        prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(max_tokens=4000, logprobs=20)
    )
    try:
        with grpc.insecure_channel(
            f"127.0.0.1:{s.server.port}", options=[("grpc.http2.bdp_probe", 0)]
        ) as ch:
            stub = pb_grpc.GenerationStub(ch)
            calls = [stub.Generate(req, timeout=50) for _ in range(4)]  # none of them read
            _all_running_then_none(sample, 4)
            ended = {"path": "colocated", "finish_reason": "abort", "frontend": "grpc"}
            assert sample("pdserve_requests_total", ended) == 4
            read = 0
            with pytest.raises(grpc.RpcError) as cut:  # what it had buffered, then the cut
                for _ in calls[0]:
                    read += 1
            assert cut.value.code() is grpc.StatusCode.DEADLINE_EXCEEDED
            assert "answer cut: the client read none of it" in cut.value.details()
            assert 0 < read < 4000
            small = pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(max_tokens=3))
            assert sum(len(m.token_ids) for m in stub.Generate(small, timeout=10)) == 3
    finally:
        s.close()


def test_a_chat_messages_text_parts_are_joined_by_newlines():
    """As vLLM joins them: words of two parts do not run together."""
    from router.http_schema import ChatCompletionRequest, request_fields
    from router.request import ChatTurn

    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": parts}]})
    assert request_fields(body)[0][0].messages == [ChatTurn("user", "hi\nthere")]


@pytest.mark.parametrize(
    "head, status, said",
    [
        (b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 200_000, 431, "head is too large"),
        (b"GET /health HTTP/1.1\r\nhost: x\r\nno colon\r\n\r\n", 400, "illegal header line"),
        (b"NOT HTTP\r\n\r\n", 400, "the HTTP parser refused it"),
    ],
)
def test_a_request_that_is_not_http_gets_a_json_error(head, status, said):
    s = server()
    try:
        with socket.create_connection(("127.0.0.1", s.server.http_port)) as k:
            with contextlib.suppress(OSError):  # the server may close before all is sent
                k.sendall(head)
            k.settimeout(5)
            got = b""
            with contextlib.suppress(OSError):
                while data := k.recv(65536):
                    got += data
        answer, _, body = got.partition(b"\r\n\r\n")
        assert answer.startswith(b"HTTP/1.1 %d " % status), got[:300]
        assert b"content-type: application/json" in answer.lower()
        assert said in json.loads(body)["error"]["message"]
        with httpx.Client(timeout=10) as http:  # and the port serves on
            assert http.get(base(s) + "/health").status_code == 200
    finally:
        s.close()


def test_a_chat_can_go_on_from_the_assistants_message():
    """vLLM's continue_final_message and add_generation_prompt, through the HTTP door."""
    chat = [{"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "The capital is"}]  # fmt: skip
    ids = {
        opt: TOKENIZER.apply_chat_template(chat, tokenize=True, return_dict=False, **kw)
        for opt, kw in [
            ("open", {"add_generation_prompt": True}),
            ("go_on", {"continue_final_message": True}),
        ]
    }
    assert len(ids["open"]) != len(ids["go_on"])
    s = server()
    try:
        with httpx.Client(timeout=30) as http:
            url = base(s) + "/v1/chat/completions"
            for extra, want in [({}, "open"), ({"continue_final_message": True}, "go_on")]:
                resp = http.post(url, json={"messages": chat, "max_tokens": 2, **extra})
                assert resp.status_code == 200, resp.text
                assert resp.json()["usage"]["prompt_tokens"] == len(ids[want]), extra
            body = {"messages": chat, "continue_final_message": True, "add_generation_prompt": True}
            err = http.post(url, json=body).json()["error"]
            assert err["param"] == "continue_final_message", err
    finally:
        s.close()


@pytest.mark.timeout(60)
def test_the_served_model_name_is_the_one_both_apis_give_and_requests_must_name():
    """--served-model-name: /v1/models lists it, answers carry it, a request naming it (or no
    model) is served and one naming --model itself is a 404 naming the field; gRPC Info says it."""
    s = server(served_model_name="my-model")
    try:
        with httpx.Client(timeout=30) as http:
            listed = http.get(base(s) + "/v1/models").json()
            assert [m["id"] for m in listed["data"]] == ["my-model"]
            ok = http.post(base(s) + "/v1/completions", json={**BODY, "model": "my-model"})
            assert ok.status_code == 200 and ok.json()["model"] == "my-model", ok.text
            refused = http.post(base(s) + "/v1/completions", json=BODY)  # --model's own name
            assert refused.status_code == 404, refused.text
            error = refused.json()["error"]
            assert error["param"] == "model" and "serves 'my-model'" in error["message"]
        with grpc.insecure_channel(s.address) as ch:
            info = pb_grpc.GenerationStub(ch).Info(pb.InfoRequest(), timeout=10)
            assert info.model == "my-model"
    finally:
        s.close()

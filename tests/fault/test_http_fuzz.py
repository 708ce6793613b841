"""The HTTP API fuzzed from its own OpenAPI document (schemathesis draws requests from
/openapi.json: bodies that fit the schema and bodies that break it) against one real server
(tiny-llama, 1 prefill + 1 decode Ray worker on 127.0.0.1, a bearer token, --max-tokens-limit),
plus raw bytes that are not JSON and tokens that are wrong.

Every answer is 200, 400 (naming a parameter), 401, 404, 422 never, 429, and never a 5xx; a 200
is a well-formed completion. After the run the health route answers ok and every worker's KV pool
is full again. The status counts print per test (`-rP`).

PDSERVE_FUZZ_EXAMPLES sets the examples per operation (default 100; the full run is 10000):
  PDSERVE_FUZZ_EXAMPLES=10000 .venv/bin/python -m pytest -q -rP tests/fault/test_http_fuzz.py
"""

from __future__ import annotations

import json
import os
from collections import Counter

import httpx2 as httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from router.security import SecurityConfig
from tests.grpc_server import ServerThread, tiny_config
from tests.test_router_grpc import assert_pools_full

EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "100"))
MAX_NEW = 4
MODEL = "tiny-llama"
TOKEN = "fuzz-token"
AUTH = {"authorization": f"Bearer {TOKEN}"}
ALLOWED = {200, 400, 401, 404, 429}
STATUSES: Counter[tuple[str, int]] = Counter()
PARAMS: Counter[tuple[str, str]] = Counter()  # (test, the parameter a 400 named)
OPERATIONS = [
    ("POST", "/v1/completions"),
    ("POST", "/v1/chat/completions"),
    ("GET", "/v1/models"),
    ("GET", "/health"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
]


def fuzz_settings() -> settings:
    return settings(
        max_examples=max(1, EXAMPLES),
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
    )


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    token_file = tmp_path_factory.mktemp("http-fuzz") / "token"
    token_file.write_text(TOKEN + "\n")
    config = tiny_config(
        batched_tokens=256,
        http_port=0,
        metrics_port=None,
        security=SecurityConfig(auth_token_file=token_file),
        max_tokens_limit=MAX_NEW,
    )
    s = ServerThread(config)
    yield s
    s.close()


@pytest.fixture(scope="module")
def base(srv) -> str:
    return f"http://127.0.0.1:{srv.server.http_port}"


@pytest.fixture(scope="module")
def http():
    with httpx.Client(timeout=120) as client:
        yield client


def answer_ok(test: str, resp: httpx.Response, what: str) -> None:
    STATUSES[(test, resp.status_code)] += 1
    if resp.status_code == 400:
        PARAMS[(test, str(resp.json()["error"]["param"]))] += 1
    assert resp.status_code in ALLOWED, f"{resp.status_code} {resp.text[:500]} for {what}"
    if resp.status_code != 200:
        err = resp.json()["error"]
        assert err["message"] and err["type"], resp.text
        if resp.status_code == 400 and err["param"] is not None:
            assert err["param"].split(".")[0].split("[")[0] in resp.text
        return
    ctype = resp.headers.get("content-type", "")
    if ctype.startswith("text/event-stream"):
        events = [ln[6:] for ln in resp.text.splitlines() if ln.startswith("data: ")]
        assert events[-1] == "[DONE]", resp.text[-500:]
        chunks = [json.loads(e) for e in events[:-1]]
        assert all("error" not in c for c in chunks), chunks
        finishes = [ch["finish_reason"] for c in chunks for ch in c["choices"]]
        assert finishes and finishes[-1] in ("stop", "length"), chunks
    else:
        body = resp.json()
        if body.get("object") in ("text_completion", "chat.completion"):
            # MAX_NEW (--max-tokens-limit) each: a batch of prompts, or n, has several choices
            choices = body["choices"]
            assert 1 <= body["usage"]["completion_tokens"] <= MAX_NEW * len(choices), body
            assert all(c["finish_reason"] in ("stop", "length") for c in choices), body
        elif "count" in body:  # /tokenize
            assert body["count"] == len(body["tokens"]), body
        elif "prompt" in body:  # /detokenize
            assert isinstance(body["prompt"], str) and len(body) == 1, body
        else:  # the model list or the health answer
            assert body.get("object") == "list" or body == {"status": "ok"}, body


@pytest.fixture(scope="module")
def schema(base, srv):
    return schemathesis.openapi.from_url(base + "/openapi.json", headers=AUTH, timeout=30)


@pytest.mark.timeout(3600)
@pytest.mark.parametrize("method,path", OPERATIONS)
def test_schema_driven_requests_never_get_a_5xx(srv, base, http, schema, ledger, method, path):
    operation = schema[path][method]
    test = f"{method} {path}"

    @fuzz_settings()
    @given(case=operation.as_strategy(), served=st.sampled_from([True] * 9 + [False]))
    def run(case, served: bool) -> None:
        body = case.body if method == "POST" else None
        if isinstance(body, dict) and served:  # mostly the served model: reach the core
            body = {**body, "model": MODEL}
        resp = http.request(
            method,
            base + case.formatted_path,
            headers=AUTH,  # the generated Authorization values are the raw test's business
            params=case.query,
            json=body,
        )
        answer_ok(test, resp, f"body {json.dumps(body)[:500]}")
        ok = resp.status_code == 200
        ledger.add(sent=1, completed=int(ok), failed=int(not ok))

    run()
    print(test, {code: n for (t, code), n in STATUSES.items() if t == test})
    print("  400 by parameter:", {p: n for (t, p), n in PARAMS.items() if t == test})
    assert http.get(base + "/health").json() == {"status": "ok"}
    assert_pools_full(srv, within_s=10.0)


@pytest.mark.timeout(1200)
def test_raw_bodies_and_wrong_tokens_never_get_a_5xx(srv, base, http, ledger):
    test = "raw"

    @fuzz_settings()
    @given(
        raw=st.binary(max_size=512) | st.text(max_size=256).map(str.encode),
        auth=st.sampled_from([AUTH, {}, {"authorization": TOKEN}, {"authorization": "Bearer x"}]),
        route=st.sampled_from(["/v1/completions", "/v1/chat/completions"]),
    )
    def run(raw: bytes, auth: dict[str, str], route: str) -> None:
        headers = {**auth, "content-type": "application/json"}
        resp = http.post(base + route, content=raw, headers=headers)
        answer_ok(test, resp, f"raw {raw[:200]!r}")
        assert resp.status_code in (400, 401) or resp.status_code == 200, resp.text
        ledger.add(
            sent=1, completed=int(resp.status_code == 200), failed=int(resp.status_code != 200)
        )

    run()
    print(test, {code: n for (t, code), n in STATUSES.items() if t == test})
    assert_pools_full(srv, within_s=10.0)

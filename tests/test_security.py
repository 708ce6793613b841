"""A server on a network: TLS and mutual TLS, a bearer token on every RPC but health, per-client
stream limits and a max_tokens cap, through `pdserve complete` as a user runs it and through the
gRPC client. The pools are the fake backend: what is tested is the transport and the door."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import grpc
import pytest
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from engine.config import ModelConfig
from engine.loader import load_tokenizer
from pdserve_proto import admin_pb2, admin_pb2_grpc
from pdserve_proto import generation_pb2 as pb
from pdserve_proto import generation_pb2_grpc as pb_grpc
from router.fake_backend import FakeBackend
from router.security import SecurityConfig
from router.serve_config import ServeConfig
from tests.grpc_server import ServerThread

TOKENIZER = load_tokenizer(ModelConfig(model="tiny-llama"))
REQ = pb.GenerateRequest(prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(max_tokens=4))


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    """A CA, a server certificate for 127.0.0.1 and a client certificate, as PEM files."""
    d = tmp_path_factory.mktemp("pki")
    ca = trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("pdserve-client@example.com")
    paths = {}
    for name, blob in (
        ("ca.pem", ca.cert_pem),
        ("server.pem", server.cert_chain_pems[0]),
        ("server.key", server.private_key_pem),
        ("client.pem", client.cert_chain_pems[0]),
        ("client.key", client.private_key_pem),
    ):
        blob.write_to_path(str(d / name))
        paths[name] = d / name
    (d / "token").write_text("s3cret-token\n")
    (d / "wrong").write_text("not-the-token\n")
    paths["token"], paths["wrong"] = d / "token", d / "wrong"
    return paths


def server(security: SecurityConfig, backend: FakeBackend | None = None, **kw) -> ServerThread:
    config = ServeConfig(port=0, metrics_port=None, admin_port=0, security=security, **kw)
    return ServerThread(config, backend=backend or FakeBackend(), tokenizer=TOKENIZER)


def complete(address: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """`pdserve complete` as a user types it."""
    return subprocess.run(
        [sys.executable, "-m", "router.cli", "complete", "--address", address, "--timeout", "30",
         "--max-tokens", "4", *flags, "hello"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip


@pytest.mark.timeout(120)
def test_tls_end_to_end_and_a_plaintext_client_fails_cleanly(pki):
    s = server(SecurityConfig(tls_cert=pki["server.pem"], tls_key=pki["server.key"]))
    try:
        ok = complete(s.address, "--tls-ca", str(pki["ca.pem"]), "--json")
        assert ok.returncode == 0, ok.stderr
        assert '"completion_tokens": 4' in ok.stdout
        plain = complete(s.address)
        assert plain.returncode == 1 and plain.stderr.startswith("error: ")
        assert "Traceback" not in plain.stderr
        assert "or one that speaks TLS (--tls-ca)?" in plain.stderr
        other = trustme.CA()  # the server's certificate, checked against another CA
        other.cert_pem.write_to_path(str(pki["ca.pem"].parent / "other-ca.pem"))
        wrong = complete(s.address, "--tls-ca", str(pki["ca.pem"].parent / "other-ca.pem"))
        assert wrong.returncode == 1 and wrong.stderr.count("\n") == 1, wrong.stderr
        assert "certificate is not one --tls-ca's CA signed" in wrong.stderr
        # A plaintext gRPC client gets UNAVAILABLE (no handshake), and the server keeps serving.
        with grpc.insecure_channel(s.address) as ch:
            with pytest.raises(grpc.RpcError) as err:
                pb_grpc.GenerationStub(ch).Complete(REQ, timeout=5)
        assert err.value.code() is grpc.StatusCode.UNAVAILABLE
        assert complete(s.address, "--tls-ca", str(pki["ca.pem"])).returncode == 0
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_mutual_tls_needs_a_client_certificate(pki):
    s = server(
        SecurityConfig(
            tls_cert=pki["server.pem"], tls_key=pki["server.key"], tls_client_ca=pki["ca.pem"]
        )
    )
    try:
        mtls = ("--tls-ca", str(pki["ca.pem"]), "--tls-cert", str(pki["client.pem"]),
                "--tls-key", str(pki["client.key"]))  # fmt: skip
        assert complete(s.address, *mtls).returncode == 0
        without = complete(s.address, "--tls-ca", str(pki["ca.pem"]))
        assert without.returncode == 1 and "Traceback" not in without.stderr
        assert "asks for a client certificate (--tls-cert, --tls-key)?" in without.stderr
        assert without.stderr.startswith("error: ") and without.stderr.count("\n") == 1
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_a_bearer_token_is_checked_on_every_rpc_but_health(pki):
    s = server(SecurityConfig(auth_token_file=pki["token"]))
    try:
        assert complete(s.address, "--token-file", str(pki["token"])).returncode == 0
        for flags in ((), ("--token-file", str(pki["wrong"]))):
            refused = complete(s.address, *flags)
            assert refused.returncode == 1
            assert "UNAUTHENTICATED" in refused.stderr and "Traceback" not in refused.stderr
        with grpc.insecure_channel(s.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            for metadata in ((), (("authorization", "Bearer nope"),),
                             (("authorization", "s3cret-token"),)):  # fmt: skip
                for call in (stub.Complete, stub.Info):
                    with pytest.raises(grpc.RpcError) as err:
                        req = REQ if call is stub.Complete else pb.InfoRequest()
                        call(req, timeout=5, metadata=metadata)
                    assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
                with pytest.raises(grpc.RpcError) as err:
                    list(stub.Generate(REQ, timeout=5, metadata=metadata))
                assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
            good = (("authorization", "Bearer s3cret-token"),)
            assert len(stub.Complete(REQ, timeout=5, metadata=good).token_ids) == 4
            # A method the server lacks: without the token, refused as any other (which
            # services are here is not told); with it, UNIMPLEMENTED.
            for metadata, code in (((), grpc.StatusCode.UNAUTHENTICATED),
                                   (good, grpc.StatusCode.UNIMPLEMENTED)):  # fmt: skip
                for shape in (ch.unary_unary, ch.unary_stream, ch.stream_stream):
                    call = shape("/pdserve.Nothing/Here")
                    with pytest.raises(grpc.RpcError) as err:
                        reply = call(iter([b"x"]) if shape == ch.stream_stream else b"x",
                                     timeout=5, metadata=metadata)  # fmt: skip
                        list(reply) if shape != ch.unary_unary else reply
                    assert err.value.code() is code, (shape, err.value)
            lower = (("authorization", "bearer s3cret-token"),)  # the scheme in any case
            assert len(stub.Complete(REQ, timeout=5, metadata=lower).token_ids) == 4
            health = health_pb2_grpc.HealthStub(ch).Check(
                health_pb2.HealthCheckRequest(), timeout=5
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING  # no token needed
        # The admin port asks for the same token.
        admin = f"127.0.0.1:{s.server.admin_port}"
        with grpc.insecure_channel(admin) as ch:
            with pytest.raises(grpc.RpcError) as err:
                admin_pb2_grpc.AdminStub(ch).ListWorkers(admin_pb2.ListWorkersRequest(), timeout=5)
            assert err.value.code() is grpc.StatusCode.UNAUTHENTICATED
        listed = subprocess.run(
            [sys.executable, "-m", "router.cli", "workers", "--address", admin, "--token-file",
             str(pki["token"])],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert listed.returncode == 0, listed.stderr
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_per_client_stream_limit_and_max_tokens_cap():
    gate = asyncio.Event()
    backend = FakeBackend(gate=gate)
    s = server(SecurityConfig(), backend=backend, max_streams_per_client=2, max_tokens_limit=8)
    try:
        with grpc.insecure_channel(s.address) as ch:
            stub = pb_grpc.GenerationStub(ch)
            held = [stub.Generate(REQ, timeout=30) for _ in range(2)]
            deadline = time.monotonic() + 10
            while len(backend.started) < 2:  # both are running (waiting at the gate)
                assert time.monotonic() < deadline
                time.sleep(0.01)
            with pytest.raises(grpc.RpcError) as err:
                stub.Complete(REQ, timeout=5)
            assert err.value.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
            assert dict(err.value.trailing_metadata())["pdserve-reject-reason"] == "client_limit"
            s.loop.call_soon_threadsafe(gate.set)
            for call in held:
                assert sum(len(m.token_ids) for m in call) == 4
            # Slots free again once they ended.
            assert len(stub.Complete(REQ, timeout=5).token_ids) == 4
            # The cap: above it refused naming the field; unset, the default is the cap.
            big = pb.GenerateRequest(prompt_token_ids=[1], sampling=pb.SamplingParams(max_tokens=9))
            with pytest.raises(grpc.RpcError) as err:
                stub.Complete(big, timeout=5)
            assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert err.value.details().startswith("max_tokens: must be in [1, 8]")
            assert "--max-tokens-limit" in err.value.details()
            unset = pb.GenerateRequest(prompt_token_ids=[1])
            assert len(stub.Complete(unset, timeout=5).token_ids) == 8
    finally:
        s.close()


def test_bad_security_options_stop_the_server_before_it_starts(pki, tmp_path, capsys):
    from router.cli import main

    empty = tmp_path / "empty"
    empty.write_text("\n")
    tokens = []
    for i, bad in enumerate((b"two words", b"a\x01b", b"\xff\xfe")):  # no header carries them
        tokens.append(tmp_path / f"token{i}")
        tokens[-1].write_bytes(bad + b"\n")
    tls = ["--tls-cert", str(pki["server.pem"]), "--tls-key", str(pki["server.key"])]
    from cryptography.hazmat.primitives import serialization

    key = serialization.load_pem_private_key(pki["server.key"].read_bytes(), password=None)
    encrypted = tmp_path / "encrypted.key"  # behind a passphrase, which gRPC cannot take
    encrypted.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.BestAvailableEncryption(b"passphrase"),
        )
    )
    pair = "tls_cert and tls_key (--tls-cert, --tls-key): "
    for argv, field in (
        (["--tls-cert", str(pki["server.pem"])], f"{pair}give"),
        (["--tls-client-ca", str(pki["ca.pem"])], "tls_client_ca (--tls-client-ca): mutual"),
        (["--tls-cert", str(tmp_path / "nope"), "--tls-key", str(pki["server.key"])], "tls_cert"),
        (["--auth-token-file", str(empty)], "auth_token_file (--auth-token-file): "),
        # Files that read well but that TLS cannot use: a key that is not the certificate's,
        # a certificate that is not PEM, a client CA that holds no certificate.
        (["--tls-cert", str(pki["server.pem"]), "--tls-key", str(pki["client.key"])],
         pair),
        (["--tls-cert", str(pki["token"]), "--tls-key", str(pki["server.key"])],
         pair),
        ([*tls, "--tls-client-ca", str(pki["token"])], "tls_client_ca (--tls-client-ca): "),
        *((["--auth-token-file", str(t)], "must be printable ASCII") for t in tokens),
        ([*tls[:2], "--tls-key", str(encrypted)], pair),  # refused, not prompted for
        (["--admin-host", "203.0.113.7"], "--admin-host: 203.0.113.7 is not an address of"),
        (["--host", "203.0.113.7"], "--host: 203.0.113.7 is not an address of this machine"),
    ):  # fmt: skip
        t0 = time.monotonic()
        assert main(["serve", "--metrics-port", "-1", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and field in err, err
        assert err.count("\n") == 1 and time.monotonic() - t0 < 10  # before Ray and workers


@pytest.mark.timeout(120)
def test_a_client_option_that_cannot_be_used_is_one_error_line_in_every_command(pki, tmp_path):
    """workers, scale, bench and complete read --tls-* and --token-file before connecting:
    an unreadable or unusable one is one `error:` line naming the flag, exit 2."""
    nope = str(tmp_path / "nope")
    binary = tmp_path / "binary-token"
    binary.write_bytes(b"\xff\xfe\n")
    for command in (
        ["workers", "--address", "127.0.0.1:9", "--token-file", nope],
        ["scale", "--address", "127.0.0.1:9", "--workers", "1", "--token-file", nope],
        ["workers", "--address", "127.0.0.1:9", "--tls-ca", str(pki["ca.pem"]),
         "--tls-cert", str(pki["client.pem"])],
        ["bench", "--address", "127.0.0.1:9", "--num-requests", "1", "--token-file", nope],
        ["complete", "--address", "127.0.0.1:9", "--token-file", str(binary), "hi"],
    ):  # fmt: skip
        out = subprocess.run(
            [sys.executable, "-m", "router.cli", *command],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert out.returncode == 2, (command, out.stderr)
        assert out.stderr.startswith("error: --t") and out.stderr.count("\n") == 1, out.stderr


@pytest.mark.timeout(120)
def test_the_admin_port_binds_its_own_host_this_machine_unless_told():
    """--host 0.0.0.0 puts the API on the network, not the admin service (Scale): it stays on
    --admin-host, 127.0.0.1 unless set."""
    from router.cli import build_parser
    from router.effective_options import resolve

    config = resolve(build_parser().parse_args(["serve", "--host", "0.0.0.0"])).serve_config()
    assert (config.host, config.admin_host) == ("0.0.0.0", "127.0.0.1")
    s = server(SecurityConfig(), admin_host="127.0.0.2")
    try:
        port = s.server.admin_port
        with grpc.insecure_channel(f"127.0.0.2:{port}") as ch:
            stub = admin_pb2_grpc.AdminStub(ch)
            stub.ListWorkers(admin_pb2.ListWorkersRequest(), timeout=10)
        with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:  # the API's host: nothing there
            with pytest.raises(grpc.RpcError) as err:
                admin_pb2_grpc.AdminStub(ch).ListWorkers(admin_pb2.ListWorkersRequest(), timeout=5)
            assert err.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        s.close()


@pytest.mark.timeout(120)
def test_certificates_out_of_date_or_about_to_expire_are_named_at_start(tmp_path, caplog):
    """gRPC serves an expired certificate without a word, and every TLS client then refuses
    it: the start says so, naming the option, the file, the subject and the date; one that
    expires within EXPIRY_WARNING_DAYS is named too; a fresh chain and CA say nothing."""
    import logging
    from datetime import UTC, datetime, timedelta

    from cryptography import x509

    from router.security import EXPIRY_WARNING_DAYS

    now = datetime.now(UTC)
    ca = trustme.CA()
    files = {}
    for name, kw in (("fresh", {}), ("expired", {"not_after": now - timedelta(days=3)}),
                     ("soon", {"not_after": now + timedelta(days=EXPIRY_WARNING_DAYS - 2)}),
                     ("later", {"not_before": now + timedelta(days=2)})):  # fmt: skip
        leaf = ca.issue_cert("127.0.0.1", common_name=f"{name}.example", **kw)
        files[name] = (tmp_path / f"{name}.pem", tmp_path / f"{name}.key")
        leaf.cert_chain_pems[0].write_to_path(str(files[name][0]))
        leaf.private_key_pem.write_to_path(str(files[name][1]))
    ca.cert_pem.write_to_path(str(tmp_path / "ca.pem"))

    def said(name: str) -> list[str]:
        cert, key = files[name]
        return SecurityConfig(tls_cert=cert, tls_key=key, tls_client_ca=tmp_path / "ca.pem"
                              ).date_warnings()  # fmt: skip

    assert said("fresh") == []
    day = (now - timedelta(days=3)).strftime("%Y-%m-%d")
    [expired] = said("expired")
    assert expired.startswith(f"tls_cert (--tls-cert): {files['expired'][0]}: CN=expired.example")
    assert f"expired on {day} " in expired and expired.endswith(": TLS clients refuse it")
    [soon] = said("soon")  # 12 days less the moments since: 11 whole days
    assert f"in {EXPIRY_WARNING_DAYS - 3} day(s)" in soon and "CN=soon.example" in soon, soon
    [later] = said("later")
    assert "is not valid before" in later and later.endswith("until then"), later
    # The client CA, checked as well (trustme's are valid from 2000 to 3000).
    late = SecurityConfig(tls_cert=files["fresh"][0], tls_key=files["fresh"][1],
                          tls_client_ca=tmp_path / "ca.pem"
                          ).date_warnings(datetime(3001, 1, 1, tzinfo=UTC))  # fmt: skip
    subject = x509.load_pem_x509_certificate(ca.cert_pem.bytes()).subject.rfc4514_string()
    assert late[-1] == (f"tls_client_ca (--tls-client-ca): {tmp_path / 'ca.pem'}: {subject} "
                        "expired on 3000-01-01 00:00 UTC: the server refuses the client "
                        "certificates it signed")  # fmt: skip
    # A server started on the expired one logs the same line, and starts all the same.
    caplog.set_level(logging.WARNING, logger="pdserve.server")
    cert, key = files["expired"]
    s = server(SecurityConfig(tls_cert=cert, tls_key=key))
    try:
        assert any(r.getMessage() == expired for r in caplog.records), caplog.text
    finally:
        s.close()

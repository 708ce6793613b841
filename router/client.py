"""`pdserve complete`: one request to a running server, its text streamed to the terminal as it
arrives (or, with --json, the whole answer as one JSON object)."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable
from typing import Any

from pdserve_client import add_arguments as add_auth_arguments
from pdserve_client.argtypes import address, integer_in, seconds

PATHS = ("auto", "colocated", "disaggregated")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--address",
        type=address(50051),
        default="127.0.0.1:50051",
        help="the server's host:port (host alone: port 50051)",
    )
    p.add_argument(
        "--max-tokens", type=integer_in(1, 2**31), default=None, help="default: the server's (256)"
    )
    add_sampling_arguments(p)
    p.add_argument("--chat", action="store_true", help="send the prompt as one user message")
    p.add_argument("--path", choices=PATHS, default="auto", help="override the router's choice")
    p.add_argument("--json", action="store_true", help="print the whole answer as JSON")
    p.add_argument("--timeout", type=seconds, default=600.0, help="deadline in seconds")
    p.add_argument(
        "--wait",
        action="store_true",
        help="wait (within --timeout) for the server to come up instead of failing at once",
    )
    add_auth_arguments(p)
    p.add_argument("prompt")


def add_sampling_arguments(p: argparse.ArgumentParser) -> None:
    """The sampling flags of `pdserve complete` and `pdserve generate` (all but --max-tokens);
    the server or the engine checks their ranges and names the field. Unset, each takes the
    server's or engine's default, but for --temperature: greedy here."""
    p.add_argument("--temperature", type=float, default=0.0, help="0 (the default here) is greedy")
    p.add_argument("--top-p", type=float, default=None, help="nucleus sampling, in (0, 1]")
    p.add_argument(
        "--top-k",
        type=integer_in(-1, 2**31),
        default=None,
        help="the k likeliest tokens (0 or -1: all)",
    )
    p.add_argument("--min-p", type=float, default=None, help="in [0, 1], of the likeliest's")
    p.add_argument(
        "--seed", type=integer_in(0, 2**64), default=None, help="for sampling (default: random)"
    )
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument(
        "--stop-token-id",
        type=integer_in(0, 2**31),
        action="append",
        default=[],
        help="stop token (repeatable)",
    )
    p.add_argument("--ignore-eos", action="store_true", help="go on past the end-of-text token")
    for flag, what in (
        ("--logprobs", "each token's logprob and its N likeliest alternatives (0 to 20)"),
        ("--prompt-logprobs", "the same for each prompt token after the first"),
    ):
        p.add_argument(
            flag, type=integer_in(0, 21), default=None, metavar="N", help=f"{what}; with --json"
        )
    add_penalty_arguments(p)


def add_penalty_arguments(p: argparse.ArgumentParser) -> None:
    """Penalties' and biases' flags (add_sampling_arguments)."""
    p.add_argument(
        "--logit-bias",
        type=token_bias,
        action="append",
        default=[],
        metavar="TOKEN=BIAS",
        help="add BIAS (-100 to 100) to token id TOKEN's logit (repeatable)",
    )
    p.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="> 0; above 1 holds back tokens of the prompt and output (default: 1, off)",
    )
    p.add_argument(
        "--presence-penalty",
        type=float,
        default=None,
        help="-2 to 2, once per token already in the output (default: 0)",
    )
    p.add_argument(
        "--frequency-penalty",
        type=float,
        default=None,
        help="-2 to 2, per time a token is in the output (default: 0)",
    )


PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")
# add_sampling_arguments' flags that are None unless given (the default is the other side's).
OPTIONAL_SAMPLING = ("top_p", "top_k", "min_p", "seed", "logprobs", "prompt_logprobs", *PENALTIES)


def token_bias(text: str) -> tuple[int, float]:
    token, _, bias = text.partition("=")
    try:
        return int(token), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"must be TOKEN=BIAS (a token id and a number), got {text!r}"
        ) from None


def build_request(args: argparse.Namespace) -> Any:
    from pdserve_proto import generation_pb2 as pb

    sampling = pb.SamplingParams(
        temperature=args.temperature,
        stop=args.stop,
        stop_token_ids=args.stop_token_id,
        ignore_eos=args.ignore_eos,
    )
    for name in ("max_tokens", *OPTIONAL_SAMPLING):
        if getattr(args, name) is not None:
            setattr(sampling, name, getattr(args, name))
    sampling.logit_bias.update(dict(args.logit_bias))
    req = pb.GenerateRequest(sampling=sampling, path=pb.Path.Value(f"PATH_{args.path.upper()}"))
    if args.chat:
        req.messages.append(pb.ChatMessage(role="user", content=args.prompt))
    else:
        req.prompt = args.prompt
    return req


def run(args: argparse.Namespace) -> int:
    import grpc
    from google.protobuf import json_format

    from engine.errors import InvalidRequestError
    from pdserve_client import ClientAuth
    from pdserve_client.connect import ClientAuthError
    from pdserve_proto import generation_pb2 as pb
    from pdserve_proto import generation_pb2_grpc as pb_grpc

    try:
        auth = ClientAuth.from_args(args)
        not_utf8([("prompt", args.prompt), *(("stop", s) for s in args.stop)])
    except (ClientAuthError, InvalidRequestError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    req = build_request(args)
    text: list[str] = []
    ids: list[int] = []
    logprobs: list[Any] = []
    prompt_logprobs: list[Any] = []
    final = None
    request_id = ""
    try:
        with auth.channel(args.address) as channel:
            stub = pb_grpc.GenerationStub(channel)
            calls = stub.Generate(
                req, timeout=args.timeout, wait_for_ready=args.wait, metadata=auth.metadata
            )
            for msg in calls:
                request_id = msg.request_id
                ids.extend(msg.token_ids)
                logprobs.extend(msg.logprobs)
                prompt_logprobs.extend(msg.prompt_logprobs)
                text.append(msg.text)
                if msg.HasField("final"):
                    final = msg.final
                if not args.json and msg.text:
                    sys.stdout.write(msg.text)
                    sys.stdout.flush()
    except KeyboardInterrupt:  # closing the channel cancels the call: the server aborts it
        if not args.json and text:
            sys.stdout.write("\n")
        print("interrupted", file=sys.stderr)
        return 130
    except grpc.RpcError as exc:
        if not args.json and text:
            sys.stdout.write("\n")
        code, details = exc.code(), exc.details() or ""
        if code is grpc.StatusCode.UNAVAILABLE and _http1(details):
            detail = (
                f"{args.address} answers HTTP/1, not gRPC: pdserve's HTTP or metrics port? "
                "`pdserve serve` prints its gRPC port: --port, 50051"
            )
        elif code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN) and _unreached(details):
            detail = f"{_why_unreached(args.address, details, auth)} ({details})"
        elif code is grpc.StatusCode.UNIMPLEMENTED:  # a gRPC server, not pdserve's main port
            detail = (
                f"{code.name}: {details} ({args.address} serves no pdserve.v1.Generation: "
                "is it pdserve's main port? `pdserve serve` prints it: --port, 50051)"
            )
        elif code is grpc.StatusCode.DEADLINE_EXCEEDED and args.wait and not ids:
            detail = (
                f"no answer from {args.address} within --timeout {args.timeout:g} s (waiting "
                "for a server to come up there, then for the first token)"
            )
        else:
            detail = f"{code.name}: {details}"
        print(f"error: {detail}", file=sys.stderr)
        return 1
    if args.json:
        answer = pb.CompleteResponse(
            request_id=request_id,
            token_ids=ids,
            text="".join(text),
            logprobs=logprobs,
            prompt_logprobs=prompt_logprobs,
        )
        if final is not None:
            answer.final.CopyFrom(final)
        doc = json_format.MessageToDict(answer, preserving_proto_field_name=True)
        print(json.dumps(doc, indent=2))
    else:
        sys.stdout.write("\n")
    return 0


def _http1(details: str) -> bool:
    """Whether gRPC's UNAVAILABLE says an HTTP/1 server answered (uvicorn's, or another's)."""
    said = details.lower()
    return "http1.x server" in said or "failed parsing http/2" in said


def _unreached(details: str) -> bool:
    """Whether an UNAVAILABLE is gRPC's own (no connection to the address), not the server's
    answer (a worker failed, none up)."""
    # gRPC core's own wording; the server's answers start otherwise ("request failed: ...")
    # and may quote a worker's connection error.
    return details.lower().startswith(
        ("failed to connect to all addresses", "dns resolution failed", "connection refused")
    )


def _why_unreached(address: str, details: str, auth: Any) -> str:
    """What a connection that never carried a call most likely met: TLS refused (the server's
    certificate not signed by --tls-ca's CA, a TLS port reached in plaintext, mutual TLS
    without a certificate it accepts), or no server there."""
    if "CERTIFICATE_VERIFY_FAILED" in details:
        return f"{address}'s certificate is not one --tls-ca's CA signed"
    if "socket closed" in details.lower():  # the server ended the connection at its start
        if auth.ca is None:
            return f"no pdserve server answering at {address}, or one that speaks TLS (--tls-ca)?"
        if auth.cert is None:
            return (
                f"no pdserve server answering at {address}, or one that asks for a client "
                "certificate (--tls-cert, --tls-key)?"
            )
        return f"{address} did not accept this client's certificate (--tls-cert)?"
    return f"no pdserve server answering at {address}?"


def not_utf8(texts: Iterable[tuple[str, str]]) -> None:
    """Raise InvalidRequestError naming the first (field, text) that is not valid UTF-8 (a
    shell argument of other bytes arrives as lone surrogates): the server's own check."""
    from router.request import utf8_len

    for field, text in texts:
        utf8_len(field, text)

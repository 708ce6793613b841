"""argparse types of the command-line clients' options (`pdserve complete`, `status`, `scale`,
`workers`, `bench`): each value checked as argparse reads it, the flag named in its error.

A server's address (`address`) is HOST:PORT, or HOST alone for the command's own port (gRPC
would otherwise try 443, HTTP 80). An IPv6 host is written in brackets ([::1]:50051). A gRPC
target with a scheme (`dns:///...`, `unix:...`, `ipv4:...`) is passed as is.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any

# gRPC's name-resolver schemes (a target `scheme:...`), passed to the channel as given.
GRPC_SCHEMES = ("dns", "unix", "unix-abstract", "ipv4", "ipv6", "vsock")


def address(default_port: int) -> Callable[[str], str]:
    """An argparse type: HOST:PORT with PORT in [1, 65535], or HOST (`default_port` added)."""

    def parse(text: str) -> str:
        if text.partition(":")[0] in GRPC_SCHEMES:
            return text
        bad = argparse.ArgumentTypeError(f"must be HOST:PORT or HOST, got {text!r}")
        if text.startswith("["):  # [IPv6] or [IPv6]:PORT
            host, bracket, rest = text.partition("]")
            host += bracket
            if not bracket or (rest and not rest.startswith(":")):
                raise bad
            port = rest[1:]
        elif text.count(":") > 1:
            raise argparse.ArgumentTypeError(
                f"an IPv6 address goes in brackets, e.g. [::1]:{default_port}, got {text!r}"
            )
        else:
            host, _, port = text.partition(":")
        if host in ("", "[]"):
            raise bad
        if not port:
            return f"{host}:{default_port}"
        if not port.isdigit() or not 1 <= int(port) <= 65535:
            raise argparse.ArgumentTypeError(
                f"the port must be a number in [1, 65535], got {port!r} (in {text!r})"
            )
        return f"{host}:{int(port)}"

    return parse


def integer_in(low: int, high: int) -> Any:
    """An argparse type: an integer in [low, high) (the range its proto field holds)."""

    def parse(text: str) -> int:
        try:
            n = int(text)
        except ValueError:
            n = low - 1
        if not low <= n < high:
            raise argparse.ArgumentTypeError(f"must be an integer in [{low}, {high}), got {text!r}")
        return n

    return parse


# The longest wait a client's option takes (about three years): gRPC refuses a deadline further
# off (1e10 s) as already past.
MAX_SECONDS = 1e8


def seconds(text: str) -> float:
    """An argparse type: a number of seconds in (0, MAX_SECONDS] (pdserve complete, status,
    scale, workers)."""
    return _seconds(text, zero=False)


def seconds_or_zero(text: str) -> float:
    """An argparse type: a number of seconds in [0, MAX_SECONDS]."""
    return _seconds(text, zero=True)


def _seconds(text: str, zero: bool) -> float:
    try:
        x = float(text)
    except ValueError:
        x = math.nan
    if not (0 <= x if zero else 0 < x) or not x <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(
            f"must be a number of seconds {'>=' if zero else '>'} 0 and <= {MAX_SECONDS:g}, "
            f"got {text!r}"
        )
    return x


def float_at_least(low: float, strict: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number >= low (> low when `strict`)."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or not (value > low if strict else value >= low):
            raise argparse.ArgumentTypeError(
                f"must be a number {'>' if strict else '>='} {low:g}, got {text!r}"
            )
        return value

    return parse


positive_float = float_at_least(0, strict=True)


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse type: an integer >= low."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"must be an integer >= {low}, got {text!r}")
        return value

    return parse


count = int_at_least(0)


def auto_or(parse: Callable[[str], float]) -> Callable[[str], float | str]:
    """An argparse type: the word auto (any case), or what `parse` takes."""

    def auto_or_parse(text: str) -> float | str:
        if text.lower() == "auto":
            return "auto"
        try:
            return parse(text)
        except argparse.ArgumentTypeError as exc:
            raise argparse.ArgumentTypeError(f"{exc} (or auto)") from None

    return auto_or_parse


def flag_set(args: argparse.Namespace, defaults: dict[str, Any]) -> str | None:
    """The flag (`--name`) of the first of `defaults`' options whose value in `args` is not
    its default (None: each is); for options refused where they would go unused."""
    name = next((k for k, default in defaults.items() if getattr(args, k) != default), None)
    return None if name is None else "--" + name.replace("_", "-")

"""A server's address as the command-line clients take it (`--address`): HOST:PORT, or HOST alone
for the command's own port (gRPC would otherwise try 443, HTTP 80). An IPv6 host is written in
brackets ([::1]:50051). A gRPC target with a scheme (`dns:///...`, `unix:...`) is passed as is."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def address(default_port: int) -> Callable[[str], str]:
    """An argparse type: HOST:PORT with PORT in [1, 65535], or HOST (`default_port` added)."""

    def parse(text: str) -> str:
        if "://" in text or text.startswith("unix:"):
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

"""What ends a bench run with one `error: ...` line rather than a traceback (bench/cli.py main)."""

from __future__ import annotations


class BenchError(Exception):
    """The run cannot go on: a server that did not start or does not answer, requests that all
    failed. `status` is the exit status: 2 for bad input, 1 otherwise."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status

"""The value checks of `pdserve serve`'s options (router/serve_options.py): each takes a YAML
value or a command-line string and returns the checked value, or raises ValueError saying what
was expected and what came."""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# Choices and bounds that serve's options and ClusterConfig (router/cluster_config.py) share.
KV_FAILURE_POLICIES = ("recompute", "fail")
KV_BACKENDS = ("auto", "gloo", "nccl")  # see WorkerSpec.kv_backend
# The shortest hang timeout (but 0: off): a worker answers its load poll between engine steps.
HANG_MIN_S = 3.0

Parse = Callable[[Any], Any]


class OptionError(ValueError):
    """A bad option value or config file; the message names the field."""


# -- value checks: each takes a YAML value or a command-line string ------------------------------
def integer(low: int, high: int | None = None) -> Parse:
    def parse(v: Any) -> int:
        what = f"an integer >= {low}" + (f" and <= {high}" if high is not None else "")
        if isinstance(v, bool) or not isinstance(v, (int, str)):
            raise ValueError(f"must be {what}, got {v!r}")
        try:
            n = int(v)
        except ValueError:
            raise ValueError(f"must be {what}, got {v!r}") from None
        if n < low or (high is not None and n > high):
            raise ValueError(f"must be {what}, got {n}")
        return n

    return parse


def number(low: float, strict: bool = False) -> Parse:
    """A finite number >= low (> low when `strict`)."""

    def parse(v: Any) -> float:
        what = f"a number {'>' if strict else '>='} {low:g}"
        if isinstance(v, bool) or not isinstance(v, (int, float, str)):
            raise ValueError(f"must be {what}, got {v!r}")
        try:
            x = float(v)
        except ValueError:
            raise ValueError(f"must be {what}, got {v!r}") from None
        if not math.isfinite(x) or x < low or (strict and x == low):
            raise ValueError(f"must be {what}, got {v!r}")
        return x

    return parse


def off_or(parse: Parse) -> Parse:
    """0 (off), or what `parse` takes."""

    def wrapped(v: Any) -> Any:
        try:
            return parse(v)
        except ValueError as exc:
            if not isinstance(v, bool) and isinstance(v, (int, float, str)):
                with contextlib.suppress(ValueError):
                    if float(v) == 0:
                        return 0.0
            raise ValueError(f"{exc} (or 0: off)") from None

    return wrapped


def optional(parse: Parse) -> Parse:
    """`parse`, or None for a null in the file (or the word `none` on the command line)."""

    def wrapped(v: Any) -> Any:
        if v is None or (isinstance(v, str) and v.lower() in ("none", "null", "")):
            return None
        return parse(v)

    return wrapped


def auto_or(parse: Parse) -> Parse:
    """The word `auto`, or what `parse` takes."""

    def wrapped(v: Any) -> Any:
        if isinstance(v, str) and v.lower() == "auto":
            return "auto"
        try:
            return parse(v)
        except ValueError as exc:
            raise ValueError(f"{exc} (or auto)") from None

    return wrapped


def text(v: Any) -> str:
    if not isinstance(v, str) or not v:
        raise ValueError(f"must be a non-empty string, got {v!r}")
    return v


def path(v: Any) -> Path:
    """A file path; `~` is the home folder, as a shell would read it on the command line."""
    if not isinstance(v, str) or not v:
        raise ValueError(f"must be a file path, got {v!r}")
    return Path(v).expanduser()


class choice:  # noqa: N801 (used as the other checks, which are functions)
    """One of `allowed`. With `fold_case` (serve's options) a word in any case, or one of
    `aliases` (another spelling: its canonical word), is taken as its canonical spelling."""

    def __init__(
        self, *allowed: str, fold_case: bool = False, aliases: dict[str, str] | None = None
    ) -> None:
        self.allowed, self.fold_case, self.aliases = allowed, fold_case, aliases or {}

    def __call__(self, v: Any) -> str:
        word = v.lower() if self.fold_case and isinstance(v, str) else v
        word = self.aliases.get(word, word) if isinstance(word, str) else word
        if word not in self.allowed:
            raise ValueError(f"must be one of {', '.join(self.allowed)}, got {v!r}")
        return str(word)

    def describe(self) -> str:
        """The help's list of the words taken."""
        also = f"; also {', '.join(self.aliases)}" if self.aliases else ""
        return f"one of {', '.join(self.allowed)}{also}"


def flag(v: Any) -> bool:
    if not isinstance(v, bool):
        raise ValueError(f"must be true or false, got {v!r}")
    return v


def resources(v: Any) -> dict[str, float]:
    """Ray resources: a mapping (or its JSON text) of names to positive amounts."""
    if isinstance(v, str):
        try:
            v = json.loads(v)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"must be a JSON object such as '{{\"prefill_node\": 1}}': {exc}"
            ) from None
    if not isinstance(v, dict):
        raise ValueError(f"must map resource names to amounts, got {v!r}")
    out: dict[str, float] = {}
    for k, amount in v.items():
        if not isinstance(k, str) or not k:
            raise ValueError(f"resource names must be non-empty strings, got {k!r}")
        if k in ("CPU", "GPU", "memory"):
            raise ValueError(f"{k!r} is set by other options (--threads, --gpus-per-worker)")
        try:
            out[k] = number(0.0, strict=True)(amount)
        except ValueError as exc:
            raise ValueError(f"{k}: {exc}") from None
    return out


@dataclass(frozen=True, slots=True)
class Option:
    name: str  # the config key; the flag is --name-with-dashes
    parse: Parse
    default: Any
    help: str
    boolean: bool = False  # a --name / --no-name flag pair
    # A file's path: relative in a config file, it is relative to that file's folder (on the
    # command line, to the current folder, as a shell has it).
    is_path: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

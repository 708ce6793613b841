"""argparse types of `pdserve bench`'s options: each value checked as argparse reads it."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable


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
# The longest per-request deadline (about three years): gRPC takes one further off as past.
MAX_TIMEOUT_S = 1e8


def timeout_seconds(text: str) -> float:
    """An argparse type: a per-request deadline in (0, MAX_TIMEOUT_S] seconds."""
    value = positive_float(text)
    if value > MAX_TIMEOUT_S:
        raise argparse.ArgumentTypeError(f"must be at most {MAX_TIMEOUT_S:g} s, got {text!r}")
    return value


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

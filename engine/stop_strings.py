"""Stop strings over streamed text.

While a request runs, the last (longest stop string - 1) characters are held back, because they
might be the start of a stop string that the next token completes; no text that belongs to a
stop string is ever streamed and then taken back.
"""

from __future__ import annotations

from engine.sampling_params import SamplingParams


class StopStringMatcher:
    def __init__(self, params: SamplingParams) -> None:
        self.stops = params.stop
        self.include = params.include_stop_str_in_output
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.sent = 0  # characters of output text already streamed
        self.end: int | None = None  # where the text ends once a stop string matched

    def find(self, text: str, upto: int | None = None) -> str | None:
        """The first stop string in `text` (searching only where a new match can start), ending
        at `upto` at the latest."""
        if not self.stops or self.end is not None:
            return None
        start = max(0, self.sent - self.hold)
        best: tuple[int, str] | None = None
        for s in self.stops:
            i = text.find(s, start, upto)
            if i >= 0 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.end = i + len(s) if self.include else i
        return s

    def safe_delta(self, text: str) -> str:
        upto = len(text) - self.hold if self.stops else len(text)
        if upto <= self.sent:
            return ""
        delta = text[self.sent : upto]
        self.sent = upto
        return delta

    def final_delta(self, text: str) -> str:
        end = len(text) if self.end is None else self.end
        delta = text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta

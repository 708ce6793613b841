"""One request's output text: incremental detokenization and stop strings over its token ids.

The engine's output processor keeps one per running request (a stop string found ends the
request). The router keeps its own over the ids the workers stream, so that text a worker held
back (an unfinished character, a possible stop-string prefix) is not lost when a request moves
to another worker, and a stop string that spans the move is still found."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.detokenizer import IncrementalDetokenizer
from engine.sampling_params import SamplingParams
from engine.stop_strings import StopStringMatcher


class TextStream:
    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int], params: SamplingParams):
        self._detok = IncrementalDetokenizer(tokenizer, prompt_token_ids)
        self._stops = StopStringMatcher(params)
        self.stop_hit: str | None = None  # the stop string that ended the text, once found

    def feed(self, token_ids: Sequence[int], finished: bool) -> str:
        """The new text `token_ids` complete; after a stop string is found (`stop_hit`), the
        text is final and the request should end."""
        if token_ids:
            self._detok.extend(token_ids)
        cut = 0
        if finished and self._detok.flush().endswith("\ufffd"):
            cut = 1  # a character cut off at the end: not the model's text, nor a stop string's
        text = self._detok.text
        hit = self._stops.find(text, len(text) - cut)
        if hit is not None:
            self.stop_hit = hit
        if finished or self.stop_hit is not None:
            return self._stops.final_delta(text)
        return self._stops.safe_delta(text)

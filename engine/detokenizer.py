"""Incremental detokenization: token ids in, text deltas out, one token at a time.

Decoding one token alone is wrong for two reasons. A token may carry only part of a UTF-8
character (byte-level BPE, sentencepiece byte fallback), which decodes to U+FFFD until the rest
arrives. And sentencepiece-style decoders drop the leading space of the first token they see, so a
token's text depends on what precedes it. So each step decodes a short window of ids:

    ids:    ... | context (already emitted) | pending (new) |
                ^ prefix_offset             ^ read_offset

and emits the part of the window's text beyond what the context already produced. The window slides
forward once its text ends on a complete character; until then the pending ids accumulate. Each
step costs a decode of a few tokens, whatever the length of the output.

Invariant: everything emitted plus `flush()` equals `tokenizer.decode(output_ids)` for byte-level
tokenizers, provided no run of more than `_MAX_HELD` tokens leaves the text ending in U+FFFD (only
garbage output does that; a character is at most 4 bytes). Decoders that strip the first token's
leading space (sentencepiece) keep that space here, as a stream continuing the prompt should.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from transformers import PreTrainedTokenizerBase

_REPLACEMENT = "\ufffd"
# Prompt tokens kept as decoding context before the first output token.
_CONTEXT_TOKENS = 5
# Pending tokens held back for an unfinished character before the text is emitted regardless.
_MAX_HELD = 16


class IncrementalDetokenizer:
    """Turns one request's output token ids into text deltas."""

    __slots__ = (
        "_backend",
        "_emitted",
        "_ids",
        "_read_offset",
        "_skip_special",
        "_text",
        "_tokenizer",
    )

    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
    ) -> None:
        self._tokenizer = tokenizer
        # The Rust tokenizer under a fast one decodes the same text without the Python wrapper's
        # per-call argument handling (decode runs twice per token).
        self._backend: Any = getattr(tokenizer, "backend_tokenizer", None)
        self._skip_special = skip_special_tokens
        # The window: ids from prefix_offset on. Ids before it are never decoded again.
        self._ids: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._read_offset = len(self._ids)
        # Characters of decode(self._ids) already accounted for (emitted, or prompt context).
        self._emitted = len(self._decode(self._ids))
        self._text = ""

    @property
    def text(self) -> str:
        """All output text emitted so far (excluding anything still held back)."""
        return self._text

    def add(self, token_id: int) -> str:
        """Append one output token; return the new text it completes (often "", never partial)."""
        return self.extend((token_id,))

    def extend(self, token_ids: Sequence[int]) -> str:
        """Append output tokens that arrived together; return the new text they complete, with
        one decode for all of them."""
        self._ids.extend(token_ids)
        window_text = self._decode(self._ids)
        held = len(self._ids) - self._read_offset
        stable = len(window_text.rstrip(_REPLACEMENT)) if held <= _MAX_HELD else len(window_text)
        delta = window_text[self._emitted : stable] if stable > self._emitted else ""
        self._emitted = max(self._emitted, stable)
        if stable == len(window_text):
            self._slide()
        if delta:
            self._text += delta
        return delta

    def flush(self) -> str:
        """Return text still held back (an unfinished character at the end), so none is lost."""
        window_text = self._decode(self._ids)
        delta = window_text[self._emitted :]
        self._emitted = len(window_text)
        self._slide()
        if delta:
            self._text += delta
        return delta

    def _slide(self) -> None:
        """Make the pending ids the next window's context: everything decoded so far is out."""
        self._ids = self._ids[self._read_offset :]
        self._read_offset = len(self._ids)
        self._emitted = len(self._decode(self._ids))

    def _decode(self, ids: list[int]) -> str:
        if self._backend is not None:
            return str(self._backend.decode(ids, skip_special_tokens=self._skip_special))
        # Clean-up of spaces around punctuation is a whole-text transform; applied per window it
        # would diverge from the full decode.
        text = self._tokenizer.decode(
            ids, skip_special_tokens=self._skip_special, clean_up_tokenization_spaces=False
        )
        assert isinstance(text, str)
        return text

"""Each token's own bytes, and where each token starts in the text (OpenAI's logprobs `bytes`
and `text_offset`). A token may hold part of a character (an emoji is often two or three byte-
level tokens): its decoded text is then a replacement character, but its bytes are exact, and
the text a client rebuilds from them is the model's.

  byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM): each character of the token's piece stands for
      one byte (the tokenizers library's ByteLevel table);
  SentencePiece: a byte-fallback piece `<0xNN>` is that byte, `▁` a space;
  an added token (special or not): its text's UTF-8, as written.
A special token adds no text (the detokenizer leaves it out): no characters to the offsets.
"""

from __future__ import annotations

import codecs
import re
from collections.abc import Iterable, Sequence
from typing import Any

from transformers.convert_slow_tokenizer import bytes_to_unicode

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class TokenBytes:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
        self._byte_level = "ByteLevel" in repr(decoder)
        self._table = {c: b for b, c in bytes_to_unicode().items()}
        self._added = set(getattr(tokenizer, "added_tokens_decoder", {}))
        self.special = set(getattr(tokenizer, "all_special_ids", ()))
        self._cache: dict[int, bytes] = {}

    def __call__(self, token_id: int) -> bytes:
        got = self._cache.get(token_id)
        if got is None:
            got = self._cache[token_id] = self._bytes(token_id)
        return got

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if piece is None:
            return b""
        if token_id in self._added or token_id in self.special:
            return str(piece).encode()
        if self._byte_level and all(c in self._table for c in piece):
            return bytes(self._table[c] for c in piece)
        m = _BYTE_PIECE.fullmatch(piece)
        if m is not None:
            return bytes([int(m.group(1), 16)])
        return str(piece).replace("▁", " ").encode()


class TextOffsets:
    """Where each token fed starts in the text, in characters, carried over a stream's chunks:
    the characters the tokens before it complete (a character split over tokens counts from
    the token that completes it). `start`: the offset of the first token fed (the length of
    text put before it, an echoed prompt's)."""

    def __init__(
        self, token_bytes: TokenBytes, prompt_token_ids: Sequence[int] = (), start: int = 0
    ) -> None:
        self._bytes = token_bytes
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")
        self.chars = start
        # A prompt (as token ids) may end inside a character: the output's first character then
        # completes the prompt's, and is not in the output's text.
        tail = [t for t in prompt_token_ids if t not in token_bytes.special][-4:]
        self._utf8.decode(b"".join(token_bytes(t) for t in tail))
        self._owed = 1 if self._utf8.getstate()[0] else 0

    def feed(self, token_ids: Iterable[int]) -> list[int]:
        out = []
        for t in token_ids:
            out.append(self.chars)
            if t not in self._bytes.special:
                n = len(self._utf8.decode(self._bytes(t)))
                if n and self._owed:
                    n, self._owed = n - 1, 0
                self.chars += n
        return out

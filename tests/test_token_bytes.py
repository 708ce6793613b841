"""Each token's own bytes and its offset in the text (the HTTP API's logprobs `bytes` and
`text_offset`), where tokens split characters: an emoji over two or three byte-level tokens."""

from __future__ import annotations

import pytest

from engine.token_bytes import TextOffsets, TokenBytes
from tests.helpers import loaded

TEXT = "Japanese: 日本語, emoji: 🎉🎉, again 🐦!"


@pytest.mark.parametrize("model", ["smollm2-135m", "tiny-llama"])
def test_the_tokens_bytes_rebuild_the_text_and_their_offsets_index_it(model):
    tok = loaded(model).tokenizer
    ids = tok.encode(TEXT, add_special_tokens=False)
    pieces = TokenBytes(tok)
    assert b"".join(pieces(t) for t in ids).decode() == TEXT
    split = [t for t in ids if "\ufffd" in tok.decode([t])]
    assert split, "the text splits no character: it tests nothing"
    assert all(b"\xef\xbf\xbd" not in pieces(t) for t in split)  # its bytes, not U+FFFD's
    # Fed whole or over chunks, the offsets are where each token's text starts.
    whole = TextOffsets(pieces).feed(ids)
    chunked = TextOffsets(pieces)
    assert [o for i in range(0, len(ids), 3) for o in chunked.feed(ids[i : i + 3])] == whole
    for t, start, end in zip(ids, whole, [*whole[1:], len(TEXT)]):
        own = pieces(t).decode(errors="ignore")  # the whole characters it holds, if any
        assert TEXT[start:end].endswith(own) and end - start <= len(own) + 1
    assert chunked.chars == len(TEXT)

"""Each token's own bytes and its offset in the text (the HTTP API's logprobs `bytes` and
`text_offset`), where tokens split characters: an emoji over two or three byte-level tokens."""

from __future__ import annotations

import pytest

from engine.detokenizer import IncrementalDetokenizer
from engine.token_bytes import TextOffsets, TokenBytes
from router.http_shapes import Shapes
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
    # Each offset is the characters of the text whose bytes came before the token: what is
    # left of those bytes is part of one character (less than its 4 bytes).
    before = b""
    for t, start in zip(ids, whole):
        head = TEXT[:start].encode()
        assert before.startswith(head) and len(before) - len(head) < 4, (t, start)
        before += pieces(t)
    assert chunked.chars == len(TEXT)
    # A special token adds no text, so nothing to the offsets after it.
    special = tok.all_special_ids[0]
    assert TextOffsets(pieces).feed([*ids[:3], special, *ids[3:5]])[4] == whole[3]
    # A prompt (token ids) that ends inside a character: the output's text begins after that
    # character, and its offsets index that text.
    k = ids.index(split[0]) + 1  # the prompt ends with the character's first token
    assert "\ufffd" in tok.decode(ids[:k])[-1:]
    detok = IncrementalDetokenizer(tok, ids[:k])
    detok.extend(ids[k:])
    detok.flush()
    begins = len(b"".join(pieces(t) for t in ids[:k]).decode("utf-8", "replace"))
    assert detok.text == TEXT[begins:]
    offsets = TextOffsets(pieces, ids[:k]).feed(ids[k:])
    assert offsets == [max(0, o - begins) for o in whole[k:]]


class Pieces:
    """A SentencePiece tokenizer's pieces: a word with its ▁, byte-fallback pieces."""

    all_special_ids = [0]
    added_tokens_decoder = {0: "<s>"}

    def convert_ids_to_tokens(self, token_id):
        return {0: "<s>", 1: "▁caf", 2: "<0xC3>", 3: "<0xA9>"}[token_id]

    def decode(self, ids):
        return {0: "<s>"}[ids[0]]


def test_sentencepiece_byte_pieces_and_spaces():
    """A SentencePiece tokenizer's byte-fallback piece is its byte, its ▁ a space."""
    pieces = TokenBytes(Pieces())
    assert b"".join(pieces(t) for t in (1, 2, 3)).decode() == " café"
    assert TextOffsets(pieces).feed([0, 1, 2, 3]) == [0, 0, 4, 4]


def test_a_logprob_tokens_text_keeps_its_space_and_a_part_of_a_character_is_its_bytes():
    """The HTTP API's logprobs tokens: joined, they rebuild the text; no two of different
    bytes share one text (completions' top_logprobs are keyed by it)."""
    shapes = Shapes("m", Pieces())
    assert [shapes.token(t) for t in (0, 1, 2, 3)] == ["<s>", " caf", "bytes:\\xc3", "bytes:\\xa9"]


def test_an_echoed_prompt_ending_inside_a_character_keeps_the_answer_s_offsets_in_its_text():
    """Echo with logprobs: a prompt whose last token holds part of a character ("hi" and é's
    first byte; echoed as its text, "hi" and U+FFFD), the answer's first token the rest of it:
    the answer's next tokens' offsets index the echoed text followed by the answer's text."""
    from engine.sampling_params import SamplingParams
    from engine.token_logprobs import TokenLogprobs
    from router.http_shapes import Call, echo_of
    from router.request import ParsedRequest
    from router.vocab import Frontend, RoutePath

    tok = loaded("tiny-llama").tokenizer  # byte-level: id b is byte b
    prompt, answer = (104, 105, 0xC3), (0xA9, 32, 120)  # "hi", é, " x"
    echoed = tok.decode(list(prompt), skip_special_tokens=True)
    req = ParsedRequest("r", prompt, SamplingParams(logprobs=0), RoutePath.AUTO, None, None,
                        Frontend.HTTP)  # fmt: skip
    call = Call((req,), 1, 0.0, False, False, False, 0, (echoed,))
    shapes = Shapes("m", tok)
    lps = tuple(TokenLogprobs(t, -1.0) for t in answer)
    got = shapes.logprobs(call, lps, shapes.offsets(call), echo_of(call, 0, ()))
    text = echoed + " x"  # the answer's text: é completes the prompt's character, not its own
    assert got is not None and got["text_offset"][:3] == [0, 1, 2]
    assert [text[o] for o in got["text_offset"][4:]] == [" ", "x"]

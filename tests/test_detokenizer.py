from __future__ import annotations

import random
from typing import Any

import pytest
from transformers import PreTrainedTokenizerBase

from engine.config import ModelConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import ModelNotFoundError
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from engine.text_stream import TextStream
from engine.tiny_models import EOS_ID, byte_tokenizer

MULTIBYTE = "naïve café 🙂 日本語 👩‍👩‍👧 and 🇫🇷!"


def _stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.add(i) for i in ids]


def test_split_characters_never_emit_replacement() -> None:
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode(MULTIBYTE)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt: ✓ "))
    deltas = _stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE == tokenizer.decode(ids)
    assert detok.flush() == ""
    assert detok.text == MULTIBYTE


def test_four_byte_character_appears_once_complete() -> None:
    tokenizer = byte_tokenizer()
    detok = IncrementalDetokenizer(tokenizer, [])
    assert _stream(detok, tokenizer.encode("a🙂")) == ["a", "", "", "", "🙂"]


def test_flush_returns_unfinished_tail() -> None:
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode("ok 🙂")[:-2]  # cut the emoji after two of its four bytes
    detok = IncrementalDetokenizer(tokenizer, [])
    assert "".join(_stream(detok, ids)) == "ok "
    tail = detok.flush()
    assert tail == "\ufffd"
    assert detok.text == tokenizer.decode(ids)


def test_a_character_cut_off_at_the_end_is_no_stop_string() -> None:
    """The U+FFFD given for it is not the model's text: a request that ran out of tokens there
    ended for its length."""
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode("ok 🙂")[:-2]
    stream = TextStream(tokenizer, [], SamplingParams(stop=["\ufffd"], max_tokens=len(ids)))
    assert stream.feed(ids, finished=True) == "ok \ufffd"
    assert stream.stop_hit is None
    whole = TextStream(tokenizer, [], SamplingParams(stop=["k"], max_tokens=len(ids)))
    assert whole.feed(ids, finished=True) == "o" and whole.stop_hit == "k"


def test_random_byte_streams_match_full_decode() -> None:
    tokenizer = byte_tokenizer()
    rng = random.Random(0)
    for _ in range(300):
        ids = [rng.randrange(len(tokenizer)) for _ in range(rng.randrange(1, 80))]
        detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("ascii prompt"))
        joined = "".join(_stream(detok, ids)) + detok.flush()
        assert joined == tokenizer.decode(ids, skip_special_tokens=True) == detok.text


def test_special_tokens_skipped_or_kept() -> None:
    tokenizer = byte_tokenizer()
    ids = [*tokenizer.encode("a"), EOS_ID, *tokenizer.encode("b")]
    skipped = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=True)
    kept = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=False)
    assert "".join(_stream(skipped, ids)) == "ab"
    assert "".join(_stream(kept, ids)) == "a<|eos|>b"


class _RecordingTokenizer:
    """Forwards decode, remembering the longest id list it was asked to decode."""

    def __init__(self, inner: PreTrainedTokenizerBase) -> None:
        self.inner = inner
        self.longest = 0

    def decode(self, ids: list[int], **kwargs: Any) -> str:
        self.longest = max(self.longest, len(ids))
        text = self.inner.decode(ids, **kwargs)
        assert isinstance(text, str)
        return text


def test_work_per_token_is_bounded() -> None:
    tokenizer = byte_tokenizer()
    recorder = _RecordingTokenizer(tokenizer)
    prompt = tokenizer.encode("a long prompt " * 50)
    detok = IncrementalDetokenizer(recorder, prompt)  # type: ignore[arg-type]
    text = MULTIBYTE * 40
    _stream(detok, tokenizer.encode(text))
    assert detok.text == text
    assert recorder.longest <= 10


@pytest.fixture(scope="module")
def smollm2_tokenizer() -> PreTrainedTokenizerBase:
    try:
        return load_model(ModelConfig()).tokenizer
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.mark.parametrize(
    "text",
    [
        "Hello  world,   spaced out.\n\nNew paragraph with\ttabs and trailing space ",
        " The capital of France is Paris. Café crème 🙂 日本",
    ],
)
def test_smollm2_preserves_spaces(smollm2_tokenizer: PreTrainedTokenizerBase, text: str) -> None:
    prompt_ids = smollm2_tokenizer.apply_chat_template(
        [{"role": "user", "content": "Say something."}],
        add_generation_prompt=True,
        return_dict=True,
    )["input_ids"]
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(smollm2_tokenizer, prompt_ids)
    deltas = _stream(detok, ids)
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) + detok.flush() == text == smollm2_tokenizer.decode(ids)


@pytest.mark.parametrize("group", [2, 3, 7, 16])
def test_tokens_that_arrive_together_give_the_same_text(group: int) -> None:
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode(MULTIBYTE)
    detok = IncrementalDetokenizer(tokenizer, tokenizer.encode("prompt: "))
    deltas = [detok.extend(ids[i : i + group]) for i in range(0, len(ids), group)]
    deltas.append(detok.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == MULTIBYTE == detok.text

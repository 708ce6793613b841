"""GGUF files converted once into safetensors folders under a cache root.

Loading a GGUF file through transformers dequantizes every tensor (~20 s for 135M parameters), so
a GGUF model is converted once into a folder under the cache root and read from there afterwards
(~0.4 s). A folder only ever appears by an atomic rename of a finished conversion, so its
presence means it is complete. The weights are kept in float32 (the dequantized values,
exactly); config.json's `dtype` records the GGUF file's own dtype.

A file's folder is named by its stem, size and mtime: a file replaced at the same path is
converted again, and the conversions of its earlier contents (each a float32 copy of the model)
are removed then. `source.json` in each folder names the file it came from (its resolved path),
with the size and mtime it had: a copy is removed only where its file has changed since, so two
names of one file (a link) do not remove each other's.

A file pdserve would not run is refused from its header alone, before it is dequantized.
"""

from __future__ import annotations

import copy
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from engine.architectures import GGUF_ARCHITECTURES, SUPPORTED_ARCHITECTURES, architecture
from engine.checkpoint_dtype import gguf_architecture, gguf_dtype, is_gguf
from engine.errors import ModelNotFoundError

logger = logging.getLogger(__name__)

SOURCE = "source.json"  # in a converted folder: the file it came from


def is_gguf_name(path: Path) -> bool:
    """Whether `path` is a file named as a GGUF file (`.gguf`, in any case)."""
    return path.is_file() and path.suffix.lower() == ".gguf"


def is_complete(folder: Path) -> bool:
    return (folder / "config.json").is_file()


def cached_folder(path: Path, root: Path) -> Path:
    """The converted folder of the GGUF file at `path` under `root`, converting it first when
    there is none for its present contents."""
    stat = path.stat()
    folder = root / f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}"
    if not is_complete(folder):
        check(path)
        convert(path, folder)
        remove_earlier_conversions(folder)
    return folder


def check(path: Path) -> None:
    """Refuse a file that is not GGUF, or a GGUF model pdserve does not run, from its header
    alone: converting dequantizes every tensor first."""
    if not is_gguf(path):
        raise ModelNotFoundError(f"model {str(path)!r} is not a GGUF file (no GGUF magic bytes)")
    found = gguf_architecture(path)
    if found not in GGUF_ARCHITECTURES:
        raise ModelNotFoundError(
            f"model {str(path)!r} is a GGUF file of architecture {found!r}, which pdserve does "
            f"not run (it runs GGUF architectures {GGUF_ARCHITECTURES}). "
            f"Supported architectures: {SUPPORTED_ARCHITECTURES}"
        )


def convert(gguf: Path, folder: Path) -> None:
    """Dequantize `gguf` into a safetensors model + tokenizer folder at `folder`, atomically."""
    logger.info("converting %s into %s (once)", gguf, folder)
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", suffix=".tmp", dir=folder.parent))
    try:
        stat = gguf.stat()
        src = AutoModelForCausalLM.from_pretrained(
            str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
        )
        tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
        config = copy.deepcopy(src.config)
        config.architectures = [type(src).__name__]
        architecture(config, str(gguf))
        # The GGUF loader tags the config as GGUF-quantized although the weights it returns are
        # dense. Saved, the tag would reload as a quantized model, which refuses `.half()`.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = type(src)(config)
        model.load_state_dict(src.state_dict())
        eos = tokenizer.eos_token_id
        pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
        model.generation_config = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id, eos_token_id=eos, pad_token_id=pad
        )
        model.save_pretrained(tmp)
        _declare_dtype(tmp / "config.json", gguf_dtype(gguf))
        tokenizer.save_pretrained(tmp)
        source = {"gguf": str(gguf.resolve()), "size": stat.st_size, "mtime_ns": stat.st_mtime_ns}
        (tmp / SOURCE).write_text(json.dumps(source) + "\n")
        try:
            os.rename(tmp, folder)
        except OSError:
            # Another process finished the same conversion first; its result is as good.
            if not is_complete(folder):
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def remove_earlier_conversions(folder: Path) -> None:
    """Remove the folders beside `folder` converted from the same file as it was before it
    changed (another size or mtime than the file has now)."""
    source = _source(folder)
    if source is None:
        return
    try:
        now = Path(str(source["gguf"])).stat()
    except OSError:
        return
    for other in folder.parent.iterdir():
        theirs = None if other == folder or other.name.startswith(".") else _source(other)
        if theirs is None or theirs["gguf"] != source["gguf"]:
            continue
        if (theirs.get("size"), theirs.get("mtime_ns")) != (now.st_size, now.st_mtime_ns):
            logger.info("removing %s, converted from an earlier %s", other, source["gguf"])
            shutil.rmtree(other, ignore_errors=True)


def _source(folder: Path) -> dict[str, object] | None:
    try:
        source = json.loads((folder / SOURCE).read_text())
    except (OSError, ValueError):
        return None
    return source if isinstance(source, dict) and isinstance(source.get("gguf"), str) else None


def _declare_dtype(config_json: Path, dtype: str) -> None:
    """Set the checkpoint dtype config.json declares. save_pretrained writes the dtype of the
    weights it saved (float32 here, the dequantized values), not the GGUF file's own."""
    config = json.loads(config_json.read_text())
    config["dtype"] = dtype
    config_json.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")

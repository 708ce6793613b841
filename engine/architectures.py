"""The model architectures pdserve runs, and the check that refuses any other by name."""

from __future__ import annotations

from transformers import PretrainedConfig

from engine.errors import ModelNotFoundError

SUPPORTED_ARCHITECTURES = (
    "LlamaForCausalLM",
    "MistralForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen3ForCausalLM",
)
# Configs saved without `architectures` still name their model type.
ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}
# GGUF `general.architecture` values that transformers loads as a supported architecture.
GGUF_ARCHITECTURES = tuple(ARCH_BY_MODEL_TYPE)


def architecture(config: PretrainedConfig, name: str) -> str:
    """The config's supported architecture, else ModelNotFoundError naming what it has."""
    found = list(config.architectures or [])
    if not found and config.model_type in ARCH_BY_MODEL_TYPE:
        found = [ARCH_BY_MODEL_TYPE[config.model_type]]
    for arch in found:
        if arch in SUPPORTED_ARCHITECTURES:
            return arch
    described = ", ".join(found) or f"model_type {config.model_type!r}"
    raise ModelNotFoundError(
        f"model {name!r} has architecture {described}, which pdserve does not run. "
        f"Supported architectures: {SUPPORTED_ARCHITECTURES}"
    )

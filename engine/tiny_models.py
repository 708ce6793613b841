"""Seeded, randomly initialised small models of each supported architecture, for tests and benches.

They build in milliseconds from configs, with no downloads, and share one byte-level tokenizer.
Their shapes exercise what a Llama-family runner must get right: grouped-query attention (4 query
heads over 2 KV heads), q/k/v biases (Qwen2), q/k RMSNorm (Qwen3), tied and untied embeddings, and
a vocabulary padded past the tokenizer (Qwen2, as real Qwen2 checkpoints are).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

TINY_MODELS = ("tiny-llama", "tiny-mistral", "tiny-qwen2", "tiny-qwen3")

BOS_TOKEN, EOS_TOKEN, PAD_TOKEN = "<|bos|>", "<|eos|>", "<|pad|>"
BOS_ID, EOS_ID, PAD_ID = 256, 257, 258
TOKENIZER_VOCAB = 259

# Encoding never adds special tokens; the chat template writes <|bos|> itself, as SmolLM2's
# template writes <|im_start|>. So `encode(s)` is exactly the UTF-8 bytes of s, and a chat prompt
# rendered to text and then tokenized does not get a second bos.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<' + message['role'] + '>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<assistant>\n' }}{% endif %}"
)

# HF's default std of 0.02 leaves logits nearly flat (greedy decoding then hinges on float
# near-ties that differ between kernels). 0.2 gives logits a spread of a few units.
_INIT_STD = 0.2
# Norm weights near, not at, 1 so a runner that skips or swaps a norm produces different logits.
_NORM_JITTER = 0.1


def byte_tokenizer() -> PreTrainedTokenizerFast:
    """A tokenizer whose tokens are the 256 bytes (ids 0-255) plus bos/eos/pad (256-258).

    No merges: a character of k UTF-8 bytes spans k tokens, so detokenizers meet split characters
    all the time. `decode(encode(s)) == s` for every string that does not itself contain one of
    the special-token strings.
    """
    vocab = {symbol: byte for byte, symbol in enumerate(_byte_symbols())}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    backend.add_special_tokens([BOS_TOKEN, EOS_TOKEN, PAD_TOKEN])
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS_TOKEN,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        clean_up_tokenization_spaces=False,
        model_max_length=1024,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    assert [tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id] == [
        BOS_ID,
        EOS_ID,
        PAD_ID,
    ]
    return tokenizer


def _byte_symbols() -> list[str]:
    """The ByteLevel symbol of each byte 0..255 (GPT-2's printable remapping), so id == byte."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    symbols: list[str] = []
    shifted = 0
    for byte in range(256):
        if byte in printable:
            symbols.append(chr(byte))
        else:
            symbols.append(chr(256 + shifted))
            shifted += 1
    assert set(symbols) == set(pre_tokenizers.ByteLevel.alphabet())
    return symbols


def _common(vocab_size: int, num_layers: int, tie: bool) -> dict[str, Any]:
    return {
        "vocab_size": vocab_size,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": num_layers,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 16,
        "max_position_embeddings": 1024,
        "initializer_range": _INIT_STD,
        "tie_word_embeddings": tie,
        "bos_token_id": BOS_ID,
        "eos_token_id": EOS_ID,
        "pad_token_id": PAD_ID,
    }


def _llama() -> PreTrainedModel:
    # Tied embeddings, like the default SmolLM2 model.
    return LlamaForCausalLM(LlamaConfig(**_common(TOKENIZER_VOCAB, 4, tie=True)))


def _mistral() -> PreTrainedModel:
    cfg = MistralConfig(**_common(TOKENIZER_VOCAB, 2, tie=False), sliding_window=None)
    return MistralForCausalLM(cfg)


_QWEN_ROPE = {"rope_type": "default", "rope_theta": 1e6}


def _qwen2() -> PreTrainedModel:
    # Qwen2 always has q/k/v biases; the logits dimension (320) exceeds the tokenizer (259).
    return Qwen2ForCausalLM(Qwen2Config(**_common(320, 3, tie=False), rope_parameters=_QWEN_ROPE))


def _qwen3() -> PreTrainedModel:
    return Qwen3ForCausalLM(Qwen3Config(**_common(TOKENIZER_VOCAB, 2, tie=True)))


_BUILDERS: dict[str, Callable[[], PreTrainedModel]] = {
    "tiny-llama": _llama,
    "tiny-mistral": _mistral,
    "tiny-qwen2": _qwen2,
    "tiny-qwen3": _qwen3,
}


def build_tiny_model(
    name: str, seed: int = 0, dtype: torch.dtype = torch.float32
) -> tuple[PreTrainedModel, PreTrainedTokenizerFast]:
    """Build tiny model `name` (one of TINY_MODELS) in eval mode on CPU.

    The same (name, seed) gives the same weights, and the caller's RNG state is left untouched.
    """
    if name not in _BUILDERS:
        raise KeyError(f"unknown tiny model {name!r}; built-in tiny models: {TINY_MODELS}")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = _BUILDERS[name]()
        _reinit(model)
    # PreTrainedModel.to's decorator hides torch's signature from type checkers.
    torch.nn.Module.to(model, dtype).eval()
    tokenizer = byte_tokenizer()
    gen = model.generation_config
    gen.bos_token_id, gen.eos_token_id, gen.pad_token_id = BOS_ID, EOS_ID, PAD_ID
    return model, tokenizer


def _reinit(model: PreTrainedModel) -> None:
    """Draw every parameter from the current (seeded) RNG, in parameter order.

    HF initialises biases to 0 and norm weights to 1, which would let a runner that drops a bias
    or a norm pass its tests; random values make each one matter.
    """
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.copy_(1.0 + _NORM_JITTER * torch.randn_like(param))
            else:
                param.normal_(0.0, _INIT_STD)
        # Rows past the tokenizer's vocabulary give logit 0, far below the top real logits, so
        # greedy decoding never picks an id the tokenizer cannot decode.
        for table in (model.get_input_embeddings(), model.get_output_embeddings()):
            weight = table.weight
            assert isinstance(weight, torch.Tensor)
            weight[TOKENIZER_VOCAB:].zero_()

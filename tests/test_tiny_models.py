from __future__ import annotations

import pytest
import torch

from engine.tiny_models import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    TINY_MODELS,
    build_tiny_model,
    byte_tokenizer,
)

UNICODE_SAMPLES = [
    "",
    "plain ascii, with  two spaces\tand a tab\n",
    "héllo wörld, ça va? ß",
    "日本語のテキスト、中文文本",
    "emoji 🙂🚀 and a family 👩‍👩‍👧 and a flag 🇫🇷",
    " leading and trailing spaces ",
    "\x00 control \x7f chars \u200b zero width",
]


def _state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("name", TINY_MODELS)
def test_same_seed_same_weights_other_seed_different(name: str) -> None:
    a = _state(build_tiny_model(name, seed=0)[0])
    b = _state(build_tiny_model(name, seed=0)[0])
    c = _state(build_tiny_model(name, seed=1)[0])
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a)


def test_build_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    expected = torch.rand(4)
    torch.manual_seed(123)
    build_tiny_model("tiny-llama", seed=7)
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize("name", TINY_MODELS)
def test_greedy_generation_is_varied_with_clear_margins(name: str) -> None:
    model, tokenizer = build_tiny_model(name, seed=0)
    assert not model.training
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Tell me a story."}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    input_ids = prompt["input_ids"]
    out = model.generate(
        input_ids=input_ids,
        attention_mask=prompt["attention_mask"],
        max_new_tokens=32,
        min_new_tokens=32,
        do_sample=False,
    )
    generated = out[0, input_ids.shape[1] :].tolist()
    assert len(set(generated)) >= 8, generated
    with torch.no_grad():
        logits = model(out).logits[0]
    top2 = logits.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert (gaps > 1e-3).float().mean() > 0.95


def test_architecture_features() -> None:
    llama, _ = build_tiny_model("tiny-llama")
    mistral, _ = build_tiny_model("tiny-mistral")
    qwen2, _ = build_tiny_model("tiny-qwen2")
    qwen3, _ = build_tiny_model("tiny-qwen3")
    for model in (llama, mistral, qwen2, qwen3):
        cfg = model.config
        assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
        assert cfg.hidden_size == 64
        assert model.generation_config.eos_token_id == EOS_ID
    assert mistral.config.sliding_window is None
    attn2 = qwen2.model.layers[0].self_attn
    assert attn2.q_proj.bias is not None and attn2.q_proj.bias.abs().sum() > 0
    assert qwen2.config.vocab_size > len(byte_tokenizer())
    assert qwen3.model.layers[0].self_attn.q_norm.weight.shape == (16,)
    assert not mistral.config.tie_word_embeddings
    assert llama.lm_head.weight.data_ptr() == llama.model.embed_tokens.weight.data_ptr()


def test_dtype_and_unknown_name() -> None:
    model, _ = build_tiny_model("tiny-qwen3", dtype=torch.bfloat16)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    with pytest.raises(KeyError, match="tiny-gpt"):
        build_tiny_model("tiny-gpt")


@pytest.mark.parametrize("text", UNICODE_SAMPLES)
def test_byte_tokenizer_round_trip(text: str) -> None:
    tokenizer = byte_tokenizer()
    ids = tokenizer.encode(text)
    assert ids == list(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_byte_tokenizer_specials_and_chat_template() -> None:
    tokenizer = byte_tokenizer()
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        BOS_ID,
        EOS_ID,
        PAD_ID,
    )
    assert len(tokenizer) == 259
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    with_prompt = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    without = tokenizer.apply_chat_template(messages, add_generation_prompt=False, tokenize=False)
    assert isinstance(with_prompt, str) and isinstance(without, str)
    assert with_prompt.startswith("<|bos|><system>\nBe brief.<|eos|>\n<user>\nHi<|eos|>\n")
    assert with_prompt == without + "<assistant>\n"
    ids = tokenizer.encode(with_prompt)
    assert ids[0] == BOS_ID and ids.count(BOS_ID) == 1
    assert tokenizer.decode(ids, skip_special_tokens=True).startswith("<system>\nBe brief.\n")

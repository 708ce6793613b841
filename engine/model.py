"""A Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) run over the paged KV cache.

Weights are taken from the transformers model (q/k/v and gate/up fused for fewer, larger matmuls);
the math follows transformers' modeling code so greedy outputs match it token for token:
RMSNorm in float32, rotary embeddings from the model's own rotary module (so every RoPE scaling
variant it supports is honoured), optional q/k/v bias (Qwen2) and per-head q/k RMSNorm (Qwen3).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from engine.attention import AttentionBackend, AttentionMetadata


@dataclass(frozen=True, slots=True)
class LayerWeights:
    input_norm: torch.Tensor
    qkv_w: torch.Tensor
    qkv_b: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o_w: torch.Tensor
    o_b: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up_w: torch.Tensor
    down_w: torch.Tensor


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class PagedDecoderModel:
    def __init__(self, hf_model: Any, device: torch.device, dtype: torch.dtype) -> None:
        cfg: Any = hf_model.config
        self.config = cfg
        self.device = device
        self.num_heads = int(cfg.num_attention_heads)
        self.num_kv_heads = int(getattr(cfg, "num_key_value_heads", None) or self.num_heads)
        self.head_dim = int(getattr(cfg, "head_dim", None) or cfg.hidden_size // self.num_heads)
        self.eps = float(cfg.rms_norm_eps)
        self.num_layers = int(cfg.num_hidden_layers)
        self.vocab_size = int(cfg.vocab_size)
        if getattr(cfg, "hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {cfg.hidden_act!r} is not supported (only silu)")
        if getattr(cfg, "mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        inner: Any = hf_model.model

        def t(x: torch.Tensor) -> torch.Tensor:
            return x.detach().to(device=device, dtype=dtype).contiguous()

        self.embed = t(inner.embed_tokens.weight)
        self.final_norm = t(inner.norm.weight)
        self.lm_head = t(hf_model.lm_head.weight)
        # A copy: moving the transformers model's own module would change it for other users.
        self.rotary = copy.deepcopy(inner.rotary_emb).to(device)
        # Qwen3 normalises q and k per head before RoPE; the others don't.
        qk_norm = cfg.model_type == "qwen3"
        self.layers = []
        for layer in inner.layers:
            att, mlp = layer.self_attn, layer.mlp
            bias = att.q_proj.bias is not None
            self.layers.append(
                LayerWeights(
                    input_norm=t(layer.input_layernorm.weight),
                    qkv_w=t(torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight])),
                    qkv_b=t(torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias]))
                    if bias
                    else None,
                    q_norm=t(att.q_norm.weight) if qk_norm else None,
                    k_norm=t(att.k_norm.weight) if qk_norm else None,
                    o_w=t(att.o_proj.weight),
                    o_b=t(att.o_proj.bias) if att.o_proj.bias is not None else None,
                    post_norm=t(layer.post_attention_layernorm.weight),
                    gate_up_w=t(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                    down_w=t(mlp.down_proj.weight),
                )
            )
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = float(self.head_dim**-0.5)

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dummy = self.embed[:1]
        cos, sin = self.rotary(dummy, positions.unsqueeze(0))
        return cos[0].unsqueeze(1), sin[0].unsqueeze(1)  # [T, 1, D]

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        attention: AttentionBackend,
        logit_rows: torch.Tensor,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run one step over T flattened tokens; return logits [len(logit_rows), vocab]."""
        x = self.hidden(input_ids, positions, md, attention, on_layer)
        return self.logits(x[logit_rows])

    @torch.inference_mode()
    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The logits [N, vocab] of N rows of the last layer's output (`hidden`)."""
        return F.linear(rms_norm(x, self.final_norm, self.eps), self.lm_head)

    @torch.inference_mode()
    def hidden(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        md: AttentionMetadata,
        attention: AttentionBackend,
        on_layer: Callable[[int], None] | None = None,
    ) -> torch.Tensor:
        """Run one step over T flattened tokens; return the last layer's output [T, hidden]
        (before the final norm)."""
        T = input_ids.shape[0]
        x = self.embed[input_ids]
        cos, sin = self.rope(positions)
        H, Hkv, D = self.num_heads, self.num_kv_heads, self.head_dim
        for i, w in enumerate(self.layers):
            h = rms_norm(x, w.input_norm, self.eps)
            qkv = F.linear(h, w.qkv_w, w.qkv_b)
            q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
            q = q.view(T, H, D)
            k = k.view(T, Hkv, D)
            v = v.view(T, Hkv, D)
            if w.q_norm is not None and w.k_norm is not None:
                q = rms_norm(q, w.q_norm, self.eps)
                k = rms_norm(k, w.k_norm, self.eps)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            attention.write(i, k, v, md)
            if on_layer is not None:
                on_layer(i)  # layer i's KV of this step is in the cache: it may be sent now
            a = attention.forward(i, q, k, v, md)
            x = x + F.linear(a.reshape(T, H * D), w.o_w, w.o_b)
            h = rms_norm(x, w.post_norm, self.eps)
            gate, up = F.linear(h, w.gate_up_w).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, w.down_w)
        return x

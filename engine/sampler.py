"""Token sampling: greedy, temperature, top-k, top-p, min-p, per-request generators, logprobs.

A request's random draws come only from its own generator, one fixed-size draw per sampled token,
so with a seed its tokens depend on the seed and its own logits, not on the batch around it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from engine.outputs import TokenLogprobs
from engine.sampling_params import SamplingParams


def _filter(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Apply temperature and the top-k / top-p / min-p filters to one row of float32 logits."""
    logits = logits / sp.temperature
    if sp.top_k > 0 and sp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sp.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= sp.top_p
        # The first stays explicitly too: where the CPU flushes denormals (as it does after a
        # model forward here), a denormal top_p reads as 0 and would drop every token (NaN row).
        drop[0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(0, idx, sorted_logits)
    if sp.min_p > 0.0:
        probs = logits.softmax(-1)
        logits = logits.masked_fill(probs < sp.min_p * probs.max(), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Sample one token per row of `logits` [N, V]."""
    logits = logits.float()
    greedy_ids = logits.argmax(dim=-1).tolist()
    tokens: list[int] = []
    for i, sp in enumerate(params):
        if sp.greedy:
            tokens.append(greedy_ids[i])
            continue
        probs = _filter(logits[i], sp).softmax(-1)
        # Exponential race (Gumbel-max in another form): argmax p / E with E ~ Exp(1).
        noise = torch.empty_like(probs).exponential_(generator=generators[i])
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # a 0 draw would give 0/0 = NaN
        tokens.append(int(torch.argmax(probs / noise)))
    lps: list[TokenLogprobs | None] = [None] * len(params)
    want = [i for i, sp in enumerate(params) if sp.logprobs is not None]
    if want:
        logp = torch.log_softmax(logits[want], dim=-1)
        for j, i in enumerate(want):
            n = params[i].logprobs or 0
            top: tuple[tuple[int, float], ...] = ()
            if n:
                vals, ids = torch.topk(logp[j], n)
                top = tuple(zip(ids.tolist(), vals.tolist()))
            lps[i] = TokenLogprobs(tokens[i], float(logp[j, tokens[i]]), top)
    return tokens, lps

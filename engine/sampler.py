"""Token sampling: penalties, greedy, temperature, top-k, top-p, min-p, per-request generators,
logprobs.

A request's random draws come only from its own generator, one fixed-size draw per sampled token,
the generator seeded for each sample from the request's seed and the sample's number
(`sample_seed`): with a seed, its tokens depend on the seed and its own logits, not on the batch
around it, and a request that goes on elsewhere (a handoff's first token, a resume after its
worker left) takes up its draws at the next sample's number, at no cost.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine.outputs import ScheduledRequest
from engine.penalties import bias_, penalize_
from engine.sampling_params import SamplingParams
from engine.seen import Seen
from engine.token_logprobs import TokenLogprobs

FilterKey = tuple[float, int, float, float]  # temperature, top_k, top_p, min_p

_MASK = (1 << 64) - 1
PROMPT_LOGPROB_ROWS = 256  # prompt positions whose logprobs are computed at once


def sample_seed(seed: int, k: int) -> int:
    """The seed of a request's sample number `k` (from 0): splitmix64's finalizer over
    seed + (k + 1) x the golden ratio, so that nearby seeds and numbers give unrelated streams."""
    z = (seed + (k + 1) * 0x9E3779B97F4A7C15) & _MASK
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


@dataclass(slots=True)
class Draws:
    """A sampling request's generator, its seed, and how many samples it has drawn (here, or
    before elsewhere: SamplingParams.drawn, the prefill side's first token)."""

    generator: torch.Generator
    seed: int
    drawn: int = 0


def _filter(logits: torch.Tensor, key: FilterKey) -> torch.Tensor:
    """Apply temperature and the top-k / top-p / min-p filters to rows [m, V] of float32 logits
    that share one setting. Row by row the same as filtering each row alone."""
    temperature, top_k, top_p, min_p = key
    logits = logits / temperature
    if top_k > 0 and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, idx = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the mass before it already reaches top_p (the first always stays).
        drop = (probs.cumsum(-1) - probs) >= top_p
        # The first stays explicitly too: where the CPU flushes denormals (as it does after a
        # model forward here), a denormal top_p reads as 0 and would drop every token (NaN row).
        drop[:, 0] = False
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.empty_like(logits).scatter_(-1, idx, sorted_logits)
    if min_p > 0.0:
        probs = logits.softmax(-1)
        top = probs.max(dim=-1, keepdim=True).values
        logits = logits.masked_fill(probs < min_p * top, float("-inf"))
    return logits


def _rows(t: torch.Tensor, idx: list[int]) -> torch.Tensor:
    return t if len(idx) == t.shape[0] else t[idx]


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    seen: Sequence[Seen | None] = (),
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Sample one token per row of `logits` [N, V], on their device; the ids (and logprobs)
    come back to the host in one copy at the end. `seen` (by row; empty: none) holds what each
    penalized row's request has seen (engine/penalties.py): their rows of `logits` are penalized
    in place, as are the rows of requests with a logit_bias. Logprobs are the model's, before
    penalties and biases."""
    raw = logits = logits.float()
    penalized = [(i, params[i], s) for i, s in enumerate(seen) if s is not None]
    biased = [(i, sp) for i, sp in enumerate(params) if sp.logit_bias]
    if penalized or biased:
        if any(sp.logprobs is not None for sp in params):
            logits = logits.clone()
        penalize_(logits, penalized)
        bias_(logits, biased)
    tokens = logits.argmax(dim=-1)  # greedy rows keep these
    groups: dict[FilterKey, list[int]] = {}
    for i, sp in enumerate(params):
        if not sp.greedy:
            groups.setdefault((sp.temperature, sp.top_k, sp.top_p, sp.min_p), []).append(i)
    for key, idx in groups.items():
        probs = _filter(_rows(logits, idx), key).softmax(-1)
        # Exponential race (Gumbel-max in another form): argmax p / E with E ~ Exp(1), each
        # row's draw from its own request's generator, one vocabulary-sized draw per token.
        noise = torch.empty_like(probs)
        for j, i in enumerate(idx):
            noise[j].exponential_(generator=generators[i])
        noise.clamp_min_(torch.finfo(noise.dtype).tiny)  # a 0 draw would give 0/0 = NaN
        chosen = torch.argmax(probs / noise, dim=-1)
        if len(idx) == tokens.shape[0]:
            tokens = chosen
        else:
            tokens[idx] = chosen
    want = [i for i, sp in enumerate(params) if sp.logprobs is not None]
    if not want:
        return tokens.tolist(), [None] * len(params)
    return _with_logprobs(raw, tokens, params, want)


def _with_logprobs(
    logits: torch.Tensor, tokens: torch.Tensor, params: Sequence[SamplingParams], want: list[int]
) -> tuple[list[int], list[TokenLogprobs | None]]:
    """Tokens plus the chosen and top-n logprobs of the rows in `want`, packed into one float64
    tensor so that a single copy brings them all back (ids are exact in float64)."""
    logp = torch.log_softmax(_rows(logits, want), dim=-1)
    chosen = logp.gather(1, _rows(tokens, want).unsqueeze(1)).squeeze(1)
    n_top = max(params[i].logprobs or 0 for i in want)
    parts = [tokens.double(), chosen.double()]
    if n_top:
        vals, ids = torch.topk(logp, n_top, dim=-1)
        parts += [ids.double().flatten(), vals.double().flatten()]
    packed = torch.cat(parts).tolist()
    n, m = len(params), len(want)
    ids_out = [int(t) for t in packed[:n]]
    top_ids, top_vals = packed[n + m : n + m + m * n_top], packed[n + m + m * n_top :]
    lps: list[TokenLogprobs | None] = [None] * n
    for j, i in enumerate(want):
        k = params[i].logprobs or 0
        top = tuple(
            (int(t), v)
            for t, v in zip(top_ids[j * n_top : j * n_top + k], top_vals[j * n_top : j * n_top + k])
        )
        lps[i] = TokenLogprobs(ids_out[i], packed[n + j], top)
    return ids_out, lps


def prompt_logprobs(
    logits_of: Callable[[int, int], torch.Tensor], owners: Sequence[tuple[ScheduledRequest, int]]
) -> tuple[tuple[str, tuple[TokenLogprobs, ...]], ...]:
    """The prompt logprobs of a step's prompt rows (the model's, before penalties and biases),
    taken in order by `owners` (a request and its count of rows): each row's log-probability
    of the prompt token that follows it (the request's prompt_targets) and its top
    sampling.prompt_logprobs alternatives, brought back in one copy. `logits_of(a, b)` gives
    rows a..b-1's logits; they are asked for PROMPT_LOGPROB_ROWS at a time, so that a long
    chunk's logits are never all held at once."""
    targets = [t for s, _ in owners for t in s.prompt_targets]
    m = len(targets)
    n_top = max(s.sampling.prompt_logprobs or 0 for s, _ in owners)
    chosen, top_ids, top_vals = [], [], []
    for a in range(0, m, PROMPT_LOGPROB_ROWS):
        b = min(m, a + PROMPT_LOGPROB_ROWS)
        logp = torch.log_softmax(logits_of(a, b).float(), dim=-1)
        ids = torch.tensor(targets[a:b], dtype=torch.long).to(logp.device, non_blocking=True)
        chosen.append(logp.gather(1, ids.unsqueeze(1)).squeeze(1))
        if n_top:
            vals, tops = torch.topk(logp, n_top, dim=-1)
            top_ids.append(tops.flatten())
            top_vals.append(vals.flatten())
    packed = torch.cat([t.double() for t in (*chosen, *top_ids, *top_vals)]).tolist()
    out: list[tuple[str, tuple[TokenLogprobs, ...]]] = []
    row = 0
    for s, count in owners:
        k = s.sampling.prompt_logprobs or 0
        lps = []
        for j in range(row, row + count):
            at, vat = m + j * n_top, m + m * n_top + j * n_top
            top = tuple((int(t), v) for t, v in zip(packed[at : at + k], packed[vat : vat + k]))
            lps.append(TokenLogprobs(targets[j], packed[j], top))
        out.append((s.request_id, tuple(lps)))
        row += count
    return tuple(out)

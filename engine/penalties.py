"""Repetition, presence and frequency penalties, then logit biases: a sampled row's logits
changed by the tokens its request has seen and the biases it asked for, before temperature and
the filters (greedy rows too).

- repetition_penalty r (as transformers' and vLLM's): each token of the prompt or the output so
  far has its logit divided by r where positive, multiplied by r where not;
- presence_penalty p and frequency_penalty f (as OpenAI's API): each token of the output so far
  has p + f x (its count there) subtracted from its logit.

Only penalized requests pay. Each keeps its tokens as int64 (Request.seen_ids, extended by the
tokens new since its last step); a step's penalized rows go to the device in one copy and are
changed by a few elementwise ops over all their tokens together.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from typing import NamedTuple

import torch

from engine.request import Request
from engine.sampling_params import SamplingParams


class Seen(NamedTuple):
    """What a penalized request's next sample is penalized by."""

    token_ids: array[int]  # its prompt, then its output so far (int64; only grows)
    length: int  # how many of token_ids it has seen at this step
    outputs_from: int  # where its output starts (a resumed one's earlier output is in its prompt)


def seen(req: Request) -> Seen:
    """The request's Seen at this step. Its last `sampling.drawn` prompt tokens are output drawn
    elsewhere (a resume's)."""
    buf = req.seen_ids
    if buf is None:
        buf = req.seen_ids = array("q", req.token_ids)
    elif len(buf) < len(req.token_ids):
        buf.extend(req.token_ids[len(buf) :])
    return Seen(buf, len(buf), max(0, req.num_prompt_tokens - req.sampling.drawn))


@torch.inference_mode()  # the model's logits are inference tensors: changed in place only here
def penalize_(logits: torch.Tensor, rows: Sequence[tuple[int, SamplingParams, Seen]]) -> None:
    """Penalize each listed row (index, its params, what it has seen) of `logits` [N, V]
    (float32), in place. Row by row the same as penalizing each alone. A token seen n times is
    gathered and written n times: the repetition and presence penalties write one value n
    times, the frequency penalty adds the same value n times (the same sum in any order)."""
    rows = [r for r in rows if r[2].length]
    if not rows:
        return
    ids_host, starts = array("q"), []
    for _, _, s in rows:
        starts.append(len(ids_host))
        ids_host.extend(s.token_ids[: s.length])
    dev = logits.device
    ids = torch.frombuffer(ids_host, dtype=torch.int64).to(dev)
    lengths = torch.tensor([s.length for _, _, s in rows], device=dev)

    def each(values: list[float] | list[int]) -> torch.Tensor:  # a row's value at its tokens
        return torch.tensor(values, device=dev).repeat_interleave(lengths)

    where = (each([i for i, _, _ in rows]), ids)  # (row, token) of every token seen
    vals = logits[where]
    r = each([sp.repetition_penalty for _, sp, _ in rows])
    logits[where] = torch.where(vals > 0, vals / r, vals * r)  # r = 1: unchanged
    # A token is output where its place in its row is at or past the row's outputs_from.
    place = torch.arange(len(ids), device=dev) - each(starts)
    out = place >= each([s.outputs_from for _, _, s in rows])
    where = (where[0][out], where[1][out])
    freq = each([-sp.frequency_penalty for _, sp, _ in rows])[out]
    logits.index_put_(where, freq, accumulate=True)  # f = 0: unchanged
    logits[where] = logits[where] - each([sp.presence_penalty for _, sp, _ in rows])[out]


@torch.inference_mode()
def bias_(logits: torch.Tensor, rows: Sequence[tuple[int, SamplingParams]]) -> None:
    """Add each listed row's logit_bias to its tokens' logits [N, V], in place (each token
    once: SamplingParams names each once)."""
    pairs = [(i, t, b) for i, sp in rows for t, b in sp.logit_bias]
    if not pairs:
        return
    row, ids, bias = zip(*pairs, strict=True)
    dev = logits.device
    where = (torch.tensor(row, device=dev), torch.tensor(ids, device=dev))
    logits[where] = logits[where] + torch.tensor(bias, dtype=logits.dtype, device=dev)

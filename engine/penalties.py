"""Repetition, presence and frequency penalties, then logit biases: a sampled row's logits
changed by the tokens its request has seen and the biases it asked for, before temperature and
the filters (greedy rows too).

- repetition_penalty r (as transformers' and vLLM's): each token of the prompt or the output so
  far has its logit divided by r where positive, multiplied by r where not;
- presence_penalty p and frequency_penalty f (as OpenAI's API): each token of the output so far
  has p + f x (its count there) subtracted from its logit;
- logit_bias: added to the logits of the tokens it names.

Only steps with a penalized or biased row pay. The indices and values are built on the host
(each penalized request keeps its tokens as int64: engine/seen.py) and reach the device in one
copy of integers and one of floats; then a few indexed ops over all the rows' tokens together.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence

import torch

from engine.sampling_params import SamplingParams
from engine.seen import Seen


@torch.inference_mode()  # the model's logits are inference tensors: changed in place only here
def penalize_(logits: torch.Tensor, rows: Sequence[tuple[int, SamplingParams, Seen]]) -> None:
    """Penalize each listed row (index, its params, what it has seen) of `logits` [N, V]
    (float32), in place. Row by row the same as penalizing each alone. A token seen n times is
    gathered and written n times: the repetition and presence penalties write one value n
    times, the frequency penalty adds the same value n times (the same sum in any order)."""
    rows = [r for r in rows if r[2].length]
    if not rows:
        return
    ids_host = array("q")
    for _, _, s in rows:
        ids_host.extend(s.token_ids if len(s.token_ids) == s.length else s.token_ids[: s.length])
    ids = torch.frombuffer(ids_host, dtype=torch.int64)
    lengths = torch.tensor([s.length for _, _, s in rows])

    def each(values: list[float]) -> torch.Tensor:  # a row's value at each of its tokens
        return torch.tensor(values).repeat_interleave(lengths)

    row = torch.tensor([i for i, _, _ in rows]).repeat_interleave(lengths)
    # A token is output where its place in its row is at or past the row's outputs_from.
    place = torch.arange(len(ids)) - (lengths.cumsum(0) - lengths).repeat_interleave(lengths)
    out = place >= each([s.outputs_from for _, _, s in rows])
    ints = torch.cat([row, ids, row[out], ids[out]])
    floats = torch.cat([
        each([sp.repetition_penalty for _, sp, _ in rows]),
        each([-sp.frequency_penalty for _, sp, _ in rows])[out],
        each([sp.presence_penalty for _, sp, _ in rows])[out],
    ])  # fmt: skip
    n, m = len(ids), int(out.sum())
    row_d, ids_d, row_out, ids_out = ints.to(logits.device).split([n, n, m, m])
    r, f, p = floats.to(logits.device, logits.dtype).split([n, m, m])
    where = (row_d, ids_d)  # (row, token) of every token seen
    vals = logits[where]
    logits[where] = torch.where(vals > 0, vals / r, vals * r)  # r = 1: unchanged
    where = (row_out, ids_out)
    logits.index_put_(where, f, accumulate=True)  # f = 0: unchanged
    logits[where] = logits[where] - p


@torch.inference_mode()
def bias_(logits: torch.Tensor, rows: Sequence[tuple[int, SamplingParams]]) -> None:
    """Add each listed row's logit_bias to its tokens' logits [N, V], in place (each token
    once: SamplingParams names each once)."""
    pairs = [(i, t, b) for i, sp in rows for t, b in sp.logit_bias]
    if not pairs:
        return
    row, ids, bias = zip(*pairs, strict=True)
    dev = logits.device
    where = (torch.tensor([row, ids]).to(dev)).unbind(0)
    logits[where] = logits[where] + torch.tensor(bias).to(dev, logits.dtype)

"""A token's logprob and its top alternatives: what the sampler gives per sampled token and per
prompt token, and every layer above carries as it is."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class TokenLogprobs:
    """The chosen token's logprob and the top-n alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()

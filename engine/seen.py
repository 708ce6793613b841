"""What a penalized request's next sample is penalized by (engine/penalties.py): its tokens so far
as int64, kept on the request (Request.seen_ids) and extended by the tokens new since its last
step. The scheduler builds it for each penalized request that samples in a step."""

from __future__ import annotations

from array import array
from typing import NamedTuple

from engine.request import Request


class Seen(NamedTuple):
    """A penalized request's tokens at one step. `token_ids` is the request's own buffer, which
    only grows: the step that scheduled it reads its first `length` (all it had then)."""

    token_ids: array[int]  # its prompt, then its output so far (int64)
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

"""Per-request sampling parameters, validated when built."""

from __future__ import annotations

import math
import numbers
import operator
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from engine.errors import InvalidRequestError

_MIN_TEMPERATURE = 1e-5
_SEED_LIMIT = 1 << 64  # it seeds a torch.Generator, which takes 64 bits
_PENALTY_LIMIT = 2.0  # presence and frequency penalties, as OpenAI's API bounds them
_BIAS_LIMIT = 100.0  # a logit bias, as OpenAI's API bounds it
MAX_LOGIT_BIAS = 300  # tokens one request may bias, as OpenAI's API bounds it
# Stop strings one request may give (OpenAI's API: 4): each is looked for in the new text at
# every step, on the engine's thread, beside every other request's step.
MAX_STOP_STRINGS = 64
# Why a reservation for a prompt's KV computed elsewhere refuses prompt logprobs (the engine
# computes no prompt there), naming the field.
PROMPT_LOGPROBS_LOCAL = (
    "are computed where the prompt is prefilled: not for a prompt whose KV comes from elsewhere"
)


def as_int(x: object) -> int | None:
    """`x` as an int where it is an integer (numpy's and an integer tensor's too), never a
    bool; None where it is not (int() would take 5.7 as 5 and "5" as 5)."""
    if isinstance(x, bool):
        return None
    try:
        return operator.index(x)  # type: ignore[arg-type]
    except TypeError:
        return None


def _is_int(x: object) -> bool:
    return as_int(x) is not None


def is_seed(x: object) -> bool:
    """What seeds a torch.Generator: an integer in [0, 2**64)."""
    value = as_int(x)
    return value is not None and 0 <= value < _SEED_LIMIT


def _is_number(x: object) -> bool:
    """A real number (numpy's too), not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request samples and when it stops.

    temperature 0 (or below 1e-5) means greedy. top_k 0 (or -1) disables top-k; top_p 1 and
    min_p 0 disable theirs. A seed makes the request's samples depend only on the seed and its
    own logits, whatever batch it shares a step with.

    Penalties change the logits before all of that, greedy too (engine/penalties.py):
    repetition_penalty (1: off) divides a positive logit, multiplies a negative one, of every
    token in the prompt or the output so far; presence_penalty is subtracted once from each
    token in the output so far, frequency_penalty once per time it occurs there (0: off);
    then logit_bias adds to the logits of the tokens it names.
    """

    max_tokens: int = 256
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top logprobs to return per token, besides the chosen
    # Each prompt token's logprob given the tokens before it, with this many top alternatives,
    # given with the first output (the first prompt token has none). The prompt is computed
    # for it: no prefix-cache hit past the positions it has them for (none until a preemption).
    prompt_logprobs: int | None = None
    include_stop_str_in_output: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # (token id, bias) pairs added to those tokens' logits after the penalties (OpenAI's
    # logit_bias: -100 all but bans a token, 100 all but forces it).
    logit_bias: tuple[tuple[int, float], ...] = ()  # sorted by token id
    penalized: bool = field(init=False, repr=False, compare=False)  # set in __post_init__
    # Samples of this request drawn elsewhere before (its tokens so far, where it resumes on
    # another worker): its draws start at the next sample's number (engine/sampler.py), so that
    # a seed gives the same tokens; and the last `drawn` tokens of its prompt are outputs, which
    # presence and frequency penalties count.
    drawn: int = 0

    def __post_init__(self) -> None:
        # A lone string or id is a common slip; take it as a one-element list, and store tuples
        # so the params stay hashable and immutable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        if _is_int(self.stop_token_ids):
            object.__setattr__(self, "stop_token_ids", (self.stop_token_ids,))
        if not isinstance(self.stop, (tuple, list)):
            raise InvalidRequestError("stop", f"must be a list of strings, got {self.stop!r}")
        if isinstance(self.stop_token_ids, (str, bytes)) or not isinstance(
            self.stop_token_ids, Iterable
        ):
            raise InvalidRequestError(
                "stop_token_ids", f"must be a list of integers, got {self.stop_token_ids!r}"
            )
        object.__setattr__(self, "stop", tuple(self.stop))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids))
        self._check_types()
        if self.seed is not None and as_int(self.seed) == -1:  # vLLM's (and clients'): random
            object.__setattr__(self, "seed", None)
        if self.max_tokens < 1:
            raise InvalidRequestError(
                "max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}"
            )
        if not 0.0 <= self.temperature < math.inf:  # also rejects NaN
            raise InvalidRequestError(
                "temperature", f"must be finite and >= 0, got {self.temperature!r}"
            )
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidRequestError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if self.top_k < -1:
            raise InvalidRequestError(
                "top_k", f"must be -1 or 0 (disabled) or a positive integer, got {self.top_k!r}"
            )
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidRequestError("min_p", f"must be in [0, 1], got {self.min_p!r}")
        if self.seed is not None and not is_seed(self.seed):
            raise InvalidRequestError(
                "seed", f"must be an integer in [0, 2**64), got {self.seed!r}"
            )
        if any((not isinstance(s, str)) or s == "" for s in self.stop):
            raise InvalidRequestError("stop", "every stop string must be a non-empty string")
        if len(self.stop) > MAX_STOP_STRINGS:
            raise InvalidRequestError(
                "stop", f"has {len(self.stop)} strings; at most {MAX_STOP_STRINGS}"
            )
        if any(not _is_int(t) or t < 0 for t in self.stop_token_ids):
            raise InvalidRequestError(
                "stop_token_ids", "every stop token id must be an integer >= 0"
            )
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.drawn < 0:
            raise InvalidRequestError("drawn", f"must be an integer >= 0, got {self.drawn!r}")
        for name in ("presence_penalty", "frequency_penalty"):
            v = getattr(self, name)
            if not -_PENALTY_LIMIT <= v <= _PENALTY_LIMIT:  # also rejects NaN
                raise InvalidRequestError(name, f"must be in [-2, 2], got {v!r}")
        if not 0.0 < self.repetition_penalty < math.inf:
            raise InvalidRequestError(
                "repetition_penalty",
                f"must be finite and > 0 (1: off), got {self.repetition_penalty!r}",
            )
        self._check_logit_bias()
        for name in ("logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is not None and not 0 <= v <= 20:
                raise InvalidRequestError(name, f"must be in [0, 20], got {v!r}")
        # Whether its sampled rows depend on the tokens it has seen (read every step).
        penalized = self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
        object.__setattr__(self, "penalized", bool(penalized))

    def _check_types(self) -> None:
        """Each field of its type (a bool is neither an integer nor a number here: True as
        top_k would reach torch.topk), named where it is not; numpy's numbers are taken as
        Python's."""
        for name in ("max_tokens", "top_k", "drawn", "seed", "logprobs", "prompt_logprobs"):
            v = getattr(self, name)
            if v is None and name in ("seed", "logprobs", "prompt_logprobs"):
                continue
            if not _is_int(v):
                raise InvalidRequestError(name, f"must be an integer, got {v!r}")
            object.__setattr__(self, name, int(v))
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
        ):
            v = getattr(self, name)
            try:
                if not _is_number(v):
                    raise TypeError
                object.__setattr__(self, name, float(v))
            except (TypeError, OverflowError):
                raise InvalidRequestError(name, f"must be a number, got {v!r}") from None
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise InvalidRequestError(
                    name, f"must be true or false, got {getattr(self, name)!r}"
                )

    def _check_logit_bias(self) -> None:
        given: Any = self.logit_bias
        if isinstance(given, dict):  # the engine API's users may give one
            given = given.items()
        try:
            pairs: tuple[Any, ...] = tuple(tuple(p) for p in given)
        except TypeError:
            raise InvalidRequestError(
                "logit_bias", f"must be (token id, bias) pairs or a dict, got {given!r}"
            ) from None
        if len(pairs) > MAX_LOGIT_BIAS:
            raise InvalidRequestError(
                "logit_bias", f"names {len(pairs)} tokens; at most {MAX_LOGIT_BIAS}"
            )
        if any(len(p) != 2 for p in pairs):
            raise InvalidRequestError("logit_bias", "must be (token id, bias) pairs")
        ids = [t for t, _ in pairs]
        if any(not _is_int(t) or t < 0 for t in ids) or len(set(ids)) < len(ids):
            raise InvalidRequestError(
                "logit_bias", "every token id must be an integer >= 0, each named once"
            )
        for _, b in pairs:
            if not (_is_number(b) and -_BIAS_LIMIT <= b <= _BIAS_LIMIT):  # also rejects NaN
                raise InvalidRequestError(
                    "logit_bias", f"every bias must be a number in [-100, 100], got {b!r}"
                )
        object.__setattr__(self, "logit_bias", tuple(sorted((int(t), float(b)) for t, b in pairs)))

    @property
    def greedy(self) -> bool:
        # Below this, logits / temperature overflows float32; the distribution is an argmax.
        return self.temperature < _MIN_TEMPERATURE

"""LLMEngine: the one-device engine API (add_request, abort, step, generate).

One step is: schedule -> execute on the runner -> update request state -> detokenize and apply stop
strings. Bad requests are refused at `add_request` with an InvalidRequestError naming the field;
nothing already running is disturbed by them.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from engine import kv_handoff
from engine.block_pool import PrefixCacheStats
from engine.chat_template import chat_token_ids
from engine.config import EngineConfig
from engine.errors import InvalidRequestError
from engine.kv_cache_manager import KVCacheManager, cdiv
from engine.loader import LoadedModel, load_model
from engine.model_runner import ModelRunner
from engine.output_processor import OutputProcessor
from engine.outputs import RequestOutput, SchedulerOutput
from engine.request import FinishReason, Request
from engine.sampling_params import PROMPT_LOGPROBS_LOCAL, SamplingParams, as_int
from engine.scheduler import Scheduler
from engine.step_stats import StepRecorder
from engine.token_logprobs import TokenLogprobs


@dataclass(frozen=True, slots=True)
class Completion:
    """A finished request as `generate` returns it."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    text: str
    finish_reason: FinishReason | None
    stop_reason: int | str | None
    logprobs: tuple[TokenLogprobs, ...]
    num_cached_tokens: int
    # With SamplingParams.prompt_logprobs: one per prompt token after the first.
    prompt_logprobs: tuple[TokenLogprobs, ...] = ()


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None) -> None:
        if config.model.num_threads is not None:
            torch.set_num_threads(config.model.num_threads)
        self.config = config
        self.loaded = loaded or load_model(config.model)
        self.tokenizer = self.loaded.tokenizer
        limit = config.model.max_model_len
        self.max_model_len = min(self.loaded.max_model_len, limit or self.loaded.max_model_len)
        self.runner = ModelRunner(self.loaded.hf_model, config)
        self.vocab_size = self.runner.model.vocab_size
        self.kv = KVCacheManager(
            self.runner.num_blocks, config.cache.block_size, config.cache.enable_prefix_caching
        )
        self.scheduler = Scheduler(config.scheduler, self.kv)
        self.eos_token_ids = self._eos_ids()
        self.outputs = OutputProcessor(self.tokenizer, self.scheduler, config.detokenize)
        self._ids = itertools.count()
        self.step_stats = StepRecorder()
        self.last_step_empty = False  # the last step ran nothing (see step())

    def _eos_ids(self) -> frozenset[int]:
        ids: set[int] = set()
        gen = getattr(self.loaded.hf_model, "generation_config", None)
        eos = getattr(gen, "eos_token_id", None) if gen is not None else None
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)

    # -- requests -----------------------------------------------------------------------------
    def encode(self, prompt: str, chat: bool = False) -> list[int]:
        if chat:
            return chat_token_ids(self.tokenizer, [{"role": "user", "content": prompt}], "chat")
        return [int(t) for t in self.tokenizer.encode(prompt)]

    def validate_prompt(self, token_ids: Sequence[int]) -> None:
        n = len(token_ids)
        if n == 0:
            raise InvalidRequestError("prompt", "must not be empty (at least 1 token)")
        if n >= self.max_model_len:
            raise InvalidRequestError(
                "prompt",
                f"has {n} tokens; it must be at most {self.max_model_len - 1} tokens "
                f"(the model's context is {self.max_model_len})",
            )
        bad = next((t for t in token_ids if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                "prompt_token_ids", f"token id {bad} is outside [0, {self.vocab_size})"
            )
        need = cdiv(n + 1, self.config.cache.block_size)
        if need > self.runner.num_blocks:
            raise InvalidRequestError(
                "prompt", f"needs {need} KV blocks; the cache holds {self.runner.num_blocks}"
            )

    def _new_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None,
        request_id: str | None,
        arrival_time: float | None,
        prefill_hold_s: float | None = None,
    ) -> Request:
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(
                "sampling_params", f"a SamplingParams is expected, got {type(params).__name__}"
            )
        if prefill_hold_s is not None and not 0.0 <= prefill_hold_s < float("inf"):
            raise InvalidRequestError(
                "prefill_hold_s", f"must be finite and >= 0 (or None), got {prefill_hold_s}"
            )
        token_ids = self.encode(prompt) if isinstance(prompt, str) else _token_ids(prompt)
        self.validate_prompt(token_ids)
        bad = next((t for t, _ in params.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                "logit_bias", f"token id {bad} is outside [0, {self.vocab_size})"
            )
        rid = request_id if request_id is not None else f"req-{next(self._ids)}"
        if rid in self.outputs or rid in self.scheduler.held:
            raise InvalidRequestError("request_id", f"{rid!r} is already in use")
        return Request(
            request_id=rid,
            prompt_token_ids=token_ids,
            sampling=params,
            arrival_time=time.monotonic() if arrival_time is None else arrival_time,
            eos_token_ids=self.eos_token_ids,
            max_model_len=self.max_model_len,
            prefill_hold_s=prefill_hold_s,
        )

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        hold_blocks: bool = False,
        *,
        prefill_hold_s: float | None = None,
    ) -> str:
        """Queue a request. With `hold_blocks` (prefill role) its blocks outlive its end, until
        `release_blocks`, so its KV can still be sent. `prefill_hold_s`: the most its prompt may
        wait for running decodes (Request.prefill_hold_s; None: the scheduler's own)."""
        req = self._new_request(prompt, params, request_id, arrival_time, prefill_hold_s)
        req.hold_blocks_on_finish = hold_blocks
        self.scheduler.add_request(req)
        self.outputs.open(req)
        return req.request_id

    # -- disaggregated handoff (see kv_handoff.py) ----------------------------------------------
    def reserve_for_kv(
        self,
        prompt: Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        share: float = 1.0,
        due_in_s: float = 0.0,
        *,
        prefill_hold_s: float | None = None,
    ) -> kv_handoff.KVReservation | None:
        """Decode side: reserve blocks for a prompt whose KV will arrive, expected no sooner than
        `due_in_s` from now; None if full now, or if reservations would hold more than `share`
        of the slots or blocks (kv_handoff). `prefill_hold_s`: as for add_request, should the
        prompt be prefilled here after all (its KV never came)."""
        if params is not None and params.prompt_logprobs is not None:
            raise InvalidRequestError("prompt_logprobs", PROMPT_LOGPROBS_LOCAL)
        req = self._new_request(prompt, params, request_id, arrival_time, prefill_hold_s)
        res = kv_handoff.reserve(self.scheduler, req, share, due_in_s)
        if res is not None:
            self.outputs.open(req)
        return res

    def kv_arrived(
        self, request_id: str, first_token: int, logprobs: TokenLogprobs | None = None
    ) -> RequestOutput:
        """Decode side: the KV is in place; returns the output carrying the first token."""
        req = kv_handoff.complete(self.scheduler, request_id, first_token)
        # The prefill side drew once from this seed for the first token; draw past it here so
        # seeded requests give the same tokens on either path.
        self.runner.skip_draws(request_id, req.sampling, 1)
        return self.outputs.emit(req, logprobs)

    def kv_failed(self, request_id: str) -> None:
        """Decode side: the transfer failed; the prompt is recomputed here."""
        kv_handoff.fail(self.scheduler, request_id)

    def held_block_ids(self, request_id: str) -> tuple[int, ...]:
        """Prefill side: the blocks a finished, held request keeps for its send."""
        return tuple(self.scheduler.held[request_id].block_ids)

    def release_blocks(self, request_id: str) -> bool:
        """Prefill side: the send has ended (done or failed); free the held blocks."""
        return self.scheduler.release_held(request_id)

    def abort(self, request_ids: str | Sequence[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        self.scheduler.finish_requests(ids, FinishReason.ABORT)
        for rid in ids:
            self.outputs.close(rid)
            self.scheduler.release_held(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    def reset_totals(self) -> None:
        """Count from zero again: the seconds spent in steps (and the steps kept for reading),
        the prefix cache's lookups and hits, preemptions and steps held for decodes. A worker
        does so after its warm-up, so that what it reports counts serving alone."""
        self.step_stats.reset()
        self.kv.pool.stats = PrefixCacheStats()
        self.scheduler.num_preemptions = 0
        self.scheduler.prompt_hold.steps = 0

    # -- stepping -----------------------------------------------------------------------------
    def step(
        self,
        on_layer: Callable[[int, SchedulerOutput], None] | None = None,
        wants_layers: Callable[[SchedulerOutput], bool] | None = None,
    ) -> list[RequestOutput]:
        """One engine step. `on_layer(i, schedule)` fires as each layer's new KV lands in the
        cache (a worker prefilling for a peer streams KV layer by layer with it); with
        `wants_layers`, only in steps it says need it (the others may replay a decode graph)."""
        so = self.scheduler.schedule()
        self.last_step_empty = so.is_empty  # nothing could run (waiting for blocks or a hold)
        hook = None
        if on_layer is not None and (wants_layers is None or wants_layers(so)):
            hook = lambda i: on_layer(i, so)  # noqa: E731
        t0 = time.perf_counter()
        result = self.runner.execute(so, hook)
        if not so.is_empty:
            stat = self.step_stats.record(so, time.perf_counter() - t0)
            self.scheduler.observe_step(stat.prefill_tokens, stat.decode_seqs, stat.seconds)
        for rid, lps in result.prompt_logprobs:
            req = self.scheduler.requests.get(rid)
            if req is not None:  # else ended (aborted) after it was scheduled
                req.prompt_logprobs.extend(lps)
        touched = self.scheduler.update_from_output(so, result)
        lp_by_id = dict(zip(result.request_ids, result.logprobs)) if result.logprobs else {}
        outs = []
        for req in touched:
            outs.append(self.outputs.emit(req, lp_by_id.get(req.request_id)))
        # A request that outgrew the whole pool ends inside schedule() without a new token; it
        # must still be reported finished, or its caller waits forever and its stream leaks.
        for req in self.scheduler.take_capacity_finished():
            if req.request_id in self.outputs:
                outs.append(self.outputs.emit(req, None))
        return outs

    def generate(
        self,
        prompts: Sequence[str | Sequence[int]],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[Completion]:
        """Run prompts to completion offline; results in the order of `prompts` (a string
        alone is one prompt)."""
        if isinstance(prompts, str):
            prompts = [prompts]
        for i, p in enumerate(prompts):
            if not isinstance(p, str) and not hasattr(p, "__len__"):
                raise InvalidRequestError(
                    "prompts",
                    f"a list of prompts, each a string or a list of token ids; item {i} is "
                    f"{type(p).__name__} {p!r} (one prompt of token ids: pass [ids])",
                )
        plist = (
            params if isinstance(params, Sequence) else [params or SamplingParams()] * len(prompts)
        )
        if len(plist) != len(prompts):
            raise InvalidRequestError("params", f"{len(plist)} given for {len(prompts)} prompts")
        if self.has_unfinished_requests():
            # generate() drives the engine to idle; it would swallow other callers' outputs.
            raise RuntimeError("generate() needs an idle engine; use add_request/step instead")
        rids: list[str] = []
        try:
            for p, sp in zip(prompts, plist):
                rids.append(self.add_request(p, sp))
        except InvalidRequestError as exc:
            self.abort(rids)  # all or nothing: a refused prompt leaves no earlier one queued
            if len(prompts) == 1:
                raise
            which = f"(prompt {len(rids) + 1} of {len(prompts)})"
            raise InvalidRequestError(exc.field, f"{exc.message} {which}") from None
        prompt_ids = {r: tuple(self.scheduler.requests[r].prompt_token_ids) for r in rids}
        acc: dict[str, list[RequestOutput]] = {r: [] for r in rids}
        try:
            while self.has_unfinished_requests():
                for out in self.step():
                    acc[out.request_id].append(out)
        except BaseException:
            self.abort(rids)  # a failed step leaves no request holding blocks
            raise
        results = []
        for rid in rids:
            outs = acc[rid]
            last = outs[-1]
            results.append(
                Completion(
                    request_id=rid,
                    prompt_token_ids=prompt_ids[rid],
                    token_ids=tuple(t for o in outs for t in o.new_token_ids),
                    text="".join(o.text_delta for o in outs),
                    finish_reason=last.finish_reason,
                    stop_reason=last.stop_reason,
                    logprobs=tuple(lp for o in outs for lp in o.logprobs),
                    num_cached_tokens=last.num_cached_tokens,
                    prompt_logprobs=tuple(lp for o in outs for lp in o.prompt_logprobs),
                )
            )
        return results


def _token_ids(prompt: Sequence[int]) -> list[int]:
    """A prompt's ids as ints (sampling_params.as_int: integers only)."""
    given = list(prompt)
    ids = [as_int(t) for t in given]
    if None in ids:
        bad = given[ids.index(None)]
        raise InvalidRequestError("prompt_token_ids", f"token ids must be integers, got {bad!r}")
    return ids  # type: ignore[return-value]

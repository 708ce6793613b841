"""The router's poll of its workers' load, and the watchdog it carries.

One load call per worker is in flight at a time; a poll takes the answers that come within its
wait and leaves a slow worker's call running for later polls, which take it once it has come
without waiting for it again, so one worker that does not answer holds up one poll, not every
poll and not the others' figures. A worker answers a load call between two engine steps
(worker_protocol/host.py), so a worker whose calls have given no load for `hang_timeout_s`
(from the first call sent since its last load, however often or seldom polls come) is hung:
its engine thread is stuck, its process stopped, or its node unreachable while Ray has not
declared it dead. The pools then stop it and replace it (Pools.stop_hung), and its requests
resume elsewhere, as a dead worker's do. A call that fails is no answer either (Ray cannot reach
the worker for now, or its engine stopped); one that says its actor died takes it out of its pool
at once (Pools.note_failure).

Ray's refs are waited on from a thread (ray.wait), not wrapped in one event loop's futures: the
same poll serves the router's loop and callers that run one loop per call.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import ray

from router.cost_model import StepTimeModel
from router.worker_calls import UNAVAILABLE
from router.workers import WorkerHandle
from worker_protocol.messages import WorkerInfo, WorkerLoad


@dataclass(slots=True)
class Polled:
    loads: list[WorkerLoad] = field(default_factory=list)
    failed: list[tuple[WorkerHandle, BaseException]] = field(default_factory=list)
    # Workers that answered nothing for the hang timeout, with how long they have been silent.
    hung: list[tuple[WorkerHandle, float]] = field(default_factory=list)


class LoadPoll:
    """Not thread-safe: polls may overlap on one event loop (the router's poller and a caller
    there), or follow one another from loops of their own, however far apart."""

    def __init__(self, hang_timeout_s: float) -> None:
        self.hang_timeout_s = hang_timeout_s  # 0: no watchdog
        self._calls: dict[WorkerHandle, Any] = {}  # the load call in flight, by incarnation
        # Since when each worker has given no load: when the first call it has not answered
        # since its last load was sent (none while it has answered every call sent).
        self._since: dict[WorkerHandle, float] = {}
        self._slow: set[WorkerHandle] = set()  # whose call in flight outlasted a poll's wait

    async def poll(self, handles: Sequence[WorkerHandle], wait_s: float) -> Polled:
        """The load of `handles` that answer within `wait_s`, the calls that failed, and the
        workers that have given no load for the hang timeout (no longer polled: they are to be
        stopped). A call that outlasted one poll's wait (a slow or hung worker's) is not waited
        for again: it is taken once it has come."""
        live = set(handles)
        for book in (self._calls, self._since):
            for h in [h for h in book if h not in live]:  # gone from the pools
                del book[h]
        self._slow &= live
        self._send(handles)
        calls = list(self._calls.items())
        waits = [0.0 if h in self._slow else wait_s for h, _ in calls]
        answers = await asyncio.to_thread(_answers, [ref for _, ref in calls], waits)
        out = Polled()
        now = time.monotonic()
        for (h, ref), answer, wait in zip(calls, answers, waits):
            self._take(h, ref, answer, wait > 0, now)
            if isinstance(answer, WorkerLoad):
                out.loads.append(answer)
            elif answer is not _PENDING and not isinstance(answer, UNAVAILABLE):
                out.failed.append((h, answer))
        if self.hang_timeout_s > 0:
            for h in handles:
                since = self._since.get(h)
                if since is not None and now - since > self.hang_timeout_s:
                    out.hung.append((h, now - since))
                    self._calls.pop(h, None)
                    self._slow.discard(h)
                    del self._since[h]
        return out

    def silent(self, after_s: float) -> set[str]:
        """Ids of the workers that have given no load for more than `after_s`."""
        now = time.monotonic()
        return {h.worker_id for h, t in self._since.items() if now - t > after_s}

    def unanswering(self, handles: Sequence[WorkerHandle], wait_s: float) -> set[str]:
        """Ids of `handles` that give no load within `wait_s`: their call in flight, or one
        sent now, has not come, or came as a failure. Blocks; for a caller with no poll
        running beside it (a stop, once the router's poller has ended)."""
        handles = list(dict.fromkeys(handles))
        self._send(handles)
        refs = [self._calls[h] for h in handles]
        answers = _answers(refs, [wait_s] * len(handles))
        now = time.monotonic()
        for h, ref, answer in zip(handles, refs, answers):
            self._take(h, ref, answer, True, now)
        return {h.worker_id for h, a in zip(handles, answers) if not isinstance(a, WorkerLoad)}

    def _send(self, handles: Sequence[WorkerHandle]) -> None:
        """A load call to each of `handles` with none in flight; the clock of one that has
        given no load starts at the first call it has not answered."""
        now = time.monotonic()
        for h in handles:
            if h not in self._calls:
                self._calls[h] = h.actor.load.remote()
                self._since.setdefault(h, now)

    def _take(self, h: WorkerHandle, ref: Any, answer: Any, waited: bool, now: float) -> None:
        """The books once `answer` (or _PENDING) came of the call `ref` to `h`. Polls may
        overlap: each takes what it waited for, and a worker's books change only while they
        still hold the call that poll saw."""
        mine = self._calls.get(h) is ref
        if answer is _PENDING:
            if waited and mine:
                self._slow.add(h)  # waited for once
            return
        if mine:
            del self._calls[h]  # a new call goes out at the next poll
            self._slow.discard(h)
            if isinstance(answer, WorkerLoad):
                self._since.pop(h, None)
        if isinstance(answer, WorkerLoad):
            h.answered_at = now  # a stream's own watch need not ask it (HangWatch)


_PENDING = object()


def _answers(refs: list[Any], waits: list[float]) -> list[Any]:
    """What each of `refs` came to (its value, or the exception it raised) within its wait in
    `waits` (those waited for together), or _PENDING."""
    done: set[Any] = set()
    for wait in sorted(set(waits), reverse=True):  # the others' may come meanwhile
        group = [ref for ref, w in zip(refs, waits) if w == wait]
        ready, _ = ray.wait(group, num_returns=len(group), timeout=wait, fetch_local=True)
        done.update(ready)
    out: list[Any] = []
    for ref in refs:
        if ref not in done:
            out.append(_PENDING)
            continue
        try:
            out.append(ray.get(ref, timeout=10))  # ready: at once
        except Exception as exc:  # the worker's error, or Ray's about the worker
            out.append(exc)
    return out


def slow_step_warning(infos: Sequence[WorkerInfo], hang_timeout_s: float) -> str | None:
    """What to say at start where a worker's full step (a prompt chunk of its whole token
    budget), as its step-time model predicts it before any serving step, would take half the
    hang timeout or more: a step answers no load, so one that long could be taken for a hang
    (a large model on CPU). None: no such worker, or the watchdog is off."""
    if hang_timeout_s <= 0 or not infos:
        return None
    step_s, slowest = max(
        ((StepTimeModel(i).prefill_s(i.max_num_batched_tokens), i) for i in infos),
        key=lambda pair: pair[0],
    )
    if step_s < hang_timeout_s / 2:
        return None
    return (
        f"{slowest.worker_id}: a step of {slowest.max_num_batched_tokens} prompt tokens is "
        f"predicted at {step_s:.0f} s, against a hang timeout of {hang_timeout_s:g} s "
        "(a worker answers no load during a step): raise --worker-hang-timeout, or lower "
        "--max-num-batched-tokens"
    )

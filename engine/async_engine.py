"""AsyncEngine: one LLMEngine driven by its own thread, with asyncio streams per request.

The engine is not thread-safe, so exactly one thread (the engine thread) touches it. Everything
else reaches it through `call(fn)`, which runs `fn(engine)` on that thread between two steps and
returns its result to the caller's event loop. Lifecycle of the thread, in order:
  1. run the commands queued since the last step (add, abort, KV reservation and arrival, ...);
  2. if any request can run, `step()` and hand each RequestOutput to its request's queue;
     otherwise sleep until a command arrives;
  3. on `shutdown`, abort what is left and end every open stream.
If a step raises, every open stream ends with that error (and the requests are aborted): a broken
step never leaves a caller waiting. An `on_dead` hook hears of it first (a pool worker ends its
process there, so that its requests resume on another worker).
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import Future
from typing import Any, TypeVar

from engine.llm_engine import LLMEngine
from engine.outputs import RequestOutput, SchedulerOutput
from engine.request import FinishReason
from engine.sampling_params import SamplingParams

T = TypeVar("T")
LayerHook = Callable[[int, SchedulerOutput], None]


class EngineDeadError(RuntimeError):
    """The engine thread stopped (shutdown or a failed step); no new work is taken."""


class AsyncEngine:
    def __init__(
        self,
        engine: LLMEngine,
        on_layer: LayerHook | None = None,
        wants_layers: Callable[[SchedulerOutput], bool] | None = None,
        on_dead: Callable[[BaseException], None] | None = None,
    ) -> None:
        self.engine = engine
        self.on_layer = on_layer
        self.wants_layers = wants_layers  # see LLMEngine.step
        self.on_dead = on_dead  # called on the engine thread when a step raised
        self._commands: deque[tuple[Callable[[LLMEngine], Any], Future[Any]]] = deque()
        self._wake = threading.Event()
        # Guards "stopped?" + enqueue against "stop" + drain, so no command is ever stranded.
        self._lock = threading.Lock()
        self._stopped = False
        self._error: BaseException | None = None
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue[Any]]] = {}
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._thread.start()

    # -- from any thread ----------------------------------------------------------------------
    def call_threadsafe(self, fn: Callable[[LLMEngine], T]) -> Future[T]:
        fut: Future[T] = Future()
        with self._lock:
            if not self._stopped:
                self._commands.append((fn, fut))
                self._wake.set()
                return fut
        fut.set_exception(EngineDeadError(f"engine stopped: {self._error!r}"))
        return fut

    async def call(self, fn: Callable[[LLMEngine], T]) -> T:
        """Run `fn(engine)` on the engine thread between steps; await its result."""
        return await asyncio.wrap_future(self.call_threadsafe(fn))

    def open_stream(self, request_id: str) -> asyncio.Queue[Any]:
        """Register a queue for a request's outputs; call from the event loop that reads it."""
        if request_id in self._streams:
            raise ValueError(f"request_id {request_id!r} already has an open stream")
        q: asyncio.Queue[Any] = asyncio.Queue()
        self._streams[request_id] = (asyncio.get_running_loop(), q)
        return q

    def close_stream(self, request_id: str) -> None:
        self._streams.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its open stream (if any) ends with a finished ABORT output."""

        def run(e: LLMEngine) -> None:
            e.abort(request_id)
            self.deliver(RequestOutput(request_id, (), "", True, finish_reason=FinishReason.ABORT))

        await self.call(run)

    async def add(self, request_id: str, add: Callable[[LLMEngine], Any]) -> asyncio.Queue[Any]:
        """Open `request_id`'s stream and run `add(engine)` (which queues the request) on the
        engine thread; the stream's queue, or the stream closed again if it never got in."""
        q = self.open_stream(request_id)
        try:
            await self.call(add)
        except BaseException:
            self._streams.pop(request_id, None)
            raise
        return q

    async def generate(
        self,
        prompt: Sequence[int],
        params: SamplingParams,
        request_id: str,
        *,
        prefill_hold_s: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Add a request and yield its outputs until it finishes; abort it if the caller stops.
        `prefill_hold_s`: as for LLMEngine.add_request."""
        q = await self.add(
            request_id,
            lambda e: e.add_request(
                list(prompt), params, request_id, prefill_hold_s=prefill_hold_s
            ),
        )
        async for out in self.stream(request_id, q):
            yield out

    async def stream(self, request_id: str, q: asyncio.Queue[Any]) -> AsyncIterator[RequestOutput]:
        finished = False
        try:
            while True:
                item = await q.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            self._streams.pop(request_id, None)
            if not finished and not self._stopped:
                self.call_threadsafe(lambda e: e.abort(request_id))

    def shutdown(self, timeout: float = 10.0) -> None:
        with self._lock:
            self._stopped = True
        self._wake.set()
        self._thread.join(timeout)

    # -- the engine thread --------------------------------------------------------------------
    def _run(self) -> None:
        try:
            while not self._stopped:
                self._run_commands()
                if self.engine.has_unfinished_requests():
                    self._dispatch(self.engine.step(self.on_layer, self.wants_layers))
                    if self.engine.last_step_empty:  # not a busy loop: a command or 1 ms
                        self._wake.wait(0.001)
                        self._wake.clear()
                else:
                    self._wake.wait(0.5)
                    self._wake.clear()
        except BaseException as exc:  # a broken step ends every stream with its error
            self._error = exc
            if self.on_dead is not None:
                self.on_dead(exc)
        finally:
            with self._lock:
                self._stopped = True
            self._close_all()

    def _run_commands(self) -> None:
        while self._commands:
            fn, fut = self._commands.popleft()
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(self.engine))
            except BaseException as exc:
                fut.set_exception(exc)

    def _dispatch(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            self.deliver(out)

    def deliver(self, out: RequestOutput) -> None:
        """Hand one output to its stream (engine thread only)."""
        entry = self._streams.get(out.request_id)
        if entry is not None:
            loop, q = entry
            try:
                loop.call_soon_threadsafe(q.put_nowait, out)
            except RuntimeError:  # the reader's loop is closed: nobody is waiting
                self._streams.pop(out.request_id, None)

    def _close_all(self) -> None:
        err = EngineDeadError(f"engine stopped: {self._error!r}")
        for loop, q in list(self._streams.values()):
            try:
                loop.call_soon_threadsafe(q.put_nowait, err)
            except RuntimeError:
                pass  # that reader's loop is already closed: nobody is waiting

        while self._commands:
            _, fut = self._commands.popleft()
            if fut.set_running_or_notify_cancel():
                fut.set_exception(err)
        live = list(self.engine.scheduler.requests)
        if live:
            self.engine.abort(live)

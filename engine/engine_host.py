"""EngineHost: what every pool worker is around its engine, whatever its role.

It builds the process's one engine (with its torch thread count) and the engine thread that
drives it, answers readiness and load questions, and stops them. The transfer side of a worker
comes from kv_transfer's KVEndpoint; a worker class combines the two.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from engine.async_engine import AsyncEngine, LayerHook
from engine.device_rate import measure_device
from engine.kv_cache import KVCacheSource
from engine.llm_engine import LLMEngine
from engine.serving import WorkerInfo, WorkerLoad, WorkerSpec, engine_load, worker_info


class EngineHost:
    role = "engine"

    def __init__(self, worker_id: str, spec: WorkerSpec, on_layer: LayerHook | None = None) -> None:
        torch.set_num_threads(spec.num_threads)
        self.worker_id = worker_id
        self.spec = spec
        self.engine = LLMEngine(spec.engine)
        self.aeng = AsyncEngine(self.engine, on_layer=on_layer)
        rate = measure_device(self.engine.runner.device, self.engine.runner.dtype)
        self._info = worker_info(self.engine, worker_id, self.role, rate)

    def kv_source(self) -> KVCacheSource:
        loaded, runner = self.engine.loaded, self.engine.runner
        return KVCacheSource(
            runner.spec, runner.device, loaded.name, loaded.hf_model.config.to_json_string()
        )

    def ready(self) -> str:
        return self.worker_id

    def info(self) -> WorkerInfo:
        return self._info

    def open_transfers(self) -> int:
        """KV transfers still tracked for this worker; a transfer side overrides it."""
        return 0

    async def load(self) -> WorkerLoad:
        load = await self.aeng.call(lambda e: engine_load(e, self.worker_id, self.role))
        return replace(load, open_transfers=self.open_transfers())

    def shutdown(self) -> None:
        self.aeng.shutdown()

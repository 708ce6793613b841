"""A worker's end of KV transfer: its torch.distributed connector and the pairing calls a router
makes on it. Both pools' actors inherit this, so pairing behaves the same on either side.

Pairing blocks (rendezvous, layout handshake, process groups), so it runs on a thread, off the
actor's event loop, and token streams keep flowing meanwhile.
"""

from __future__ import annotations

import asyncio

from engine.kv_cache import KVCacheSource
from kv_transfer.base import TransferStats
from kv_transfer.faults import FaultPlan
from kv_transfer.layout import KVLayout, model_identity
from kv_transfer.rendezvous import PeerAddress
from kv_transfer.torch_dist import TorchDistConfig, TorchDistConnector


class KVEndpoint:
    layout: KVLayout
    connector: TorchDistConnector

    def init_endpoint(
        self,
        source: KVCacheSource,
        bind_host: str,
        backend: str,
        connect_timeout_s: float,
        faults: FaultPlan | None = None,
    ) -> None:
        """A connector for one engine's KV cache (its layout, device and model identity),
        listening on `bind_host`; `faults` only in tests and benches."""
        model_id = model_identity(source.model_name, source.model_config_text)
        self.layout = KVLayout.from_spec(source.spec, model_id)
        config = TorchDistConfig(
            bind_host=bind_host,
            backend=backend,
            connect_timeout_s=connect_timeout_s,
            faults=faults,
        )
        self.connector = TorchDistConnector(self.layout, source.device, config)

    async def listen(self, peer_id: str, attempt: int = 0) -> PeerAddress:
        return await asyncio.to_thread(self.connector.listen, peer_id, attempt)

    async def connect(
        self, peer_id: str, address: PeerAddress, is_master: bool, attempt: int = 0
    ) -> None:
        await asyncio.to_thread(self.connector.connect, peer_id, address, is_master, attempt)

    def connected(self, peer_id: str) -> bool:
        return self.connector.connected(peer_id)

    async def disconnect(self, peer_id: str, attempt: int | None = None) -> None:
        """Close the pair with `peer_id` (its running transfers end FAILED); `attempt`: see
        torch_dist.py's docstring."""
        await asyncio.to_thread(self.connector.disconnect, peer_id, attempt)

    def kv_stats(self) -> TransferStats:
        return self.connector.stats()

    def open_transfers(self) -> int:
        return self.connector.num_records()

    def close_endpoint(self) -> None:
        self.connector.close()

"""A worker's end of KV transfer: its torch.distributed connector and the pairing calls a router
makes on it. Both pools' actors inherit this, so pairing behaves the same on either side.

Pairing blocks (rendezvous, layout handshake, process groups), so it runs on a thread, off the
actor's event loop, and token streams keep flowing meanwhile.
"""

from __future__ import annotations

import asyncio

import torch

from engine.kv_cache import KVCacheSpec
from kv_transfer.base import TransferStats
from kv_transfer.layout import KVLayout, model_identity
from kv_transfer.rendezvous import PeerAddress
from kv_transfer.torch_dist import TorchDistConfig, TorchDistConnector


class KVEndpoint:
    layout: KVLayout
    connector: TorchDistConnector

    def init_endpoint(
        self,
        spec: KVCacheSpec,
        model_name: str,
        model_config_text: str,
        device: torch.device,
        bind_host: str,
        backend: str,
    ) -> None:
        self.layout = KVLayout.from_spec(spec, model_identity(model_name, model_config_text))
        self.connector = TorchDistConnector(
            self.layout, device, TorchDistConfig(bind_host=bind_host, backend=backend)
        )

    async def listen(self, peer_id: str) -> PeerAddress:
        return await asyncio.to_thread(self.connector.listen, peer_id)

    async def connect(self, peer_id: str, address: PeerAddress, is_master: bool) -> None:
        await asyncio.to_thread(self.connector.connect, peer_id, address, is_master)

    def connected(self, peer_id: str) -> bool:
        return self.connector.connected(peer_id)

    async def disconnect(self, peer_id: str) -> None:
        """Close the pair with `peer_id` (its running transfers end FAILED)."""
        await asyncio.to_thread(self.connector.disconnect, peer_id)

    def kv_stats(self) -> TransferStats:
        return self.connector.stats()

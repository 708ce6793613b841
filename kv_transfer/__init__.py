"""Paged KV block transfer between workers: layout handshake, the non-blocking connector interface,
the torch.distributed connector (torch_dist), an in-process fake (fake) and a bandwidth bench."""

from kv_transfer.base import (
    FailureReason,
    KVConnector,
    TransferRequest,
    TransferResult,
    TransferStats,
    TransferStatus,
    send_all_layers,
)
from kv_transfer.layout import KVLayout, LayoutMismatchError, check_compatible, model_identity

__all__ = [
    "FailureReason",
    "KVConnector",
    "KVLayout",
    "LayoutMismatchError",
    "TransferRequest",
    "TransferResult",
    "TransferStats",
    "TransferStatus",
    "check_compatible",
    "model_identity",
    "send_all_layers",
]

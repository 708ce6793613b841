"""Pairing two workers without a global world: a TCPStore per pair, a layout handshake through it,
then one two-rank process group per direction ("lane").

The master side (rank 0) hosts the store: `listen` binds it on an OS-chosen port and returns the
`PeerAddress` to hand to the other side (the Ray layer carries it). Both sides then call
`connect_lanes` at the same time; it blocks until the pair is formed or `timeout_s` passes.

Why a group per direction: NCCL runs all point-to-point work of one communicator on one stream, in
the order posted. With both directions in one communicator, a send waiting for its recv could sit
in front of the recv the peer's send is waiting for. With one group per direction, each group has
exactly one sending thread at one end and one receiving thread at the other.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import NamedTuple, Protocol, cast

import torch
import torch.distributed as dist

from kv_transfer.layout import KVLayout, check_compatible

_LAYOUT_KEY = "pdserve/kv_layout/{rank}"
_DEVICE_KEY = "pdserve/kv_device/{rank}"
_CHECKED_KEY = "pdserve/kv_checked/{rank}"


@dataclass(frozen=True, slots=True)
class PeerAddress:
    """Where the master side of a pair listens. Plain data, safe to pass between processes."""

    host: str
    port: int


class P2PGroup(Protocol):
    """The point-to-point surface of a c10d backend (torch's stubs leave send/recv out)."""

    def send(self, tensors: list[torch.Tensor], dst_rank: int, tag: int) -> dist.Work: ...

    def recv(self, tensors: list[torch.Tensor], src_rank: int, tag: int) -> dist.Work: ...


class Lanes(NamedTuple):
    out: P2PGroup  # this side sends, the peer receives
    inn: P2PGroup  # the peer sends, this side receives
    backend: str  # "gloo" or "nccl"


def listen(host: str, timeout_s: float) -> tuple[dist.TCPStore, PeerAddress]:
    """Host a pair's store on an OS-chosen port of `host`. Does not wait for the peer.

    The listening socket is made here, bound to `host` alone, and handed to the store: left to
    itself, TCPStore listens on every interface of the machine."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.bind((host, 0))
        sock.listen(128)
        port = sock.getsockname()[1]
        store = dist.TCPStore(
            host,
            port,
            2,
            is_master=True,
            timeout=timedelta(seconds=timeout_s),
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
            use_libuv=True,
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store owns the descriptor now
    return store, PeerAddress(host, port)


def join(address: PeerAddress, timeout_s: float) -> dist.TCPStore:
    """Connect to the store the master side hosts at `address`."""
    return dist.TCPStore(
        address.host,
        address.port,
        2,
        is_master=False,
        timeout=timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def handshake(store: dist.Store, rank: int, layout: KVLayout, device_id: str) -> str:
    """Exchange layouts and device identities (`device_identity`); raise LayoutMismatchError on
    both sides when the layouts differ, else return the peer's device identity.

    Both sides publish before either compares, and each confirms it has read the other's layout
    before returning, so the master may drop the store afterwards without cutting the peer off.
    """
    store.set(_DEVICE_KEY.format(rank=rank), device_id)
    store.set(_LAYOUT_KEY.format(rank=rank), layout.to_json())
    remote = KVLayout.from_json(store.get(_LAYOUT_KEY.format(rank=1 - rank)).decode())
    remote_device = store.get(_DEVICE_KEY.format(rank=1 - rank)).decode()
    store.set(_CHECKED_KEY.format(rank=rank), "1")
    store.get(_CHECKED_KEY.format(rank=1 - rank))
    check_compatible(layout, remote)
    return remote_device


MIG = "cuda-mig/"  # a MIG instance's identity: NCCL does not pair MIG instances


def device_identity(device: torch.device) -> str:
    """Which GPU a cache lives on, the same in every process that sees that GPU whatever index
    its CUDA_VISIBLE_DEVICES gives it there (its UUID); "" for a cache on CPU. A MIG instance
    (a slice of a GPU) is marked so (MIG): NCCL does not support MIG, so its pairs use gloo."""
    if device.type != "cuda":
        return ""
    props = torch.cuda.get_device_properties(device)
    return f"{MIG if is_mig(props.name) else 'cuda/'}{props.uuid}"


def is_mig(device_name: str) -> bool:
    """Whether a GPU is a MIG instance, as its name says ("NVIDIA A100-SXM4-40GB MIG 3g.20gb")."""
    return " MIG " in f" {device_name} "


def pair_backend(requested: str, local_id: str, remote_id: str) -> str:
    """One pair's backend, from both sides' device identities, so both sides choose alike.

    auto: nccl between two different GPUs; gloo where either cache is on CPU or on a MIG
    instance, or where both are on one GPU (workers given a fraction of a GPU each): NCCL refuses
    two ranks on one device, so there the KV goes through host memory (staging.py). gloo: as
    asked. nccl: as asked between two GPUs, refused (ValueError, at pairing) where it cannot
    work, rather than failing every transfer."""
    mig = local_id.startswith(MIG) or remote_id.startswith(MIG)
    two_gpus = bool(local_id and remote_id and local_id != remote_id) and not mig
    if requested == "nccl" and not two_gpus:
        if mig:
            where = "a cache is on a MIG instance, which NCCL does not support"
        else:
            where = "both caches are on one GPU" if local_id == remote_id else "a cache is on CPU"
        raise ValueError(f"the nccl backend needs the two caches on two GPUs, but {where}: "
                         "use auto or gloo")  # fmt: skip
    if requested != "auto":
        return requested
    return "nccl" if two_gpus else "gloo"


def choose_backend(requested: str, device: torch.device) -> str:
    """The configured backend, checked against this side's cache ("auto" stays auto: each pair
    settles it in `pair_backend`)."""
    if requested == "auto":
        return requested
    if requested == "nccl" and device.type != "cuda":
        raise ValueError("the nccl backend needs a CUDA cache")
    if requested not in ("gloo", "nccl"):
        raise ValueError(f"backend must be auto, gloo or nccl, got {requested!r}")
    return requested


def _group(
    store: dist.Store, rank: int, backend: str, bind_host: str, timeout_s: float
) -> P2PGroup:
    timeout = timedelta(seconds=timeout_s)
    if backend == "gloo":
        # The stubs call it Options; at run time the gloo options class is _Options.
        opts = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]
        opts._timeout = timeout
        # Bind to the given interface; gloo's default follows the hostname, which may be external.
        opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host)]
        return cast(P2PGroup, dist.ProcessGroupGloo(store, rank, 2, opts))
    nccl_opts = dist.ProcessGroupNCCL.Options()
    nccl_opts._timeout = timeout
    return cast(P2PGroup, dist.ProcessGroupNCCL(store, rank, 2, nccl_opts))


def connect_lanes(
    store: dist.Store, rank: int, backend: str, bind_host: str, timeout_s: float
) -> Lanes:
    """Form the two lanes of a pair. Both sides build lane 0 (rank 0 -> 1) first, then lane 1."""
    lanes = [
        _group(dist.PrefixStore(f"pdserve/kv_lane{k}", store), rank, backend, bind_host, timeout_s)
        for k in (0, 1)
    ]
    return Lanes(out=lanes[rank], inn=lanes[1 - rank], backend=backend)

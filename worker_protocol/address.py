"""Where a worker's KV rendezvous and lanes listen.

A prefill worker and a decode worker on different nodes reach each other only on an address
their nodes share a network on. By default that is the address Ray knows the worker's node by
(Ray's own traffic between the two nodes already uses it); it is 127.0.0.1 only when Ray runs on
this machine alone. An operator names another interface (a fast fabric, as NCCL_SOCKET_IFNAME or
GLOO_SOCKET_IFNAME name one) or an address, for every worker of a pool.

NCCL picks its own transport between GPUs (NVLink, InfiniBand, sockets); only the pair's
rendezvous store and gloo's lanes listen on the address chosen here.
"""

from __future__ import annotations

import socket

import psutil


class AddressError(ValueError):
    """The configured interface or address cannot be used on this node."""


def interface_address(name: str) -> str:
    """The first IPv4 address of interface `name` (else its first IPv6 one)."""
    addrs = psutil.net_if_addrs()
    if name not in addrs:
        raise AddressError(
            f"kv_interface: no interface {name!r} on this node (it has {', '.join(sorted(addrs))})"
        )
    for family in (socket.AF_INET, socket.AF_INET6):
        for a in addrs[name]:
            if a.family == family:
                return a.address.split("%")[0]  # an IPv6 link-local address carries %scope
    raise AddressError(f"kv_interface: interface {name!r} has no IP address")


def kv_bind_host(node_ip: str, interface: str | None = None, host: str | None = None) -> str:
    """The address a worker on a node Ray knows as `node_ip` listens on for KV transfer."""
    if host:
        return host
    if interface:
        return interface_address(interface)
    return node_ip


def node_ip() -> str:
    """The address Ray knows this process's node by (its node manager's); 127.0.0.1 outside
    Ray."""
    import ray

    if not ray.is_initialized():
        return "127.0.0.1"
    node_id = ray.get_runtime_context().get_node_id()
    for node in ray.nodes():
        if node.get("NodeID") == node_id:
            return str(node["NodeManagerAddress"])
    raise AddressError(f"Ray does not list this process's node {node_id}")

"""How a client reaches a pdserve server: its channel (plaintext, TLS, or mutual TLS) and the
bearer token it sends with every call. `pdserve complete`, `scale`, `workers` and `bench` use it;
so can any Python client. `pdserve_client.metrics` reads a server's Prometheus metrics."""

from pdserve_client.connect import ClientAuth, add_arguments

__all__ = ["ClientAuth", "add_arguments"]

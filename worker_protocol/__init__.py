"""What the router and the worker pools share: the messages between them (messages.py), the base
every pool worker builds on (host.py), and where a worker's KV transfer listens (address.py)."""

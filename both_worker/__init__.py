"""The Ray actor of a worker that both prefills and decodes: the router places each request's
prefill and decode on any such worker (itself for both: colocated)."""

"""Errors the engine raises at its API boundary.

Each names the offending field and what is allowed, so that the router can turn it into an
INVALID_ARGUMENT answer without guessing.
"""

from __future__ import annotations


class InvalidRequestError(ValueError):
    """A request parameter is out of range. `field` names it; the message says the allowed range."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        # Picklable with its two arguments: raised in a worker, it reaches the router whole
        # (Ray pickles it), not as an error about the error.
        return type(self), (self.field, self.message)


class ModelNotFoundError(ValueError):
    """A model name or path that pdserve cannot load; the message says what was looked for."""


class KVCacheAllocationError(ValueError):
    """The KV cache asked for does not fit the device's memory; the message says how much was
    asked for and by which setting."""

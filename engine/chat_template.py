"""Chat messages as token ids, through the model's own chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.errors import InvalidRequestError


def chat_token_ids(tokenizer: Any, messages: Sequence[dict[str, str]], field: str) -> list[int]:
    """The prompt's ids for `messages` ({"role", "content"} each), the assistant's turn opened.
    InvalidRequestError naming `field` where the model has no chat template, or its template
    refuses them (roles out of order, a raise_exception of its own)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(field, "this model has no chat template; send a plain prompt")
    try:
        ids = tokenizer.apply_chat_template(
            list(messages), add_generation_prompt=True, tokenize=True, return_dict=False
        )
    except Exception as exc:  # the template's own refusal: Jinja's errors are of many types
        raise InvalidRequestError(field, f"the chat template refused them: {exc}") from exc
    return [int(t) for t in ids]

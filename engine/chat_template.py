"""Chat messages as token ids, through the model's own chat template."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from engine.errors import InvalidRequestError


def chat_token_ids(
    tokenizer: Any,
    messages: Sequence[dict[str, str]],
    field: str,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
) -> list[int]:
    """The prompt's ids for `messages` ({"role", "content"} each, "name" where given), the
    assistant's turn opened (`add_generation_prompt`), or the last message left open for the
    model to go on with (`continue_final_message`, as transformers' and vLLM's).
    InvalidRequestError naming `field` where the model has no chat template, or its template
    refuses them (roles out of order, a raise_exception of its own)."""
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequestError(field, "this model has no chat template; send a plain prompt")
    try:
        ids = tokenizer.apply_chat_template(
            list(messages),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=True,
            return_dict=False,
        )
    except Exception as exc:  # the template's own refusal: Jinja's errors are of many types
        said = str(exc)  # transformers may quote the whole rendered prompt
        said = said if len(said) <= 300 else said[:300] + "..."
        if continue_final_message and "continue_final_message" in said:
            field = "continue_final_message"
        raise InvalidRequestError(field, f"the chat template refused them: {said}") from exc
    return [int(t) for t in ids]

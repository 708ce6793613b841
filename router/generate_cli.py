"""`pdserve generate`: prompts completed offline by one in-process engine (router/cli.py
defines its flags), printed as text or, with --json, one JSON line per prompt."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from dataclasses import replace

from transformers.utils.logging import disable_progress_bar, set_verbosity_error

from engine.config import EngineConfig, ModelConfig
from engine.errors import InvalidRequestError, ModelNotFoundError
from engine.llm_engine import Completion, LLMEngine
from engine.sampling_params import SamplingParams
from router.client import OPTIONAL_SAMPLING, not_utf8
from router.request import max_tokens_for

DEFAULT_GENERATE_TOKENS = 256


def within_context(
    params: SamplingParams, prompt_len: int, asked: int | None, engine: LLMEngine
) -> SamplingParams:
    """`params` for a prompt of `prompt_len` tokens: max_tokens as the server makes it (the
    default cut to what the context leaves, an asked-for one past it refused)."""
    if prompt_len >= engine.max_model_len:
        return params  # the engine refuses the prompt itself, naming its length
    n = max_tokens_for(asked, DEFAULT_GENERATE_TOKENS, prompt_len, engine.max_model_len)
    return replace(params, max_tokens=n)


def run(args: argparse.Namespace, error: Callable[[Exception], int]) -> int:
    """`pdserve generate`; bad input is `error`'s (one line, its exit status)."""
    # The weight-loading progress bar and transformers' warnings (a prompt longer than the
    # tokenizer's limit: refused below, naming it) are noise for a one-shot command.
    disable_progress_bar()
    set_verbosity_error()
    try:
        # Parameters first: a typo should not wait for the model to load.
        not_utf8([*(("prompt", p) for p in args.prompt), *(("stop", s) for s in args.stop)])
        params = SamplingParams(
            max_tokens=args.max_tokens or DEFAULT_GENERATE_TOKENS,
            temperature=args.temperature,
            stop=tuple(args.stop),
            stop_token_ids=tuple(args.stop_token_id),
            ignore_eos=args.ignore_eos,
            logit_bias=tuple(dict(args.logit_bias).items()),
            **{k: getattr(args, k) for k in OPTIONAL_SAMPLING if getattr(args, k) is not None},
        )
        model = ModelConfig(
            model=args.model,
            num_threads=args.threads,
            dtype=args.dtype,
            enforce_eager=args.enforce_eager,
        )
        config = EngineConfig(model=model)
        engine = LLMEngine(config)
    except ValueError as exc:  # InvalidRequestError and ModelNotFoundError included
        return error(exc)
    try:
        if any(p == "" for p in args.prompt):
            raise InvalidRequestError("prompt", "must not be empty (at least 1 character)")
        chat = args.chat
        if chat is None:
            chat = bool(getattr(engine.tokenizer, "chat_template", None))
        prompts = [engine.encode(p, chat=chat) for p in args.prompt]
        plist = [within_context(params, len(p), args.max_tokens, engine) for p in prompts]
        completions = engine.generate(prompts, plist)
    except (InvalidRequestError, ModelNotFoundError) as exc:
        return error(exc)
    if args.json:
        for prompt, c in zip(args.prompt, completions):
            print(json.dumps(as_json(prompt, c)))
        return 0
    if len(completions) == 1:
        print(completions[0].text)
        return 0
    for i, (prompt, c) in enumerate(zip(args.prompt, completions), start=1):
        print(f"=== [{i}] {prompt}")
        print(c.text)
    return 0


def as_json(prompt: str, c: Completion) -> dict[str, object]:
    """One of `pdserve generate --json`'s lines."""
    doc: dict[str, object] = {
        "prompt": prompt,
        "text": c.text,
        "token_ids": list(c.token_ids),
        "finish_reason": c.finish_reason.value if c.finish_reason else None,
        "stop_reason": c.stop_reason,
        "usage": {
            "prompt_tokens": len(c.prompt_token_ids),
            "completion_tokens": len(c.token_ids),
            "cached_prompt_tokens": c.num_cached_tokens,
        },
    }
    for name, lps in (("logprobs", c.logprobs), ("prompt_logprobs", c.prompt_logprobs)):
        if lps:
            doc[name] = [
                {"token_id": lp.token_id, "logprob": lp.logprob,
                 "top": [{"token_id": t, "logprob": x} for t, x in lp.top]}
                for lp in lps
            ]  # fmt: skip
    return doc

"""The prefill pool's Ray actor: prefills prompts and streams their KV to decode workers."""

"""The request router: validation, admission, path policy, streaming, and the `pdserve` CLI."""

"""Model execution on one device: config, requests, paged KV cache, scheduler, runner, sampling."""

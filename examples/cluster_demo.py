"""Start a local cluster (one prefill and one decode worker) and stream a completion through each
path. Run: .venv/bin/python examples/cluster_demo.py [--model smollm2-135m]

The workers stream token ids (TokenChunk); the text is the caller's to decode, as the router
does: incrementally, since a token may hold part of a character (engine/text_stream.py)."""

import argparse
import asyncio
import contextlib

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.loader import load_tokenizer
from engine.sampling_params import SamplingParams
from engine.text_stream import TextStream
from router.cluster import Cluster, ClusterConfig
from router.vocab import Placement, RoutePath


async def stream(cluster: Cluster, tok, ids: list[int], path: RoutePath) -> None:
    print(f"[{path.value}] ", end="", flush=True)
    params = SamplingParams(max_tokens=32, temperature=0)
    text = TextStream(tok, ids, params)
    # aclosing: however the loop ends (an exception in it included), the request is aborted on
    # its workers at once and its blocks are freed, not when the generator is collected.
    async with contextlib.aclosing(cluster.generate(ids, params, Placement(path=path))) as chunks:
        async for chunk in chunks:
            print(text.feed(chunk.token_ids, chunk.finished), end="", flush=True)
    print()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    tok = load_tokenizer(ModelConfig(model=args.model))
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_dict=False,
    )
    engine = EngineConfig(cache=CacheConfig(cpu_kv_cache_gib=0.5))
    cluster = Cluster(ClusterConfig(model=args.model, num_prefill=1, num_decode=1, engine=engine))
    try:
        # colocated: the decode worker prefills in chunks, then decodes.
        asyncio.run(stream(cluster, tok, list(ids), RoutePath.COLOCATED))
        # disaggregated: the prefill worker streams the KV into blocks the decode worker reserved.
        asyncio.run(stream(cluster, tok, list(ids), RoutePath.DISAGGREGATED))
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()

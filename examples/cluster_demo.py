"""Start a local cluster (one prefill and one decode worker) and stream a completion through each
path. Run: .venv/bin/python examples/cluster_demo.py [--model smollm2-135m]"""

import argparse
import asyncio

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from router.cluster import Cluster, ClusterConfig


async def stream(cluster: Cluster, ids: list[int], path: str) -> None:
    print(f"[{path}] ", end="", flush=True)
    async for chunk in cluster.generate(ids, SamplingParams(max_tokens=32, temperature=0), path):
        print(chunk.text, end="", flush=True)
    print()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    args = ap.parse_args()
    tok = load_model(ModelConfig(model=args.model)).tokenizer
    ids = tok.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        add_generation_prompt=True,
        return_dict=False,
    )
    engine = EngineConfig(cache=CacheConfig(cpu_kv_cache_gib=0.5))
    cluster = Cluster(ClusterConfig(model=args.model, num_prefill=1, num_decode=1, engine=engine))
    try:
        asyncio.run(stream(cluster, list(ids), "colocated"))
        asyncio.run(stream(cluster, list(ids), "disaggregated"))
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()

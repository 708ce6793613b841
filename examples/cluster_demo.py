"""Start a local cluster (one prefill and one decode worker) and stream a completion through each
path. Run: .venv/bin/python examples/cluster_demo.py [--model smollm2-135m]"""

import argparse
import asyncio

from engine.config import CacheConfig, EngineConfig, ModelConfig
from engine.loader import load_model
from engine.sampling_params import SamplingParams
from router.cluster import Cluster, ClusterConfig
from router.vocab import Placement, RoutePath


async def stream(cluster: Cluster, ids: list[int], path: RoutePath) -> None:
    print(f"[{path.value}] ", end="", flush=True)
    params = SamplingParams(max_tokens=32, temperature=0)
    async for chunk in cluster.generate(ids, params, Placement(path=path)):
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
        asyncio.run(stream(cluster, list(ids), RoutePath.COLOCATED))
        asyncio.run(stream(cluster, list(ids), RoutePath.DISAGGREGATED))
    finally:
        cluster.shutdown()


if __name__ == "__main__":
    main()

"""The engine on CUDA: same token-for-token contract as on CPU. Skipped without a CUDA device."""

import gc
import weakref

import pytest
import torch

from engine import cuda_graphs
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.helpers import assert_pool_free, loaded, random_prompts

pytestmark = pytest.mark.gpu


def cuda_engine(name: str, dtype: str = "float32", eager: bool = False) -> LLMEngine:
    cfg = EngineConfig(
        model=ModelConfig(model=name, device="cuda", dtype=dtype, enforce_eager=eager),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(48, 8, True),
    )
    return LLMEngine(cfg, loaded(name))


@pytest.mark.parametrize("arch", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_cuda_greedy_matches_transformers_on_cuda(arch):
    engine = cuda_engine(arch)
    model = loaded(arch).hf_model.to("cuda")
    try:
        prompts = random_prompts([5, 17, 40, 90], seed=2)
        res = engine.generate(prompts, SamplingParams(max_tokens=12, temperature=0.0))
        for p, r in zip(prompts, res):
            ids = torch.tensor([p], device="cuda")
            ref = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=12, do_sample=False
            )[0, len(p) :].tolist()
            assert list(r.token_ids) == ref
        assert engine.runner.cache.layers[0].device.type == "cuda"
        assert_pool_free(engine)
    finally:
        model.to("cpu")


def test_cuda_seeded_sampling_is_batch_invariant():
    engine = cuda_engine("tiny-llama")
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=7)
    (alone,) = engine.generate(random_prompts([12], seed=1), sp)
    others = random_prompts([30, 4, 60], seed=3)
    mixed = engine.generate(
        random_prompts([12], seed=1) + others,
        [sp] + [SamplingParams(max_tokens=16, seed=i) for i in range(3)],
    )
    assert mixed[0].token_ids == alone.token_ids
    assert_pool_free(engine)


def test_cuda_decode_graphs_replay_the_eager_tokens():
    """Decode steps replay captured graphs (padded batches included) and give the tokens the
    same engine gives with --enforce-eager, in float32 (bf16 with graphs: tests/test_dtype.py,
    against transformers within its tolerance)."""
    graphed, eager = cuda_engine("tiny-llama"), cuda_engine("tiny-llama", eager=True)
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.captures == 1 and eager.runner.graphs is None
    prompts = random_prompts([5, 17, 40, 90, 3, 11, 29], seed=4)
    params = [SamplingParams(max_tokens=8 + 3 * i, temperature=0.0) for i in range(7)]
    got = graphed.generate(prompts, params)
    want = eager.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in want]
    assert graphs.replays[8] > 0 and graphs.replays[1] > 0, graphs.replays
    assert_pool_free(graphed)
    assert_pool_free(eager)


def test_cuda_prompt_logprobs_with_graphs_equal_transformers_in_one_token_chunks():
    """On a graph-capturing engine, a prompt fed one token a step beside a decode (a step the
    size of a decode-only one) is never replayed from a graph: its prompt logprobs are
    transformers'."""
    from tests.test_prompt_logprobs import one_token_chunks_beside_a_decode

    cfg = EngineConfig(
        model=ModelConfig(model="tiny-llama", device="cuda", dtype="float32"),
        cache=CacheConfig(block_size=16, num_blocks=64),
        scheduler=SchedulerConfig(2, 8, True),  # two tokens a step: a decode and one of the prompt
    )
    engine = LLMEngine(cfg, loaded("tiny-llama"))
    assert engine.runner.graphs is not None
    ask = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=2)
    one_token_chunks_beside_a_decode(engine, ask, k=2)


class _Cycle:
    """Garbage only a collection frees: it refers to itself."""

    def __init__(self, graph: torch.cuda.CUDAGraph) -> None:
        self.graph, self.me = graph, self


def test_capture_outlives_garbage_holding_a_graph(monkeypatch):
    """A collection during a capture that freed a dead engine's graphs (held in a reference
    cycle) aborted the process. Here the captured forward itself leaves such garbage (a cycle
    holding a graph with its own memory pool) and collections run at almost every allocation:
    the collector waits for the capture to end, then frees it."""
    x = torch.zeros(4, device="cuda")
    spare = [torch.cuda.CUDAGraph()]
    gc.collect()  # earlier tests' engines, before this test's own capture
    with cuda_graphs.collector_paused(), torch.cuda.graph(spare[0]):  # a pool of its own
        x.mul_(2)
    dropped: list[weakref.ref] = []
    real = cuda_graphs.forward_over

    def forward_over(model, attention, batch):
        fn = real(model, attention, batch)

        def dropping():
            if spare and torch.cuda.is_current_stream_capturing():
                dropped.append(weakref.ref(_Cycle(spare.pop())))
            return fn()

        return dropping

    monkeypatch.setattr(cuda_graphs, "forward_over", forward_over)
    threshold = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        graphed = cuda_engine("tiny-llama")
    finally:
        gc.set_threshold(*threshold)
    assert len(dropped) == 1  # the garbage was made inside a capture
    gc.collect()
    assert dropped[0]() is None
    graphs = graphed.runner.graphs
    assert graphs is not None and graphs.captures == 1
    monkeypatch.undo()
    eager = cuda_engine("tiny-llama", eager=True)
    prompts = random_prompts([5, 17, 40], seed=6)
    params = SamplingParams(max_tokens=10, temperature=0.0)
    got = graphed.generate(prompts, params)
    assert [r.token_ids for r in got] == [r.token_ids for r in eager.generate(prompts, params)]
    assert sum(graphs.replays.values()) > 0
    assert_pool_free(graphed)
    assert_pool_free(eager)


def test_a_step_that_only_prefills_returns_with_its_kernels_done(monkeypatch):
    """A chunk that samples nothing returns only once the device has run it, so that its time
    is the device's (StepStat, the router's step-time model): two layers of a Llama-3.1-8B-
    shaped model on a 1024-token chunk keep the device busy well past their launches."""
    from engine import decode_sweep
    from engine.model_runner import ModelRunner

    wide = dict(decode_sweep.SHAPES["llama-3.1-8b"], num_hidden_layers=2)
    monkeypatch.setitem(decode_sweep.SHAPES, "wide-2", wide)
    device = torch.device("cuda")
    hf = decode_sweep.random_model("wide-2", device, torch.bfloat16)
    config = EngineConfig(
        model=ModelConfig(model="wide-2", device="cuda", dtype="bfloat16"),
        cache=CacheConfig(block_size=16, num_blocks=80),
        scheduler=SchedulerConfig(max_num_batched_tokens=1024, max_num_seqs=1),
    )
    runner = ModelRunner(hf, config)
    del hf
    so = decode_sweep.decode_step(0, 0, 16, chunk=1024)  # a prompt's first 1024 tokens
    runner.execute(so)  # first call: allocations
    torch.cuda.synchronize()
    out = runner.execute(so)
    assert out.request_ids == ()  # nothing sampled
    assert torch.cuda.current_stream().query()  # and nothing left running


def test_a_worker_sharing_its_gpu_sizes_its_kv_cache_within_its_share():
    """With gpu_share 0.5 (--gpus-per-worker 0.5) the KV cache takes no more than 0.8 of half
    the device less what the process holds."""
    gc.collect()
    torch.cuda.empty_cache()  # what earlier tests' engines left is neither free nor held
    free, total = torch.cuda.mem_get_info()
    shared = LLMEngine(
        EngineConfig(
            model=ModelConfig(model="tiny-llama", device="cuda"),
            cache=CacheConfig(gpu_share=0.5),
        ),
        loaded("tiny-llama"),
    )
    kv = shared.runner.num_blocks * shared.runner.spec.bytes_per_block
    assert kv <= 0.5 * total * 0.8, (kv, total)
    # A tiny model holds little of its share: about all of it (or of what was free) is KV.
    assert kv >= min(free, 0.5 * total) * 0.8 - 2 * (1 << 30), (kv, free, total)
    del shared
    gc.collect()
    torch.cuda.empty_cache()

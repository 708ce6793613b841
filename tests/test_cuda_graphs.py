"""Decode graphs (engine/cuda_graphs.py) on the CPU: the captured function is rerun at each replay
(EagerReplay), so padding, the scratch block and the static buffers are checked without a GPU.
Greedy output must stay equal to transformers' while decode steps replay padded batches."""

import gc
import weakref

import pytest

from engine import cuda_graphs
from engine.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams
from tests.helpers import assert_pool_free, hf_greedy, loaded, random_prompts


@pytest.fixture
def replayed(monkeypatch):
    """Engines built in this test capture decode graphs, replayed eagerly."""
    monkeypatch.setattr(cuda_graphs, "capturer", lambda device: cuda_graphs.EagerReplay())


def engine(
    name: str = "tiny-llama",
    budget: int = 64,
    max_seqs: int = 12,
    chunked: bool = True,
    eager: bool = False,
    backend: str = "auto",
) -> LLMEngine:
    cfg = EngineConfig(
        model=ModelConfig(model=name, enforce_eager=eager, attention_backend=backend),
        cache=CacheConfig(block_size=4, num_blocks=160),
        scheduler=SchedulerConfig(budget, max_seqs, chunked),
    )
    return LLMEngine(cfg, loaded(name))


def test_ladder():
    assert cuda_graphs.ladder(1) == [1]
    assert cuda_graphs.ladder(5) == [1, 2, 4, 5]
    assert cuda_graphs.ladder(12) == [1, 2, 4, 8, 12]
    assert cuda_graphs.ladder(64) == [1, 2, 4, *range(8, 65, 8)]


def test_padded_decode_replays_give_transformers_greedy_tokens(replayed):
    eng = engine(backend="paged")
    graphs = eng.runner.graphs
    assert graphs is not None and graphs.captures == 1 and graphs.sizes == [1, 2, 4, 8, 12]
    scratch = eng.runner.inputs.scratch_block
    assert scratch == eng.runner.num_blocks == eng.runner.cache.num_blocks - 1
    # 7 requests decode as a padded batch of 8, then fewer as they finish (lengths differ).
    prompts = random_prompts([3, 9, 14, 21, 30, 6, 17], seed=5)
    params = [SamplingParams(max_tokens=6 + 2 * i, temperature=0.0) for i in range(7)]
    res = eng.generate(prompts, params)
    for p, sp, r in zip(prompts, params, res):
        assert list(r.token_ids) == hf_greedy("tiny-llama", p, sp.max_tokens)
    assert graphs.replays[8] > 0, graphs.replays  # 5..7 running: padded to 8
    assert graphs.replays[4] > 0 and graphs.replays[1] > 0, graphs.replays
    assert graphs.captures == 1
    assert_pool_free(eng)
    assert scratch not in eng.kv.pool.free_queue  # never handed to a request


def test_the_sdpa_backend_runs_eagerly(replayed):
    """SDPA would gather a graph's whole block-table width: no graphs with it."""
    eng = engine(backend="sdpa")
    assert eng.runner.attention.name == "sdpa" and eng.runner.graphs is None
    (res,) = eng.generate(random_prompts([7], seed=2), SamplingParams(max_tokens=6, temperature=0))
    assert list(res.token_ids) == hf_greedy("tiny-llama", random_prompts([7], seed=2)[0], 6)
    assert_pool_free(eng)


def test_steps_streaming_kv_per_layer_run_eagerly(replayed):
    """A step with a per-layer hook (a prefill worker sending KV as each layer lands) is never a
    replay: a graph would not call the hook."""
    eng = engine()
    graphs = eng.runner.graphs
    assert graphs is not None
    eng.add_request(random_prompts([6], seed=3)[0], SamplingParams(max_tokens=5, temperature=0))
    layers: list[int] = []
    steps = 0
    while eng.has_unfinished_requests():
        eng.step(on_layer=lambda i, so: layers.append(i))
        steps += 1
    assert steps == 5 and sum(graphs.replays.values()) == 0
    assert layers == list(range(eng.runner.model.num_layers)) * steps
    assert_pool_free(eng)


def test_mixed_steps_run_eagerly_and_eager_engines_capture_nothing(replayed):
    eng = engine()
    eng.runner.trace = []
    prompts = random_prompts([40, 5], seed=9)
    res = eng.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    steps = eng.runner.trace
    decode_only = [s for s in steps if not s.prefills]
    assert eng.runner.graphs is not None
    assert sum(eng.runner.graphs.replays.values()) == len(decode_only) < len(steps)
    plain = engine(eager=True)
    assert plain.runner.graphs is None
    assert plain.runner.cache.num_blocks == plain.runner.num_blocks  # no scratch block
    assert [
        r.token_ids for r in plain.generate(prompts, SamplingParams(max_tokens=8, temperature=0.0))
    ] == [r.token_ids for r in res]
    assert_pool_free(eng)
    assert_pool_free(plain)


def test_reallocated_buffers_are_captured_again(replayed):
    """An unchunked prompt longer than the budget grows the step buffers: graphs captured over
    the old ones must not be replayed (they would read stale inputs)."""
    eng = engine(budget=16, chunked=False)
    graphs = eng.runner.graphs
    assert graphs is not None
    short, long = random_prompts([5, 40], seed=11)
    (first,) = eng.generate([short], SamplingParams(max_tokens=5, temperature=0.0))
    generation = eng.runner.inputs.generation
    (second,) = eng.generate([long], SamplingParams(max_tokens=5, temperature=0.0))
    assert eng.runner.inputs.generation > generation
    assert graphs.captures == 2 and graphs.generation == eng.runner.inputs.generation
    assert list(first.token_ids) == hf_greedy("tiny-llama", short, 5)
    assert list(second.token_ids) == hf_greedy("tiny-llama", long, 5)
    assert_pool_free(eng)


def test_a_hook_asked_for_only_where_wanted_leaves_the_other_steps_to_graphs(replayed):
    """A worker that both prefills for peers and decodes passes its per-layer hook only to the
    steps that send KV (`wants_layers`): its other decode steps still replay graphs."""
    eng = engine()
    graphs = eng.runner.graphs
    assert graphs is not None
    eng.add_request(random_prompts([6], seed=3)[0], SamplingParams(max_tokens=6, temperature=0))
    layers: list[int] = []
    wanted = [True, False, False, True, False, False]  # prefill step, then decodes
    for want in wanted:
        before = sum(graphs.replays.values())
        eng.step(on_layer=lambda i, so: layers.append(i), wants_layers=lambda so, w=want: w)
        replayed_now = sum(graphs.replays.values()) - before
        assert replayed_now == (0 if want else 1)
    assert not eng.has_unfinished_requests()
    assert layers == list(range(eng.runner.model.num_layers)) * wanted.count(True)
    assert sum(graphs.replays.values()) == wanted.count(False)
    assert_pool_free(eng)


def test_a_dead_engine_with_graphs_frees_its_runner_without_a_collection(replayed):
    """The graphs hold their runner's forward weakly: no cycle keeps a dead runner's model and KV
    cache (GPU memory on CUDA) until a garbage collection."""
    e = engine()
    assert e.runner.graphs is not None and e.runner.graphs.graphs
    runner, cache = weakref.ref(e.runner), weakref.ref(e.runner.cache.layers[0])
    with cuda_graphs.collector_paused():
        del e
        assert runner() is None and cache() is None


def test_collector_paused_restores_the_collector_as_it_was():
    """Captures pause automatic garbage collection (a collection freeing CUDA objects mid-capture
    invalidates it); the collector is back on after, also when the capture raised, only once
    the last overlapping pause (another thread's capture) ended, and stays off if it was off."""
    assert gc.isenabled()
    with cuda_graphs.collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError), cuda_graphs.collector_paused():
        raise RuntimeError("capture failed")
    assert gc.isenabled()
    first, second = cuda_graphs.collector_paused(), cuda_graphs.collector_paused()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)  # overlapping, not nested: the first ends first
    assert not gc.isenabled()
    second.__exit__(None, None, None)
    assert gc.isenabled()
    gc.disable()
    try:
        with cuda_graphs.collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()

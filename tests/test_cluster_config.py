"""ClusterConfig refuses a field out of range when built (from Python as from `pdserve serve`),
by the rules of serve's options (router/option_values.py), naming the field."""

import pytest

from router.cluster_config import ClusterConfig


@pytest.mark.parametrize(
    "field, value, said",
    [
        ("threads_per_worker", 0, "an integer >= 1, got 0"),
        ("threads_per_worker", -2, "an integer >= 1, got -2"),
        ("num_decode", 1.5, "an integer >= 0, got 1.5"),
        ("num_decode", "2", "an integer >= 0, got '2'"),
        ("num_prefill", True, "an integer >= 0, got True"),
        ("max_workers", 0, "an integer >= 1, got 0"),
        ("gpus_per_worker", -1, "a number >= 0, got -1"),
        ("gpus_per_worker", 1.5, "above 1 it must be a whole number, got 1.5"),
        ("prefill_resources", {"prefill_node": -1}, "prefill_node: must be a number > 0"),
        ("decode_resources", {"GPU": 1}, "'GPU' is set by other options"),
        ("both_resources", '{"a": 1}', "must map resource names to amounts"),
        ("kv_transfer_deadline_s", 0, "a number > 0, got 0"),
        ("prefill_timeout_s", -1.0, "a number > 0, got -1.0"),
        ("control_timeout_s", 0.0, "a number > 0, got 0.0"),
        ("start_timeout_s", float("inf"), "a number > 0, got inf"),
        ("pair_timeout_s", 0, "a number > 0, got 0"),
        ("drain_timeout_s", -1, "a number >= 0, got -1"),
        ("worker_hang_timeout_s", 1, "a number >= 3, got 1 (or 0: off)"),
        ("worker_hang_timeout_s", -5, "a number >= 3, got -5 (or 0: off)"),
        ("kv_backend", "tcp", "one of auto, gloo, nccl, got 'tcp'"),
    ],
)
def test_a_field_out_of_range_is_refused_naming_it(field, value, said):
    with pytest.raises(ValueError) as caught:
        ClusterConfig(**{field: value})
    assert str(caught.value).startswith(f"{field}: "), caught.value
    assert said in str(caught.value), caught.value


def test_the_zeros_that_mean_something_are_taken():
    """A hang timeout of 0 is off, a drain timeout of 0 stops a removed worker at once, 0 GPUs
    runs on CPU."""
    c = ClusterConfig(
        worker_hang_timeout_s=0,
        drain_timeout_s=0,
        gpus_per_worker=0,
        num_prefill=0,
        prefill_resources={"prefill_node": 0.5},
        kv_backend="gloo",
    )
    assert c.worker_hang_timeout_s == 0 and c.drain_timeout_s == 0
    ClusterConfig(gpus_per_worker=0.25)
    ClusterConfig(gpus_per_worker=2)


def test_numpy_numbers_are_taken_as_python_ones():
    """A notebook's sizes often come from numpy: int64 counts and float32 times are taken, kept
    as Python's int and float (Ray's resource requests and the checks above want those)."""
    np = pytest.importorskip("numpy")
    c = ClusterConfig(
        num_decode=np.int64(2), num_prefill=np.int32(0), drain_timeout_s=np.float32(2.5)
    )
    assert (c.num_decode, c.num_prefill, c.drain_timeout_s) == (2, 0, 2.5)
    assert type(c.num_decode) is int and type(c.drain_timeout_s) is float
    with pytest.raises(
        ValueError, match=r"^num_decode: must be an integer >= 0, got np.float64\(1.5\)"
    ):
        ClusterConfig(num_decode=np.float64(1.5))
    with pytest.raises(ValueError, match=r"^num_prefill: must be an integer >= 0, got -1"):
        ClusterConfig(num_prefill=np.int64(-1))


def test_workers_sharing_a_gpu_size_their_kv_caches_within_their_share():
    """Two workers on one 80 GiB GPU (--gpus-per-worker 0.5), 10 GiB of weights each, size their
    KV caches at the same time or one after the other: together they fit the device, each gets
    about the same, and neither gets most of it. A whole GPU each keeps the fraction of the free
    memory."""
    from engine.config import CacheConfig

    gib = 1 << 30
    shares = {g: ClusterConfig(gpus_per_worker=g).pool_config().spec.engine.cache.gpu_share
              for g in (None, 0.5, 1, 2)}  # fmt: skip
    assert shares == {None: 1.0, 0.5: 0.5, 1: 1.0, 2: 1.0}
    cache = CacheConfig(gpu_share=0.5)  # gpu_memory_fraction 0.8
    total, weights = 80 * gib, 10 * gib
    # Both read the free memory after both loaded their weights, before either allocates.
    together = cache.kv_budget_bytes(total - 2 * weights, total, weights)
    assert together == (0.8 * 40 - 10) * gib  # 0.2 of the share (8 GiB) left to each
    assert 2 * (weights + together) == 0.8 * total
    # One after the other: the second sees the first's cache gone from the free memory.
    first = cache.kv_budget_bytes(total - weights, total, weights)
    second = cache.kv_budget_bytes(total - 2 * weights - int(first), total, weights)
    assert first == second == together
    # Alone on its GPU: 0.8 of what is free, as before.
    assert CacheConfig().kv_budget_bytes(70 * gib, total, weights) == 70 * gib * 0.8
    # Weights that fill 0.8 of the share leave nothing (the engine says so, naming gpu_share).
    assert cache.kv_budget_bytes(30 * gib, total, 32 * gib) == 0
    assert cache.kv_budget_said(30 * gib, total, 33 * gib) == (
        "cache.gpu_memory_fraction 0.8 of this process's cache.gpu_share 0.5 of 80.0 GiB is "
        "32.0 GiB, less the 33.0 GiB it holds (its weights): a larger share or a smaller model "
        "makes room"
    )
    # A neighbour over its share leaves less free than the share: the free memory is the bound.
    assert cache.kv_budget_bytes(5 * gib, total, 10 * gib) == 4 * gib
    assert cache.kv_budget_said(5 * gib, total, 10 * gib).startswith(
        "cache.gpu_memory_fraction 0.8 of the 5.0 GiB free of 80.0 GiB (this process holds "
        "10.0 GiB, others 65.0 GiB)"
    )
    with pytest.raises(ValueError, match=r"gpu_share must be in \(0, 1\], got 0"):
        CacheConfig(gpu_share=0)

"""Where a new worker goes (router/workers.py spread_node): the live node with room for it
holding the fewest workers that are not dead or stopped, another than the one to avoid while
another has room; none (Ray's choice) where no node has room."""

from __future__ import annotations

from router.workers import Placement, WorkerHandle, WorkerStatus, spread_node
from worker_protocol.messages import WorkerRole

ONE_GPU = {WorkerRole.DECODE: Placement(gpus=1.0)}


def node(node_id: str, alive: bool = True, **resources: float) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 4.0, **resources}}


def on(node_id: str, status: WorkerStatus = WorkerStatus.READY) -> WorkerHandle:
    return WorkerHandle("decode-0", WorkerRole.DECODE, None, 0, node_id, status)  # type: ignore[arg-type]


def test_the_fitting_node_with_the_fewest_live_workers():
    nodes = [node("a"), node("b"), node("c", alive=False)]
    assert spread_node(Placement(), nodes, [on("a")]) == "b"
    assert spread_node(Placement(), nodes, [on("a", WorkerStatus.DEAD)]) == "a"  # dead: not counted
    assert spread_node(Placement(resources=(("gpu_node", 1.0),)), nodes, []) is None


def test_a_node_whose_gpus_the_pools_hold_takes_no_more():
    """Node a's one GPU is held by a worker; b holds two workers but has room: b, though it
    holds more workers. With every GPU held, none (Ray places it once one frees up); a dead
    worker's GPU is free again."""
    gpu = Placement(gpus=1.0)
    nodes = [node("a", GPU=1.0), node("b", GPU=4.0)]
    assert spread_node(gpu, nodes, [on("a"), on("b"), on("b")], ONE_GPU) == "b"
    full = [on("a"), *(on("b") for _ in range(4))]
    assert spread_node(gpu, nodes, full, ONE_GPU) is None
    assert spread_node(gpu, nodes, [on("a", WorkerStatus.DEAD), on("b")], ONE_GPU) == "a"
    # Half a GPU each: two share one device.
    half = {WorkerRole.DECODE: Placement(gpus=0.5)}
    assert spread_node(Placement(gpus=0.5), [node("a", GPU=1.0)], [on("a")], half) == "a"
    assert spread_node(Placement(gpus=0.5), [node("a", GPU=1.0)], [on("a"), on("a")], half) is None


def test_the_node_to_avoid_is_taken_only_where_no_other_has_room():
    nodes = [node("a"), node("b")]
    assert spread_node(Placement(), nodes, [on("b")], avoid="a") == "b"  # more workers, not a
    gpu = Placement(gpus=1.0)
    gpus = [node("a", GPU=1.0), node("b", GPU=1.0)]
    assert spread_node(gpu, gpus, [on("b")], ONE_GPU, avoid="a") == "a"  # b is full
    assert spread_node(Placement(), [node("a")], [], avoid="a") == "a"

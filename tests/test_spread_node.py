"""Where a new worker goes (router/workers.py spread_node): the fitting live node holding the
fewest workers that are not dead or stopped."""

from __future__ import annotations

from router.workers import Placement, WorkerHandle, WorkerStatus, spread_node
from worker_protocol.messages import WorkerRole


def node(node_id: str, alive: bool = True, **resources: float) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {"CPU": 4.0, **resources}}


def on(node_id: str, status: WorkerStatus = WorkerStatus.READY) -> WorkerHandle:
    return WorkerHandle("decode-0", WorkerRole.DECODE, None, 0, node_id, status)  # type: ignore[arg-type]


def test_the_fitting_node_with_the_fewest_live_workers():
    nodes = [node("a"), node("b"), node("c", alive=False)]
    assert spread_node(Placement(), nodes, [on("a")]) == "b"
    assert spread_node(Placement(), nodes, [on("a", WorkerStatus.DEAD)]) == "a"  # dead: not counted
    assert spread_node(Placement(resources=(("gpu_node", 1.0),)), nodes, []) is None

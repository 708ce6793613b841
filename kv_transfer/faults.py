"""Faults a connector injects into the transfers it sends, so that tests and benchmarks can prove
what a failure costs and that nothing hangs or leaks. Nothing sets a FaultPlan by default: only a
test, a bench option or an explicit TorchDistConfig does.

  DROP     the send's layers never go out: both sides end it at its deadline (TIMEOUT);
  DELAY    the send waits `delay_s` before its first layer (past its deadline, if longer);
  CORRUPT  one bit of the first layer's message is flipped after its checksum was taken (in the
           message copy, never in the cache): the receiver finds the layer CORRUPT;
  BREAK    the pair breaks after `after_layers` layers went out (both sides: PEER_DEAD);
  KILL     this process exits after `after_layers` layers went out (the peer: PEER_DEAD).
`every` picks which sends are struck: the n-th, 2n-th, ... this connector starts. A struck send
carries the mark on its own record (Transfer.fault), so nothing here outlives it.
"""

from __future__ import annotations

import enum
import itertools
import logging
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from kv_transfer.table import Transfer

log = logging.getLogger("pdserve.kv_faults")


class FaultKind(enum.Enum):
    DROP = "drop"
    DELAY = "delay"
    CORRUPT = "corrupt"
    BREAK = "break"
    KILL = "kill"


@dataclass(frozen=True, slots=True)
class FaultPlan:
    kind: FaultKind
    every: int = 1
    after_layers: int = 1  # BREAK, KILL
    delay_s: float = 0.0  # DELAY

    def __post_init__(self) -> None:
        if self.every < 1 or self.after_layers < 1 or self.delay_s < 0:
            raise ValueError("FaultPlan: need every >= 1, after_layers >= 1, delay_s >= 0")


class FaultInjector:
    """One connector's faults. `started` runs where a send is registered; the rest on its lanes'
    sender threads."""

    def __init__(self, plan: FaultPlan) -> None:
        self.plan = plan
        self._count = itertools.count(1)
        self._lock = threading.Lock()
        self.injected = 0  # sends struck so far

    def started(self, rec: Transfer) -> None:
        with self._lock:
            if next(self._count) % self.plan.every == 0:
                rec.fault = True
                self.injected += 1

    def _hit(self, rec: Transfer, kind: FaultKind) -> bool:
        return rec.fault and self.plan.kind is kind

    def before_layers(self, rec: Transfer) -> bool:
        """Before a LAYER message of `rec`: False to send nothing (DROP). DELAY sleeps before
        the first one."""
        if self._hit(rec, FaultKind.DROP):
            return False
        if self._hit(rec, FaultKind.DELAY) and rec.fault_layers == 0:
            rec.fault_layers = 1
            log.warning("fault injection: delaying a send by %.1f s", self.plan.delay_s)
            time.sleep(self.plan.delay_s)
        return True

    def needs_copy(self, rec: Transfer) -> bool:
        """A CORRUPT send's first message goes through staging: the cache stays intact."""
        return self._hit(rec, FaultKind.CORRUPT) and rec.fault_layers == 0

    def corrupt(self, rec: Transfer, data: torch.Tensor) -> None:
        """Flip one bit of a struck send's first message (a staging copy, after its checksum)."""
        if self.needs_copy(rec):
            rec.fault_layers = 1
            data.reshape(-1).view(torch.uint8)[0] ^= 1
            log.warning("fault injection: corrupted a layer message")

    def one_layer_per_message(self, rec: Transfer) -> bool:
        """A send struck to BREAK or KILL after some layers goes out a layer at a time, so that
        the fault lands between layers (grouped, a whole KV may leave in one message)."""
        return rec.fault and self.plan.kind in (FaultKind.BREAK, FaultKind.KILL)

    def sent(self, rec: Transfer, layers: int, break_pair: Callable[[str], None]) -> None:
        """`layers` more layers of `rec` went out: BREAK or KILL once there are enough."""
        kind = self.plan.kind
        if not rec.fault or kind not in (FaultKind.BREAK, FaultKind.KILL):
            return
        rec.fault_layers += layers
        if rec.fault_layers < self.plan.after_layers:
            return
        rec.fault = False  # once
        if kind is FaultKind.KILL:
            log.warning("fault injection: killing this process mid-transfer")
            os._exit(17)
        log.warning("fault injection: breaking the pair mid-transfer")
        break_pair("fault injection: the pair broke mid-transfer")

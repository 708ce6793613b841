"""The fault suite's ledger: every test in tests/fault/ books the faults it injected and the
requests it sent, and how each ended; the session ends with one line that says whether anything
was lost (no answer and no status by its deadline)."""

from __future__ import annotations

from dataclasses import dataclass

import pytest


@dataclass
class Ledger:
    injected: int = 0
    sent: int = 0
    completed: int = 0
    failed: int = 0  # ended with a status (an error the client saw), not silently

    def add(self, injected: int = 0, sent: int = 0, completed: int = 0, failed: int = 0) -> None:
        self.injected += injected
        self.sent += sent
        self.completed += completed
        self.failed += failed

    @property
    def lost(self) -> int:
        return self.sent - self.completed - self.failed

    def line(self) -> str:
        return (
            f"faults injected {self.injected}, requests sent {self.sent}, completed "
            f"{self.completed}, failed with a status {self.failed}, lost {self.lost}"
        )


LEDGER = Ledger()


@pytest.fixture
def ledger() -> Ledger:
    return LEDGER


def pytest_terminal_summary(terminalreporter, exitstatus, config):  # noqa: ARG001
    if LEDGER.injected or LEDGER.sent:
        terminalreporter.write_line(LEDGER.line())

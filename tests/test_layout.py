"""Imports flow one way (DESIGN.md, layout): the engine imports none of the serving packages, and
the bench, a client of the server like any other, imports none of the server's. Every import
counts, at the top of a module or inside a function."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SERVER = {"engine", "kv_transfer", "prefill_worker", "decode_worker", "both_worker",
          "worker_protocol", "router"}  # fmt: skip
FORBIDDEN = {
    "engine": SERVER - {"engine"} | {"bench", "pdserve_client"},
    "bench": SERVER,
}


def _imported(path: Path) -> set[str]:
    tops = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            tops |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            tops.add(node.module.split(".")[0])
    return tops


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_only_what_the_layout_allows(package):
    wrong = {
        str(path.relative_to(ROOT)): sorted(_imported(path) & FORBIDDEN[package])
        for path in sorted((ROOT / package).rglob("*.py"))
    }
    assert {p: names for p, names in wrong.items() if names} == {}

"""What `pip install` puts on the path: every top-level package of the repository (but the tests)
is named by pyproject.toml's package list, so an installed pdserve imports all of its parts."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_every_package_is_installed():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = config["tool"]["setuptools"]["packages"]["find"]["include"]
    packages = sorted(p.parent.name for p in ROOT.glob("*/__init__.py"))
    assert "worker_protocol" in packages
    missing = [
        p for p in packages if p != "tests" and not any(fnmatch.fnmatch(p, g) for g in patterns)
    ]
    assert not missing, f"not in pyproject.toml's package list: {missing}"

"""How a benchmark's figures were made, recorded at the top of its JSON: the command line, the
commit of this checkout (None outside a git checkout) and whether tracked files differed from
it, the host, and when it started. A benchmark takes it as it starts (`provenance`) and writes
its figures after it (`write_json`): the engine, transfer and router benches. `pdserve bench`
records the same fields with its own (bench/session.py): it is a client of the server, and
imports none of the server's packages (DESIGN.md, layout)."""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Mapping
from datetime import UTC, datetime
from pathlib import Path
from typing import Any


def provenance() -> dict[str, Any]:
    """How this run was made (see the module docstring)."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], cwd=Path(__file__).parent, timeout=5,
                                  capture_output=True, text=True, check=True)  # fmt: skip
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip()

    commit = git("rev-parse", "HEAD")
    changed = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {
        "command": shlex.join([Path(sys.argv[0]).name, *sys.argv[1:]]),
        "commit": commit,
        "changed": bool(changed) if changed is not None else None,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform()},
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
    }


def write_json(path: str | Path, result: Mapping[str, Any], made: Mapping[str, Any]) -> None:
    """`result` after how it was made (`made`: provenance() as the run started), as indented
    JSON at `path`."""
    Path(path).write_text(json.dumps({**made, **result}, indent=2) + "\n")

"""A run's liveness marker: ``<run dir>/.launcher.json``, the launcher's own state of the run
(running / interrupted / completed / failed, with its pid). The launcher (``fl-dp-flower run``)
writes it; ``fl-dp-flower watch`` reads it beside the ledger. The ledger stays the ServerApp's
alone: the launcher never writes into it. Standard library only.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

MARKER = ".launcher.json"


def write_marker(run_dir: Path, state: str, **extra: Any) -> None:
    """Record the launcher's state of the run (atomic replace, owner-only)."""
    if not run_dir.is_dir():
        return
    data = {"state": state, "pid": os.getpid(), "time": datetime.now(UTC).isoformat(), **extra}
    tmp = run_dir / f"{MARKER}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f)
    os.replace(tmp, run_dir / MARKER)


def read_marker(run_dir: Path) -> dict[str, Any] | None:
    """The launcher's marker, with ``alive`` = whether its launcher process still runs (None: none)."""
    try:
        data = json.loads((run_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict):
        return None
    pid = data.get("pid")
    data["alive"] = isinstance(pid, int) and _alive(pid)
    return data


def _alive(pid: int) -> bool:
    """The launcher ``pid`` still runs (a reused pid of another program does not count)."""
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return False
    return b"fl-dp-flower" in cmdline or b"fl_dp_flower" in cmdline

"""End to end: a real ``flwr run . --stream`` of 2 rounds in the simulation engine (slow, ~30-60 s).

Isolation: a temporary ``FLWR_HOME`` and free ports for the managed local SuperLink, runtime
dependency installation off (the venv is used as is, no network). ``flwr run --stream`` exits
0 even when the run fails, so the run's status is read back with ``flwr list``. The detached
SuperLink this test started (found by its ``--log-file`` inside our ``FLWR_HOME``) is killed
with its process group at the end.
"""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from fl_dp_flower.reporting import read_ledger

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _superlink_pids(flwr_home: Path) -> list[int]:
    """PIDs of flower-superlink processes whose command line points into ``flwr_home``."""
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "flower-superlink" in cmd and str(flwr_home) in cmd:
            pids.append(int(proc.name))
    return pids


def _kill_superlink(flwr_home: Path) -> None:
    for pid in _superlink_pids(flwr_home):
        try:
            pgid = os.getpgid(pid)
            target = (lambda sig: os.killpg(pgid, sig)) if pgid == pid else (lambda sig: os.kill(pid, sig))
            target(signal.SIGTERM)
            deadline = time.time() + 15
            while time.time() < deadline and pid in _superlink_pids(flwr_home):
                time.sleep(0.3)
            if pid in _superlink_pids(flwr_home):
                target(signal.SIGKILL)
        except ProcessLookupError:
            pass


def _find_status(obj) -> str | None:
    if isinstance(obj, dict):
        if isinstance(obj.get("status"), str):
            return obj["status"]
        values = obj.values()
    elif isinstance(obj, list):
        values = obj
    else:
        return None
    for v in values:
        found = _find_status(v)
        if found:
            return found
    return None


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_flwr_run_two_rounds(tmp_path):
    flwr_home = tmp_path / "flwr-home"
    out_dir = tmp_path / "out"
    env = {
        **os.environ,
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        "FLWR_HOME": str(flwr_home),
        "FLWR_TELEMETRY_ENABLED": "0",
        "FLWR_DISABLE_UPDATE_CHECK": "1",
        "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
        "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
        "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port()),
    }
    run_config = (
        "num-server-rounds=2 clients-per-round=3 num-partitions=3 local-steps=2 batch-size=16 "
        f"sigma=0.5 seed=0 round-timeout=300.0 run-name='e2e' output-dir='{out_dir}'"
    )
    cmd = [str(BIN / "flwr"), "run", str(ROOT), "--stream",
           "--federation-config", "num-supernodes=3 client-resources-num-cpus=1",
           "--run-config", run_config]
    t0 = time.time()
    try:
        proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
        wall = time.time() - t0
        output = ANSI.sub("", proc.stdout + proc.stderr)
        print(f"\nflwr run --stream (2 rounds, 3 supernodes) wall time: {wall:.1f}s")
        assert proc.returncode == 0, output[-4000:]
        match = re.search(r"Successfully started run (\d+)", output)
        assert match, output[-4000:]
        run_id = match.group(1)

        listed = subprocess.run([str(BIN / "flwr"), "list", "--run-id", run_id, "--format", "json"],
                                cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
        status = _find_status(json.loads(ANSI.sub("", listed.stdout)))
        assert status == "finished:completed", f"status {status!r}\n{output[-4000:]}"

        run_dir = out_dir / "e2e"
        ledger = read_ledger(run_dir / "ledger.jsonl")
        assert [r["round"] for r in ledger.rounds] == [1, 2]
        eps = [r["report"]["certified"]["epsilon"] for r in ledger.rounds]
        assert 0 < eps[0] < eps[1]
        assert all(sorted(r["record"]["node_ids"]) == sorted(ledger.rounds[0]["record"]["node_ids"])
                   and len(r["record"]["node_ids"]) == 3 for r in ledger.rounds)
        for name in ("final_model.pt", "summary.json", "privacy.png", "model-latest.pt"):
            assert (run_dir / name).exists(), name
        assert "certified" in output  # the per-round log line reached the run's log stream
    finally:
        _kill_superlink(flwr_home)
    assert _superlink_pids(flwr_home) == []

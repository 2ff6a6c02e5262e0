"""tests/deploy_harness.py's waits on a loaded machine: a ``flwr`` call may take as long as it
keeps making progress, and fails only after ``quiet`` seconds without any (stub ``flwr``
executables in a private bin folder; no Flower process is started)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from deploy_harness import Federation


def _stub_bin(tmp_path: Path, script: str) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "flwr"
    stub.write_text(f"#!{sys.executable}\nimport sys, time\n{script}\n")
    stub.chmod(0o755)
    return bin_dir


def test_a_slow_cli_call_that_keeps_printing_is_waited_for(tmp_path):
    """Slower in all than ``quiet`` (a 60 s fixed timeout was the old rule), but never quiet that long."""
    bin_dir = _stub_bin(tmp_path, "for i in range(8):\n    print(i, flush=True); time.sleep(0.5)\nprint('{\"ok\": 1}')")
    fed = Federation(tmp_path / "fed", supernode_keys=1, bin_dir=bin_dir)
    t0 = time.monotonic()
    r = fed.cli("ls", quiet=2.0)
    assert r.returncode == 0 and r.stdout.splitlines()[-1] == '{"ok": 1}'
    assert time.monotonic() - t0 > 2.0


def test_a_stuck_cli_call_fails_after_quiet_seconds_and_is_killed(tmp_path):
    bin_dir = _stub_bin(tmp_path, "import os\nprint(os.getpid(), flush=True)\ntime.sleep(600)")
    fed = Federation(tmp_path / "fed", supernode_keys=1, bin_dir=bin_dir)
    with pytest.raises(TimeoutError, match=r"`flwr supernode ls` to return \(\d+s without progress\)"):
        fed.cli("supernode", "ls", quiet=1.0)
    # the stub was killed (its pid is gone or a zombie reaped by the harness)
    stat = Path("/proc")
    assert not any(p.name.isdigit() and "flwr" in _cmd(p) and str(bin_dir) in _cmd(p) for p in stat.iterdir())


def _cmd(proc_dir: Path) -> str:
    try:
        return (proc_dir / "cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_progress_of_the_federation_counts_too(tmp_path):
    """A silent call is still waited for while a process log of the federation grows."""
    bin_dir = _stub_bin(tmp_path, "time.sleep(3)\nprint('done')")
    fed = Federation(tmp_path / "fed", supernode_keys=1, bin_dir=bin_dir)
    log = fed.workdir / "superlink.log"
    proc = fed.spawn("superlink", [sys.executable, "-c",
                                   "import time\nfor i in range(40):\n    print(i, flush=True); time.sleep(0.25)"],
                     "superlink")
    try:
        r = fed.cli("ls", quiet=1.5)
        assert r.stdout.strip() == "done" and log.stat().st_size > 0
    finally:
        proc.popen.kill()
        proc.popen.wait(10)
        proc.fh.close()

"""The launcher without Flower: resilient status calls (a stub ``flwr`` that sleeps or fails),
resume refusals decided from the ledger at once, the final status line, the launcher's marker,
and the private SuperLink's port check. Real-Flower runs are in tests/integration/test_main_job.py."""

from __future__ import annotations

import argparse
import io
import json
import os
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fl_dp_flower.app.launcher import Runner, UsageError, make_plan
from fl_dp_flower.app.local_flower import StatusPoller, listening_pids
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.reporting import PrivacyLedger
from fl_dp_flower.reporting.watch import RunView, render
from fl_dp_flower.app.run_output import shortfall_text
from fl_dp_flower.run_marker import read_marker, write_marker


def _args(tmp_path: Path, *overrides: str, preset: str = "quick", resume: bool = False) -> argparse.Namespace:
    return argparse.Namespace(overrides=list(overrides), preset=preset, run_name="r", output_dir=str(tmp_path / "out"),
                              resume=resume, supernodes=None, allow_fixed_seed=False)


def _ledger(tmp_path: Path, rounds: int, *, open_round: bool = False, preset: str = "quick") -> Path:
    """A ledger as the ServerApp writes it for run 'r' of ``preset`` (real accountant numbers)."""
    config = make_plan(_args(tmp_path, preset=preset)).config
    path = tmp_path / "out" / "r" / "ledger.jsonl"
    acct_cfg = config.accountant_config()
    accountant = PrivacyAccountant(acct_cfg)
    with PrivacyLedger.create(path, accountant_config=acct_cfg.to_dict(), app_config=config.to_run_config()) as ledger:
        for t in range(1, rounds + 1):
            record = acct_cfg.planned_round(t)
            ledger.append_event("round-open", {"round": t})
            ledger.append_round(round=t, record=record.to_dict(), report=accountant.step(record).to_dict(),
                                metrics={"accuracy": 0.5, "loss": 1.0})
        if open_round:
            ledger.append_event("round-open", {"round": rounds + 1})
    return path


def _stub_flwr(folder: Path, body: str) -> Path:
    """An executable ``flwr`` in ``folder`` running the Python ``body``."""
    folder.mkdir(parents=True, exist_ok=True)
    stub = folder / "flwr"
    stub.write_text(f"#!{sys.executable}\nimport sys, time\n{body}\n")
    stub.chmod(stub.stat().st_mode | stat.S_IXUSR)
    return stub


FINISHED = 'print(\'{"success": true, "runs": [{"run-id": 7, "status": "finished:completed"}]}\')'


# ------------------------------------------------------------------ status calls
def test_status_poller_never_blocks_and_backs_off_on_a_hanging_flwr(tmp_path):
    stub = _stub_flwr(tmp_path / "bin", "time.sleep(60)")
    poller = StatusPoller([str(stub), "ls"], dict(os.environ), tmp_path, interval=0.2, call_timeout=1.0)
    slowest, start = 0.0, time.monotonic()
    while poller.failures < 2 and time.monotonic() - start < 120:
        t0 = time.monotonic()
        assert poller.poll() == {}
        slowest = max(slowest, time.monotonic() - t0)
        time.sleep(0.05)
    poller.close()
    assert poller.failures == 2 and "no answer within 1s" in poller.last_error
    assert slowest < 0.5  # a hanging call never holds the caller (it follows the ledger meanwhile)
    assert 0.4 < poller.next_in <= 0.8  # backoff: interval x 2^2


def test_status_poller_recovers_after_failures(tmp_path):
    flag = tmp_path / "ok"
    stub = _stub_flwr(tmp_path / "bin", f"import os\nif not os.path.exists({str(flag)!r}):\n"
                                        "    print('Error: connection refused'); sys.exit(1)\n" + FINISHED)
    poller = StatusPoller([str(stub), "ls"], dict(os.environ), tmp_path, interval=0.05, call_timeout=30)
    deadline = time.monotonic() + 120
    while poller.failures < 2 and time.monotonic() < deadline:
        poller.poll()
        time.sleep(0.02)
    assert "exited 1: Error: connection refused" in poller.last_error
    flag.touch()
    while not poller.poll() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert poller.latest["status"] == "finished:completed" and poller.failures == 0


def test_follow_keeps_printing_rounds_while_status_calls_hang_then_fail(tmp_path):
    """The launcher's follow loop with a stub ``flwr`` that hangs, then fails, then answers:
    every round line appears while the status is unknown, the failure is said in one line, and
    no traceback reaches the output."""
    plan = make_plan(_args(tmp_path, "num-server-rounds=3"))
    home = tmp_path / "home"
    home.mkdir()
    phase = tmp_path / "phase"
    phase.write_text("hang")
    stub_dir = tmp_path / "bin"
    _stub_flwr(stub_dir, f"phase = open({str(phase)!r}).read()\n"
                         "if phase == 'hang': time.sleep(60)\n"
                         "if phase != 'done': print('Traceback (most recent call last): boom'); sys.exit(1)\n"
                         + FINISHED)
    # a stand-in SuperLink process of this home (the follow loop checks that one is alive)
    superlink = stub_dir / "flower-superlink"
    superlink.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(600)\n")
    superlink.chmod(0o755)
    proc = subprocess.Popen([str(superlink)], env={**os.environ, "FLWR_HOME": str(home.resolve())})
    out = io.StringIO()
    runner = Runner(plan, flwr_home=home, out=out, poll=0.05, status_timeout=1.0)
    runner.flower.bin = stub_dir
    runner.run_id = "7"
    result: dict = {}
    thread = threading.Thread(target=lambda: result.update(runner.follow()), daemon=True)
    try:
        thread.start()
        path = _ledger(tmp_path, 3)  # the rounds arrive while the status call hangs
        deadline = time.monotonic() + 120
        while out.getvalue().count("round ") < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        phase.write_text("fail")
        while "status call failed" not in out.getvalue() and time.monotonic() < deadline:
            time.sleep(0.05)
        assert thread.is_alive()  # still following
        phase.write_text("done")
        thread.join(120)
        assert result.get("status") == "finished:completed"
    finally:
        proc.kill()
        proc.wait()
    text = out.getvalue()
    assert [line[:11] for line in text.splitlines() if line.startswith("round ")] == \
        ["round   1/3", "round   2/3", "round   3/3"]
    assert "Flower's status call failed" in text and "still following the ledger" in text
    assert "Traceback" not in text.replace("exited 1: Traceback (most recent call last): boom", "")
    assert path.exists()


# ------------------------------------------------------------------ resume, decided at once
def test_resume_with_another_preset_is_refused_before_anything_starts(tmp_path):
    _ledger(tmp_path, 2, preset="quick")
    t0 = time.monotonic()
    with pytest.raises(UsageError, match=r"--resume: cannot resume .*accountant config differs.*preset"):
        make_plan(_args(tmp_path, preset="main", resume=True))
    assert time.monotonic() - t0 < 30  # no Flower start-up (38-56 s before): the ledger decides


def test_resume_of_an_open_round_needs_account_and_is_refused_at_once(tmp_path):
    _ledger(tmp_path, 2, open_round=True)
    with pytest.raises(UsageError, match="round 3 .* resume-unfinished-round='account'"):
        make_plan(_args(tmp_path, "num-server-rounds=5", resume=True))
    plan = make_plan(_args(tmp_path, "num-server-rounds=5 resume-unfinished-round='account'", resume=True))
    assert plan.config.resume


def test_resume_with_every_round_accounted_is_refused(tmp_path):
    _ledger(tmp_path, 3)
    with pytest.raises(UsageError, match="all 3 rounds are already accounted"):
        make_plan(_args(tmp_path, "num-server-rounds=3", resume=True))
    assert make_plan(_args(tmp_path, "num-server-rounds=4", resume=True)).num_rounds == 4


# ------------------------------------------------------------------ output and marker
def test_shortfall_names_planned_and_accounted_rounds():
    assert shortfall_text({"num_server_rounds": 10, "rounds_accounted": 10}) == ""
    assert shortfall_text({"num_server_rounds": 10, "rounds_accounted": 4, "stop_reason": "budget"}) == \
        "; ended with 4 of 10 planned rounds (budget)"
    assert shortfall_text({"planned_rounds": 6, "accounted_rounds": 5, "num_server_rounds": 9,
                           "rounds_accounted": 9}) == "; ended with 5 of 6 planned rounds (see Flower's log)"


def test_watch_says_interrupted_after_ctrl_c_and_stopped_when_the_launcher_is_gone(tmp_path):
    path = _ledger(tmp_path, 2)
    run_dir = path.parent
    view = RunView()
    from fl_dp_flower.reporting.watch import LedgerFollower
    for entry in LedgerFollower(path).poll():
        view.add(entry)

    def status_text() -> str:
        from rich.console import Console
        console = Console(file=io.StringIO(), width=300)
        console.print(render(view, path))
        return console.file.getvalue()

    def set_marker(state: str, pid: int, **extra) -> None:
        write_marker(run_dir, state, **extra)
        marker = json.loads((run_dir / ".launcher.json").read_text())
        (run_dir / ".launcher.json").write_text(json.dumps({**marker, "pid": pid}))

    assert "running (or stopped without an end line)" in status_text()  # no launcher: as before
    launcher = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)", "fl-dp-flower", "run"])
    deadline = time.monotonic() + 60
    while b"fl-dp-flower" not in Path(f"/proc/{launcher.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
        time.sleep(0.05)  # until its exec is done
    try:
        set_marker("running", launcher.pid)
        assert read_marker(run_dir)["alive"], read_marker(run_dir)
        assert "[running;" in status_text(), status_text()
        set_marker("interrupted", launcher.pid, why="SIGINT received")
        assert "interrupted (SIGINT received)" in status_text()
    finally:
        launcher.kill()
        launcher.wait()
    set_marker("running", launcher.pid)  # its launcher died without a word (SIGKILL, a reboot)
    assert not read_marker(run_dir)["alive"] and "stopped (its launcher is gone" in status_text()
    set_marker("running", os.getpid())  # a pid reused by another program is no launcher
    assert "stopped (its launcher is gone" in status_text()


def test_listening_pids_names_the_process_that_holds_the_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert listening_pids(port, [os.getpid(), 1]) == [os.getpid()]
    assert listening_pids(port, [os.getpid()]) == []


@pytest.mark.parametrize("opened,expected", [(False, True), (True, False)])
def test_a_ray_startup_timeout_before_any_round_is_retried_only_when_nothing_was_broadcast(tmp_path, opened,
                                                                                           expected):
    """Ray waits a fixed 30 s for its raylet; on a busy machine a run can fail there. The launcher
    submits again (resuming the header-only ledger) only if no round was opened."""
    plan = make_plan(_args(tmp_path, "num-server-rounds=3"))
    path = _ledger(tmp_path, 0)
    if opened:
        with PrivacyLedger.resume(path, accountant_config=plan.config.accountant_config().to_dict()) as ledger:
            ledger.append_event("round-open", {"round": 1})
    stub_dir = tmp_path / "bin"
    _stub_flwr(stub_dir, "print('Exception: The current node timed out during startup. This could happen ...')")
    runner = Runner(plan, flwr_home=tmp_path / "home", out=io.StringIO())
    runner.flower.bin = stub_dir
    runner.run_id = "7"
    assert runner.ray_did_not_start({"status": "finished:failed"}) is expected
    assert not runner.ray_did_not_start({"status": "finished:completed"})


def test_a_run_whose_ledger_ended_is_decided_from_the_ledger_when_status_calls_keep_failing(tmp_path, monkeypatch):
    from fl_dp_flower.app import launcher
    monkeypatch.setattr(launcher, "END_PATIENCE", 1.0)
    plan = make_plan(_args(tmp_path, "num-server-rounds=2"))
    path = _ledger(tmp_path, 2)

    def the_run_ends() -> None:  # after the launcher started following
        time.sleep(1.0)
        with PrivacyLedger.resume(path, accountant_config=plan.config.accountant_config().to_dict()) as ledger:
            ledger.append_event("end", {"rounds_accounted": 2})
        (path.parent / "summary.json").write_text("{}")

    home, stub_dir = tmp_path / "home", tmp_path / "bin"
    home.mkdir()
    _stub_flwr(stub_dir, "print('Error: connection refused'); sys.exit(1)")
    superlink = stub_dir / "flower-superlink"
    superlink.write_text(f"#!{sys.executable}\nimport time\ntime.sleep(600)\n")
    superlink.chmod(0o755)
    proc = subprocess.Popen([str(superlink)], env={**os.environ, "FLWR_HOME": str(home.resolve())})
    try:
        runner = Runner(plan, flwr_home=home, out=io.StringIO(), poll=0.05, status_timeout=5.0)
        runner.flower.bin = stub_dir
        runner.run_id = "7"
        threading.Thread(target=the_run_ends, daemon=True).start()
        info = runner.follow()
    finally:
        proc.kill()
        proc.wait()
    assert info["status"] == "finished:completed"
    assert "decided from the ledger's 'end' event" in info["status-details"]
    assert "connection refused" in info["status-details"]

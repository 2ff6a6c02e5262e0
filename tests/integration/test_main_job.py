"""The README's quick start and the first hour after it, through the real script
``bash scripts/main-job.sh`` (Flower's simulation engine via ``flwr run``; slow ones ~1 min each):

- the quick start, word for word: trains, ends ``finished:completed``, and its whole output is
  a round line per round plus the summary (no Flower dumps, warnings or tracebacks);
- Ctrl-C (SIGINT) stops the training for good, stops every process the script started, and
  says what was spent, read from the ledger; the run can then be resumed by name;
- bad overrides end in about a second with one message naming the key, before anything starts;
- two runs started at the same time on one machine each get their own SuperLink and Flower home:
  both complete, each with its own ledger, and neither leaves a process behind.

Waits are bounded by progress (new output, ledger growth), not by a quiet machine's timings.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path

import pytest

from deploy_harness import wait_until
from fl_dp_flower.app.launcher import ROUND_LINES, processes_of, pyproject_run_config
from fl_dp_flower.app.presets import PRESETS
from fl_dp_flower.reporting import read_ledger

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ["bash", str(ROOT / "scripts" / "main-job.sh")]
QUIET = 240.0


def _env(flwr_home: Path | None, tmp: Path | None = None) -> dict[str, str]:
    """The job's environment: no fixed SuperLink port (each run picks its own); ``flwr_home``
    names the Flower home (else a private temporary one under ``tmp``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLWR_LOCAL_")}
    if flwr_home is not None:
        env["FL_DP_FLWR_HOME"] = str(flwr_home)
    if tmp is not None:
        tmp.mkdir(parents=True, exist_ok=True)
        env["TMPDIR"] = str(tmp)
    return env


@pytest.fixture
def short_tmp():
    """A short TMPDIR for a job (Ray puts its AF_UNIX sockets under it: at most 107 bytes a path)."""
    folder = Path(tempfile.mkdtemp(prefix="fldp-", dir="/tmp"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _homes_under(folder: Path) -> dict[int, str]:
    """Live processes whose FLWR_HOME lies in ``folder`` (the launcher's private homes): pid -> home."""
    needle = f"FLWR_HOME={folder.resolve()}/".encode()
    found = {}
    for d in Path("/proc").iterdir():
        try:
            environ = (d / "environ").read_bytes() if d.name.isdigit() else b""
        except OSError:
            continue
        if needle in environ:
            found[int(d.name)] = environ.split(b"FLWR_HOME=")[1].split(b"\0")[0].decode()
    return found


class Job:
    """``main-job.sh`` as a child process whose output lines are collected as they come."""

    def __init__(self, args: list[str], flwr_home: Path | None, tmp: Path | None = None) -> None:
        self.lines: list[str] = []
        self.proc = subprocess.Popen(SCRIPT + args, cwd=ROOT, env=_env(flwr_home, tmp), stdout=subprocess.PIPE,
                                     stderr=subprocess.STDOUT, text=True, start_new_session=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait(self, what: str = "main-job.sh to exit") -> int:
        wait_until(lambda: self.proc.poll() is not None, QUIET, what, interval=0.5, progress=lambda: len(self.lines))
        self._reader.join(10)
        return self.proc.returncode

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


def _no_leftovers(flwr_home: Path) -> None:
    wait_until(lambda: not processes_of(flwr_home), 30, "the job's processes to be gone")


# ------------------------------------------------------------------ quick start
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_quick_start_word_for_word(short_tmp):
    before = set((ROOT / "outputs").iterdir()) if (ROOT / "outputs").exists() else set()
    job = Job([], None, short_tmp)  # `bash scripts/main-job.sh`, exactly as the README says
    rc = job.wait()
    made = sorted(set((ROOT / "outputs").iterdir()) - before)
    try:
        assert rc == 0, job.text[-4000:]
        print(f"\n{len(job.lines)} lines of output:\n{job.text}")
        total = PRESETS["main"]["num-server-rounds"]  # 100: round 1 and every 5th (k = ceil(100 / 20))
        every = math.ceil(total / ROUND_LINES)
        rounds = [line for line in job.lines if re.match(rf"round +\d+/{total} \|", line)]
        assert len(rounds) == 1 + total // every and "ETA" in rounds[-1] and "certified eps" in rounds[-1]
        assert "clients 4000" in rounds[-1]
        table_start = next(i for i, line in enumerate(job.lines) if "Privacy summary" in line)
        assert table_start <= 28, job.text  # what comes before the summary fits on one screen
        assert len(job.lines) <= table_start + 26 and f"12 of {total} rounds shown" in job.text
        for noise in ("Traceback", "WARNING", "Aggregated MetricRecord", "Final results", "setuptools",
                      "FutureWarning", "simulated SuperNodes changed"):
            assert noise not in job.text, noise
        assert len(made) == 1
        run_dir = made[0]
        listed = re.search(r"outputs: (\S+) \((.*)\)", job.text)
        assert listed and Path(listed.group(1)) == run_dir
        files = listed.group(2).split(", ")
        assert files == sorted(p.name for p in run_dir.iterdir() if not p.name.startswith(".")) and \
            "model-latest.pt" in files
        assert json.loads((run_dir / ".launcher.json").read_text())["state"] == "completed"
        assert "privacy.png" in files and "flower.log" in files and "flower-strategy.log" in files
        assert "Aggregated MetricRecord" in (run_dir / "flower-strategy.log").read_text()  # Flower's dumps ...
        flower_log = (run_dir / "flower.log").read_text()
        assert "Aggregated MetricRecord" not in flower_log and "round 10 |" in flower_log  # ... not in `flwr log`
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["rounds_accounted"] == total and summary["final_accuracy"] > 0.7
        assert summary["final_report"]["certified"]["epsilon"] < 4.0
        assert f"finished:completed; privacy spent: {total} rounds accounted" in job.text
        # cohort mode in `flwr run`: the ledger counts members (4,000 virtual clients), not the 10 nodes
        assert "4000 clients per round, 10 simulated SuperNodes x 400 clients each (cohorts)" in job.text
        for entry in read_ledger(run_dir / "ledger.jsonl").rounds:
            ids = entry["record"]["node_ids"]
            assert len(ids) == len(set(ids)) == 4000 and entry["report"]["clients"] == 4000
            assert entry["record"]["weights"] == pytest.approx([1 / 4000] * 4000)
            assert len({i // 400 for i in ids}) == 10  # member id = node id x 400 + slot: every node's cohort
        wait_until(lambda: not _homes_under(short_tmp), 30, "the job's processes to be gone")
        assert not list(short_tmp.glob("fl-dp-flower-*"))  # its private Flower home is removed
    finally:
        for d in made:
            shutil.rmtree(d, ignore_errors=True)


# ------------------------------------------------------------------ Ctrl-C, then resume
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_ctrl_c_stops_training_and_the_run_resumes_by_name(tmp_path):
    home, out = tmp_path / "flwr-home", tmp_path / "out"
    job = Job(["--preset", "quick", "--run-name", "long", "--output-dir", str(out), "num-server-rounds=40"], home)
    ledger = out / "long" / "ledger.jsonl"

    def two_rounds_shown():
        return sum(1 for line in job.lines if re.match(r"round +\d+/40 \|", line)) >= 2

    def signs_of_life():  # a slow first round still writes logs and starts processes
        sizes = tuple(p.stat().st_size for p in (ledger, home / "local-superlink" / "superlink.log") if p.exists())
        return len(job.lines), sizes, len(processes_of(home))

    wait_until(two_rounds_shown, QUIET, "round 2 on the terminal", interval=0.2, progress=signs_of_life)
    os.kill(job.proc.pid, signal.SIGINT)  # bash exec'd the launcher: this is what Ctrl-C reaches
    rc = job.wait("the interrupted job to exit")
    assert rc == 130, job.text[-3000:]
    _no_leftovers(home)
    contents = read_ledger(ledger)
    done = len(contents.rounds)
    assert 2 <= done < 40
    cert = contents.rounds[-1]["report"]["certified"]["epsilon"]
    assert "SIGINT received: stopping the run" in job.text
    spent = re.search(r"privacy spent: (\d+) rounds accounted, certified eps (\S+) ", job.text)
    assert spent and int(spent.group(1)) == done and float(spent.group(2)) == pytest.approx(cert, rel=1e-3)
    size = ledger.stat().st_size
    time.sleep(10)
    assert ledger.stat().st_size == size and not processes_of(home)  # nothing keeps training

    resumed = Job(["--preset", "quick", "--run-name", "long", "--output-dir", str(out), "--resume",
                   f"num-server-rounds={done + 2} resume-unfinished-round='account'"], home)
    assert resumed.wait() == 0, resumed.text[-3000:]
    contents = read_ledger(ledger)
    assert [r["round"] for r in contents.rounds] == list(range(1, done + 3))
    assert contents.rounds[-1]["report"]["certified"]["epsilon"] > cert
    assert "resume" in [e["event"] for e in contents.events]
    _no_leftovers(home)


# ------------------------------------------------------------------ two runs at once
@pytest.mark.slow
@pytest.mark.timeout(1500)
def test_two_runs_at_once_on_one_machine_keep_to_themselves(tmp_path, short_tmp):
    """Two quick-preset runs (2 rounds each) started together, each with the launcher's default
    private SuperLink: both complete with their own ledger and the accountant's numbers."""
    from fl_dp_flower.app.config import AppConfig
    from fl_dp_flower.privacy.accountant import PrivacyAccountant

    out, tmp = tmp_path / "out", short_tmp
    jobs = {name: Job(["--preset", "quick", "--run-name", name, "--output-dir", str(out), "num-server-rounds=2"],
                      None, tmp) for name in ("first", "second")}
    wait_until(lambda: len(set(_homes_under(tmp).values())) == 2 or any(j.proc.poll() is not None
                                                                        for j in jobs.values()),
               QUIET, "both runs to start", progress=lambda: sum(len(j.lines) for j in jobs.values()))
    assert len(set(_homes_under(tmp).values())) == 2  # both live at once, each in its own Flower home
    for name, job in jobs.items():
        assert job.wait(f"run {name} to exit") == 0, job.text[-3000:]
    config = AppConfig.from_run_config({**pyproject_run_config(), **PRESETS["quick"], "num-server-rounds": 2})
    expected = PrivacyAccountant(config.accountant_config())
    for t in (1, 2):
        expected.step(config.accountant_config().planned_round(t))
    for name, job in jobs.items():
        contents = read_ledger(out / name / "ledger.jsonl")
        assert [r["round"] for r in contents.rounds] == [1, 2]
        assert all(r["report"]["clients"] == 10 for r in contents.rounds)
        cert = contents.rounds[-1]["report"]["certified"]["epsilon"]
        assert cert == pytest.approx(expected.report().certified.epsilon, rel=1e-9)
        assert f"finished:completed; privacy spent: 2 rounds accounted, certified eps {cert:.4g}" in job.text
    wait_until(lambda: not _homes_under(tmp), 30, "the jobs' processes to be gone")
    assert not list(tmp.glob("fl-dp-flower-*"))


# ------------------------------------------------------------------ config errors
@pytest.mark.parametrize("override,words", [
    ("sigma=-1", ["'sigma' = -1", "a finite number > 0"]),
    ("lr2=0.1", ["unknown run-config key 'lr2'; did you mean 'lr'"]),
    ("lr=abc", ["'lr' = abc: not a valid value", "lr='abc'"]),
    ("run-name='a' run-name='b'", ["'run-name' is given twice"]),
    ("seed=3", ["'seed' = 3", "--allow-fixed-seed"]),
])
def test_bad_overrides_fail_fast_naming_the_key(tmp_path, override, words):
    home = tmp_path / "flwr-home"
    r = subprocess.run(SCRIPT + ["--output-dir", str(tmp_path / "out"), override], cwd=ROOT, env=_env(home),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    message = r.stderr.strip()
    for w in words:
        assert w in message, message
    assert "Traceback" not in r.stdout + r.stderr and r.stdout == ""
    assert len(message.splitlines()) <= 3
    assert not home.exists() and not (tmp_path / "out").exists()  # nothing started


def test_resume_of_an_unknown_run_names_the_ledger(tmp_path):
    r = subprocess.run(SCRIPT + ["--run-name", "nope", "--output-dir", str(tmp_path), "--resume"], cwd=ROOT,
                       env=_env(tmp_path / "home"), capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and f"no ledger at {tmp_path / 'nope' / 'ledger.jsonl'}" in r.stderr



"""``fl-dp-flower run``: the main job in Flower's simulation engine, with readable output.

What ``scripts/main-job.sh`` runs. It

1. validates the run-config overrides against :class:`~fl_dp_flower.app.config.AppConfig` *before*
   anything starts (about a second; errors name the key, unknown keys get close-match
   suggestions, and no traceback is printed);
2. starts a private local SuperLink for this run (its own free port and Flower home, so two runs
   on one machine never share or stop each other's processes: :mod:`fl_dp_flower.app.local_flower`)
   and submits ``flwr run <app> --run-config <file.toml>`` to it (one TOML file of overrides: no
   shell quoting, no duplicate keys), saying what it waits for when that takes long;
3. follows the run through its privacy ledger: one line per round with accuracy, the running
   certified epsilon and an ETA (a progress bar too, on a terminal), then the summary table.
   Flower's status calls run in the background and are retried with backoff (a slow machine
   delays them, never crashes the launcher). Flower's own log goes to ``<run dir>/flower.log``;
4. checks the run's final status (``flwr run`` reports success even for failed runs) and exits
   non-zero unless it is ``finished:completed``; says when a run ended with fewer rounds than
   planned;
5. on Ctrl-C (SIGINT) or SIGTERM: ``flwr stop`` s the run, stops every process of its private
   SuperLink, and prints what was spent, read from the ledger. A second Ctrl-C kills at once.

The launcher's own state of the run (running, interrupted, completed, failed, with its pid) is
``<run dir>/.launcher.json`` (:mod:`fl_dp_flower.run_marker`), read by ``fl-dp-flower watch``; the
ledger is written by the ServerApp only.

A resume is checked against the ledger before anything starts (the ServerApp's own rules:
:meth:`PrivacyLedger.check_resumable` for a changed accountant config such as another preset,
an open round under ``resume-unfinished-round = 'refuse'``, all rounds already accounted).

Only the standard library, pydantic (config) and rich: no torch, no flwr import (Flower is
driven through its CLI, as a user would).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from fl_dp_flower import FlDpError
from fl_dp_flower.app.local_flower import (ANSI, FlowerStartError, LocalFlower, StatusPoller, cmdline, parse_json_output,
                           processes_of, stop_processes)
from fl_dp_flower.app.presets import PRESETS
from fl_dp_flower.app.run_output import round_line, shortfall_text, spent_text
from fl_dp_flower.run_marker import write_marker
from fl_dp_flower.app.run_plan import ROOT, Plan, UsageError, make_plan, parse_overrides, pyproject_run_config, to_toml

__all__ = ["Plan", "Runner", "UsageError", "make_plan", "parse_overrides", "processes_of", "pyproject_run_config",
           "to_toml"]

STOP_GRACE = 30.0  # seconds a stopped run gets to end before its processes are killed
ROUND_LINES = 20  # a longer run prints every k-th round line (k = ceil(rounds / 20)) and its last
SUMMARY_ROWS = 12  # the final table shows at most this many rounds (all are in the ledger)
SUBMIT_PATIENCE = 900.0  # seconds a running `flwr run` may take to hand the app over
QUIET_NOTE = 120.0  # seconds without a new round before the launcher says what it waits for
END = ("end", "failed")  # the ServerApp's last ledger events of a run
END_PATIENCE = 300.0  # seconds after the ledger's end the launcher waits for Flower's status before deciding
RAY_ATTEMPTS = 3  # submissions when Ray's startup times out before the first round (a busy machine)
RAY_START_FAILURE = "The current node timed out during startup"  # ray/_private/node.py (Ray 2.x)


# ------------------------------------------------------------------ the run
class Interrupted(FlDpError):
    """SIGINT/SIGTERM arrived."""


class Runner:
    """Submit one run to a private local SuperLink, follow its ledger, report, clean up."""

    def __init__(self, plan: Plan, *, app_dir: Path = ROOT, flwr_home: Path | None = None,
                 out=sys.stdout, poll: float = 0.5, status_timeout: float = 120.0) -> None:
        self.plan, self.app_dir, self.out, self.poll = plan, app_dir, out, poll
        self.flower = LocalFlower(flwr_home, say=self.say)
        self.status_timeout = status_timeout
        self.run_id: str | None = None
        self._signals = 0
        if plan.allow_fixed_seed:
            self.flower.env["FL_DP_ALLOW_FIXED_SEED"] = "1"
        else:
            self.flower.env.pop("FL_DP_ALLOW_FIXED_SEED", None)

    @property
    def flwr_home(self) -> Path:
        return self.flower.home

    @property
    def ledger(self) -> Path:
        return self.plan.run_dir / "ledger.jsonl"

    # -------------------------------------------------------------- helpers
    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess | None:
        """A blocking ``flwr`` call; None (and one line said) when it timed out or could not run."""
        try:
            return self.flower.flwr(*args, cwd=self.app_dir, timeout=timeout)
        except (subprocess.TimeoutExpired, OSError) as err:
            self.say(f"`flwr {args[0]}` gave no answer ({type(err).__name__}); going on without it")
            return None

    def status_poller(self, interval: float = 2.0) -> StatusPoller:
        return StatusPoller([str(self.flower.bin / "flwr"), "ls", "--run-id", str(self.run_id), "--format", "json"],
                            self.flower.env, self.app_dir, interval=interval, call_timeout=self.status_timeout)

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals += 1
        if self._signals > 1:  # impatient: kill now
            stop_processes(self.flwr_home, grace=2.0)
            os._exit(130)
        raise Interrupted(signal.Signals(signum).name)

    # -------------------------------------------------------------- phases
    def submit(self, overrides: dict[str, Any] | None = None) -> str:
        """``flwr run``, saying what it waits for while it takes long; returns the run id."""
        self.plan.run_dir.parent.mkdir(parents=True, exist_ok=True)
        fd, name = tempfile.mkstemp(suffix=".toml", prefix="run-config-")
        with os.fdopen(fd, "w") as f:
            f.write(to_toml(self.plan.overrides if overrides is None else overrides))
        federation = f"num-supernodes={self.plan.supernodes} client-resources-num-cpus=1"
        command = [str(self.flower.bin / "flwr"), "run", str(self.app_dir), "--format", "json", "--run-config", name,
                   "--federation-config", federation]
        try:
            with tempfile.TemporaryFile("w+") as output:
                proc = subprocess.Popen(command, env=self.flower.env, cwd=self.app_dir, stdout=output,
                                        stderr=subprocess.STDOUT, text=True)
                start = last_said = time.monotonic()
                while proc.poll() is None:
                    now = time.monotonic()
                    if now - start > SUBMIT_PATIENCE:
                        proc.kill()
                        proc.wait()
                        raise RuntimeError(f"flwr run gave no answer within {SUBMIT_PATIENCE:.0f}s")
                    if now - last_said >= 15.0:
                        last_said = now
                        self.say(f"submitting: waiting for `flwr run` to build the app and hand it to the local "
                                 f"SuperLink ({now - start:.0f} s; the machine is busy)")
                    time.sleep(0.2)
                output.seek(0)
                text = output.read()
        finally:
            os.unlink(name)
        data = parse_json_output(text)
        if proc.returncode != 0 or not data.get("success") or not data.get("run-id"):
            raise RuntimeError(f"flwr run did not start the run (exit {proc.returncode}):\n"
                               f"{ANSI.sub('', text)[-2000:]}")
        return str(data["run-id"])

    def follow(self) -> dict[str, Any]:
        """Print each new ledger round until the run's status is finished; returns the status.

        Status calls run in the background (:class:`StatusPoller`): a slow or failing one is
        said once, retried with backoff, and the ledger is followed meanwhile. A SuperLink that
        is gone ends the follow with status ``unknown``; a run whose ledger ended while the status
        calls kept failing for ``END_PATIENCE`` seconds is decided from the ledger (completed only
        with an ``end`` event and a summary).
        """
        from fl_dp_flower.reporting.ledger import read_ledger  # no matplotlib: reporting/ledger/ only
        shown, failures_said, last_alive_check, last_news = 0, 0, time.monotonic(), time.monotonic()
        ends_before: int | None = None
        ended_at: float | None = None
        progress = self._progress()
        poller = self.status_poller()

        def emit(line: str) -> None:
            if progress is not None:
                progress[0].console.print(line, highlight=False)
            else:
                self.say(line)
        try:
            while True:
                try:
                    contents = read_ledger(self.ledger) if self.ledger.exists() else None
                except (OSError, ValueError):
                    contents = None
                rounds = contents.rounds if contents is not None else []
                ends = [e["event"] for e in (contents.events if contents is not None else []) if e.get("event") in END]
                ends_before = len(ends) if ends_before is None else ends_before  # a resumed ledger's old ends
                every = math.ceil(self.plan.num_rounds / ROUND_LINES)
                for i, entry in enumerate(rounds[shown:], start=shown + 1):
                    if entry["round"] % every == 0 or entry["round"] in (1, self.plan.num_rounds):
                        emit(round_line(entry, i, rounds, self.plan.num_rounds))
                    if progress is not None:
                        progress[0].update(progress[1], completed=entry["round"])
                now = time.monotonic()
                if len(rounds) > shown:
                    shown, last_news = len(rounds), now
                info = poller.poll()
                if str(info.get("status", "")).startswith("finished"):
                    return info
                ended_at = (ended_at or now) if len(ends) > ends_before else None
                if ended_at is not None and poller.failures and now - ended_at > END_PATIENCE:
                    done = ends[-1] == "end" and (self.plan.run_dir / "summary.json").exists()
                    return {"status": "finished:completed" if done else "finished:failed",
                            "status-details": f"decided from the ledger's '{ends[-1]}' event; Flower's status call "
                                              f"kept failing ({poller.last_error})"}
                if poller.failures and poller.failures != failures_said and poller.failures in (1, 3, 6, 10):
                    emit(f"Flower's status call failed ({poller.last_error}); retrying in {poller.next_in:.0f} s, "
                         "still following the ledger")
                failures_said = poller.failures
                if now - last_news >= QUIET_NOTE:
                    last_news = now
                    emit(f"waiting for round {shown + 1} (run {self.run_id} {info.get('status', 'status unknown')}"
                         f"; {QUIET_NOTE:.0f} s without a new round)")
                if now - last_alive_check >= 10.0:
                    last_alive_check = now
                    if not any("flower-superlink" in cmdline(p) for p in processes_of(self.flwr_home)):
                        return {"status": "unknown", "status-details": "the local SuperLink exited"}
                time.sleep(self.poll)
        finally:
            poller.close()
            if progress is not None:
                progress[0].stop()

    def _progress(self):
        if not self.out.isatty():
            return None
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn
        p = Progress(TextColumn("rounds"), BarColumn(), MofNCompleteColumn(), TextColumn("ETA"),
                     TimeRemainingColumn(), transient=True)
        task = p.add_task("rounds", total=self.plan.num_rounds)
        p.start()
        return p, task

    def ray_did_not_start(self, info: dict[str, Any]) -> bool:
        """The run failed because Ray's startup timed out (Ray waits 30 s, fixed, for its raylet)
        before any round was opened, so no upload was made and no privacy spent."""
        from fl_dp_flower.reporting.ledger import read_ledger
        if not str(info.get("status", "")).startswith("finished:failed"):
            return False
        if self.ledger.exists():
            try:
                contents = read_ledger(self.ledger)
            except (OSError, ValueError):
                return False
            if contents.rounds or contents.open_round is not None:
                return False
        r = self.flwr("log", str(self.run_id), "--show", timeout=120)
        return r is not None and RAY_START_FAILURE in r.stdout + r.stderr

    def save_flower_log(self) -> Path | None:
        if self.run_id is None or not self.plan.run_dir.exists():
            return None
        r = self.flwr("log", str(self.run_id), "--show", timeout=120)
        if r is None:
            return None
        path = self.plan.run_dir / "flower.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(ANSI.sub("", r.stdout + r.stderr))
        return path

    def interrupted(self, why: str) -> int:
        self.say(f"\n{why}: stopping the run")
        signal.signal(signal.SIGINT, self._on_signal)
        killed = stop_processes(self.flwr_home, spare_superlink=True)  # training ends now
        if self.run_id is not None:
            self.flwr("stop", str(self.run_id), timeout=60)  # the SuperLink records it as stopped
            poller, deadline = self.status_poller(interval=1.0), time.monotonic() + STOP_GRACE
            while time.monotonic() < deadline and not str(poller.poll().get("status", "")).startswith("finished"):
                time.sleep(0.2)
            poller.close()
        killed += stop_processes(self.flwr_home)
        write_marker(self.plan.run_dir, "interrupted", run_id=self.run_id, why=why)
        self.say(f"stopped run {self.run_id or '(not started)'} and {len(killed)} processes")
        self.save_flower_log()
        self.say(spent_text(self.ledger))
        self.say(f"outputs so far: {self.plan.run_dir}")
        return 130

    def finish(self, info: dict[str, Any]) -> int:
        log = self.save_flower_log()
        status = info.get("status", "unknown")
        summary_path = self.plan.run_dir / "summary.json"
        summary: dict[str, Any] = {}
        if summary_path.exists():
            from fl_dp_flower.reporting.console import render_summary
            from fl_dp_flower.reporting.ledger import read_ledger
            try:
                summary = json.loads(summary_path.read_text())
            except (OSError, ValueError):
                summary = {}
            history = [{"round": e["round"], "report": e["report"], "metrics": e.get("metrics", {})}
                       for e in read_ledger(self.ledger).rounds]
            if history:
                self.say(render_summary(history, max_rows=SUMMARY_ROWS))
        for warning in summary.get("warnings", []):  # e.g. a final accuracy near chance
            self.say(warning)
        short = shortfall_text(summary)
        write_marker(self.plan.run_dir, "completed" if status == "finished:completed" else "failed",
                     run_id=self.run_id, status=status)
        if status != "finished:completed":
            self.say(f"run {self.run_id} {status}: {info.get('status-details') or 'no details'}{short}")
            self.say(spent_text(self.ledger))
            if log is not None:
                self.say(f"Flower's log: {log}")
            return 1
        self.say(f"run {self.run_id} finished:completed{short}; {spent_text(self.ledger)}")
        files = [p.name for p in sorted(self.plan.run_dir.iterdir()) if p.is_file() and not p.name.startswith(".")]
        self.say(f"outputs: {self.plan.run_dir} ({', '.join(files)})")
        return 0

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                c = self.plan.config
                cohort = f" x {c.clients_per_node} clients each (cohorts)" if c.clients_per_node > 1 else ""
                self.say(f"run '{c.run_name}': {self.plan.num_rounds} rounds, {c.clients_per_round} clients per "
                         f"round, {self.plan.supernodes} simulated SuperNodes{cohort}; outputs in {self.plan.run_dir}")
                from fl_dp_flower.app.preflight import preflight
                for note in preflight(c):  # calibrated sigma, budget stop, noise warning
                    self.say(note)
                self.flower.start(cwd=self.app_dir)
                self.run_id = self.submit()
                self.plan.run_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
                write_marker(self.plan.run_dir, "running", run_id=self.run_id)
                self.say(f"started run {self.run_id}; certified = the sound bound for threat model "
                         f"'{c.threat_model}', epsilon at delta {c.delta:g} (plus the screening drops' charge, "
                         "docs/MATH.md §17.1: a round line names the delta when that charge is not negligible); "
                         "Flower's log goes to "
                         f"{self.plan.run_dir / 'flower.log'}")
                info = self.follow()
                for attempt in range(2, RAY_ATTEMPTS + 1):
                    if not self.ray_did_not_start(info):
                        break
                    self.say(f"Ray did not start in time (the machine is busy) and nothing was broadcast; submitting "
                             f"again (attempt {attempt} of {RAY_ATTEMPTS})")
                    resume = self.ledger.exists()  # the ledger's header is kept: the run resumes it
                    self.run_id = self.submit({**self.plan.overrides, **({"resume": True} if resume else {})})
                    write_marker(self.plan.run_dir, "running", run_id=self.run_id)
                    info = self.follow()
                return self.finish(info)
            except Interrupted as why:
                return self.interrupted(f"{why} received")
        finally:
            try:
                self.flower.close()  # the private SuperLink and all it started
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)


# ------------------------------------------------------------------ CLI
def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="run-config overrides, e.g. \"sigma=0.1 schedule='stage'\" (strings in quotes)")
    parser.add_argument("--preset", choices=tuple(PRESETS), default="main",
                        help="main: 4,000 clients per round at certified epsilon < 4; quick: 10 clients, 10 rounds")
    parser.add_argument("--run-name", default=None, help="run folder name (default: main-<date>-<time>)")
    parser.add_argument("--output-dir", default=None, help="folder of run folders (default: ./outputs)")
    parser.add_argument("--resume", action="store_true", help="continue the run --run-name from its ledger")
    parser.add_argument("--supernodes", type=int, default=None,
                        help="simulated SuperNodes, one data partition each (default: num-partitions)")
    parser.add_argument("--allow-fixed-seed", action="store_true",
                        help="let the simulated nodes accept seed >= 0 (reproducible noise: experiments only)")


def main(args: argparse.Namespace, *, out=sys.stdout) -> int:
    try:
        plan = make_plan(args)
    except UsageError as err:
        print(f"fl-dp-flower run: {err}", file=sys.stderr)
        return 2
    home = os.environ.get("FL_DP_FLWR_HOME")  # tests: an isolated local SuperLink state
    try:
        return Runner(plan, out=out, flwr_home=Path(home) if home else None).run()
    except (RuntimeError, FlowerStartError) as err:
        print(f"fl-dp-flower run: {err}", file=sys.stderr)
        return 1


def cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fl-dp-flower run", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return main(parser.parse_args(argv))

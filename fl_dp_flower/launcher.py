"""``fl-dp-flower run``: the main job in Flower's simulation engine, with readable output.

What ``scripts/main-job.sh`` runs. It

1. validates the run-config overrides against :class:`~fl_dp_flower.config.AppConfig` *before*
   anything starts (about a second; errors name the key, unknown keys get close-match
   suggestions, and no traceback is printed);
2. submits ``flwr run <app> --run-config <file.toml>`` to a local SuperLink kept under
   ``.flwr-home/`` (one TOML file of overrides: no shell quoting, no duplicate keys);
3. follows the run through its privacy ledger: one line per round with accuracy, the running
   certified epsilon and an ETA (a progress bar too, on a terminal), then the summary table.
   Flower's own log goes to ``<run dir>/flower.log``, not to the terminal;
4. checks the run's final status (``flwr run`` reports success even for failed runs) and exits
   non-zero unless it is ``finished:completed``;
5. on Ctrl-C (SIGINT) or SIGTERM: ``flwr stop`` s the run, stops every process it started
   (the SuperLink, SuperExec, ``flwr-simulation`` and Ray, found by their ``FLWR_HOME``), and
   prints what was spent, read from the ledger. A second Ctrl-C kills at once.

Only the standard library, pydantic (config) and rich: no torch, no flwr import (Flower is
driven through its CLI, as a user would).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from .presets import PRESETS

ROOT = Path(__file__).resolve().parents[1]
ANSI = re.compile(r"\x1b\[[0-9;]*m")
#: Flower's own split of a ``--run-config`` string into pairs (flwr/common/config.py).
_PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")
STOP_GRACE = 30.0  # seconds a stopped run gets to end before its processes are killed
ROUND_LINES = 20  # a longer run prints every k-th round line (k = ceil(rounds / 20)) and its last
SUMMARY_ROWS = 12  # the final table shows at most this many rounds (all are in the ledger)


class UsageError(ValueError):
    """Bad overrides or flags: reported in one message, exit status 2, before anything starts."""


# ------------------------------------------------------------------ overrides
def parse_overrides(text: str) -> dict[str, Any]:
    """A ``--run-config`` string as Flower splits it, one TOML value per key; errors name the key.

    Raises UsageError for a value that is not TOML (``lr=abc``), a key given twice, or text
    that is not ``key=value``.
    """
    out: dict[str, Any] = {}
    rest = _PAIR.sub(" ", text).strip()
    if rest:
        raise UsageError(f"cannot read {rest!r} in the overrides: write key=value pairs separated by spaces "
                         "(strings in quotes: run-name='x')")
    for key, raw in _PAIR.findall(text):
        if key in out:
            raise UsageError(f"'{key}' is given twice in the overrides")
        try:
            out[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            raise UsageError(f"'{key}' = {raw}: not a valid value; write strings in quotes ({key}='{raw}'), "
                             "numbers as 0.1 or 10, booleans as true/false") from None
    return out


def to_toml(values: dict[str, Any]) -> str:
    """Flat ``key = value`` TOML of run-config values (str, bool, int, float)."""
    lines = []
    for key, value in values.items():
        if isinstance(value, str):
            text = json.dumps(value)  # a TOML basic string is a JSON string for these characters
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            raise UsageError(f"'{key}' = {value!r}: not a run-config value")
        lines.append(f'"{key}" = {text}')
    return "\n".join(lines) + "\n"


def pyproject_run_config(app_dir: Path = ROOT) -> dict[str, Any]:
    """The ``[tool.flwr.app.config]`` defaults of the app."""
    return tomllib.loads((app_dir / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


@dataclass(frozen=True)
class Plan:
    """A validated main-job run: what to submit and where its outputs go."""

    overrides: dict[str, Any]
    run_dir: Path
    supernodes: int
    allow_fixed_seed: bool
    num_rounds: int
    config: Any  # AppConfig


def make_plan(args: argparse.Namespace, *, app_dir: Path = ROOT, now: datetime | None = None) -> Plan:
    """Validate flags + overrides against AppConfig (raises UsageError with the message to print)."""
    from .config import AppConfig, ConfigError  # pydantic: imported only when a run is planned

    overrides = parse_overrides(" ".join(args.overrides))
    for key, flag in (("run-name", "--run-name"), ("output-dir", "--output-dir"), ("resume", "--resume")):
        if key in overrides and getattr(args, flag[2:].replace("-", "_")) not in (None, False):
            raise UsageError(f"'{key}' is set both as {flag} and in the overrides: keep one")
    from .config import with_auto_sigma
    overrides = {**PRESETS[args.preset], **with_auto_sigma(overrides)}  # target-epsilon alone picks sigma
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    overrides.setdefault("run-name", args.run_name or f"main-{stamp}")
    out_dir = Path(str(overrides.get("output-dir") or args.output_dir or "outputs")).expanduser()
    overrides["output-dir"] = str(out_dir if out_dir.is_absolute() else (Path.cwd() / out_dir).resolve())
    if args.resume:
        overrides["resume"] = True
    from .preflight import preflight
    try:
        config = AppConfig.from_run_config({**pyproject_run_config(app_dir), **overrides})
        preflight(config)  # a budget that fits no round is refused now, not after the run starts
    except ConfigError as err:
        raise UsageError(str(err)) from None
    run_dir = Path(config.output_dir) / config.run_name
    ledger = run_dir / "ledger.jsonl"
    if config.resume and not ledger.exists():
        raise UsageError(f"--resume: there is no ledger at {ledger}; check --run-name and --output-dir")
    if not config.resume and ledger.exists():
        raise UsageError(f"run '{config.run_name}' already has a ledger at {ledger}: pass --resume to continue "
                         "it, or choose another --run-name")
    if config.seed >= 0 and not args.allow_fixed_seed:
        raise UsageError(f"'seed' = {config.seed} makes every client's noise reproducible (whoever knows the seed "
                         "can subtract it); nodes refuse it unless allowed: pass --allow-fixed-seed for an "
                         "experiment, or leave seed = -1")
    supernodes = args.supernodes or config.num_partitions
    if supernodes * config.clients_per_node < config.clients_per_round:
        raise UsageError(f"--supernodes {supernodes} x 'clients-per-node' = {config.clients_per_node} offer fewer "
                         f"clients than 'clients-per-round' = {config.clients_per_round}")
    return Plan(overrides, run_dir, supernodes, bool(args.allow_fixed_seed), config.num_server_rounds, config)


# ------------------------------------------------------------------ processes
def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def processes_of(flwr_home: Path) -> list[int]:
    """Live processes started for this FLWR_HOME (SuperLink, SuperExec, flwr-simulation, Ray)."""
    needle = f"FLWR_HOME={flwr_home}\0".encode()
    me = os.getpid()
    return [int(d.name) for d in Path("/proc").iterdir()
            if d.name.isdigit() and int(d.name) != me and _environ_has(int(d.name), needle)]


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def stop_processes(flwr_home: Path, grace: float = 10.0, *, spare_superlink: bool = False) -> list[int]:
    """SIGTERM every process of ``flwr_home``, SIGKILL what is left after ``grace`` seconds.

    ``spare_superlink``: stop only what trains (SuperExec, ``flwr-simulation``, Ray), so that the
    SuperLink can still record the run as stopped.
    """
    def targets() -> list[int]:
        pids = processes_of(flwr_home)
        return [p for p in pids if not (spare_superlink and "flower-superlink" in _cmdline(p))]

    victims = targets()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in targets():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while targets() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not targets():
            break
    return victims


# ------------------------------------------------------------------ the run
class Interrupted(Exception):
    """SIGINT/SIGTERM arrived."""


class Runner:
    """Submit one run, follow its ledger, report, and clean up whatever happens."""

    def __init__(self, plan: Plan, *, app_dir: Path = ROOT, flwr_home: Path | None = None,
                 out=sys.stdout, poll: float = 0.5) -> None:
        self.plan, self.app_dir, self.out, self.poll = plan, app_dir, out, poll
        self.flwr_home = (flwr_home or app_dir / ".flwr-home").resolve()
        self.bin = Path(sys.executable).parent
        self.run_id: str | None = None
        self._signals = 0
        self.env = {**os.environ, "FLWR_HOME": str(self.flwr_home), "FLWR_TELEMETRY_ENABLED": "0",
                    "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                    "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONWARNINGS": "ignore"}
        if plan.allow_fixed_seed:
            self.env["FL_DP_ALLOW_FIXED_SEED"] = "1"
        else:
            self.env.pop("FL_DP_ALLOW_FIXED_SEED", None)

    # -------------------------------------------------------------- helpers
    def say(self, text: str = "") -> None:
        print(text, file=self.out, flush=True)

    def flwr(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([str(self.bin / "flwr"), *args], env=self.env, cwd=self.app_dir,
                              capture_output=True, text=True, timeout=timeout)

    def status(self) -> dict[str, Any]:
        """``flwr ls --run-id`` as a dict (empty when it cannot be read)."""
        r = self.flwr("ls", "--run-id", str(self.run_id), "--format", "json")
        text = ANSI.sub("", r.stdout)
        try:
            runs = json.loads(text[text.find("{"):text.rfind("}") + 1]).get("runs", [])
        except ValueError:
            return {}
        return runs[0] if runs else {}

    def _on_signal(self, signum: int, frame: Any) -> None:
        self._signals += 1
        if self._signals > 1:  # impatient: kill now
            stop_processes(self.flwr_home, grace=2.0)
            os._exit(130)
        raise Interrupted(signal.Signals(signum).name)

    # -------------------------------------------------------------- phases
    def submit(self) -> str:
        self.plan.run_dir.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", suffix=".toml", prefix="run-config-", delete=False) as f:
            f.write(to_toml(self.plan.overrides))
        try:
            r = self.flwr("run", str(self.app_dir), "--format", "json", "--run-config", f.name,
                          "--federation-config",
                          f"num-supernodes={self.plan.supernodes} client-resources-num-cpus=1", timeout=300)
        finally:
            os.unlink(f.name)
        text = ANSI.sub("", r.stdout)
        try:
            data = json.loads(text[text.find("{"):text.rfind("}") + 1])
        except ValueError:
            data = {}
        if r.returncode != 0 or not data.get("success") or "run-id" not in data:
            raise RuntimeError(f"flwr run did not start the run (exit {r.returncode}):\n"
                               f"{ANSI.sub('', r.stdout + r.stderr)[-2000:]}")
        return str(data["run-id"])

    def follow(self) -> dict[str, Any]:
        """Print each new ledger round until the run's status is finished; returns the status."""
        from .reporting.ledger import read_ledger  # no matplotlib: reporting/ledger.py only
        ledger = self.plan.run_dir / "ledger.jsonl"
        shown, last_status_poll, info = 0, 0.0, {}
        progress = self._progress()
        try:
            while True:
                try:
                    rounds = read_ledger(ledger).rounds if ledger.exists() else []
                except (OSError, ValueError):
                    rounds = []
                every = math.ceil(self.plan.num_rounds / ROUND_LINES)
                for i, entry in enumerate(rounds[shown:], start=shown + 1):
                    show = entry["round"] % every == 0 or entry["round"] in (1, self.plan.num_rounds)
                    line = self.round_line(entry, i, rounds) if show else None
                    if progress is not None:
                        if line:
                            progress[0].console.print(line, highlight=False)
                        progress[0].update(progress[1], completed=entry["round"])
                    elif line:
                        self.say(line)
                shown = len(rounds)
                if time.monotonic() - last_status_poll > 2.0:
                    last_status_poll = time.monotonic()
                    info = self.status()
                    if str(info.get("status", "")).startswith("finished"):
                        return info
                time.sleep(self.poll)
        finally:
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

    def round_line(self, entry: dict, index: int, rounds: list) -> str:
        """One ledger round as a terminal line (index: 1-based position in ``rounds``)."""
        report, metrics = entry["report"], entry.get("metrics", {})
        cert = report["certified"]
        paper = report["bounds"]["paper"]
        acc = metrics.get("accuracy")
        done, total = entry["round"], self.plan.num_rounds
        eta = ""
        if index >= 2:  # rate between the ledger times of the first and this round (no start-up)
            spent = _seconds_between(rounds[0].get("time"), entry.get("time"))
            if spent is not None:
                eta = f" | ETA {spent / (index - 1) * max(total - done, 0):.0f}s"
        paper_text = "" if paper.get("sound") else f" | paper {_num(paper['epsilon'])} (not a guarantee)"
        return (f"round {done:>3}/{total} | clients {report['clients']:>3} | acc "
                f"{'  -  ' if acc is None else f'{acc:.3f}'} | certified eps {_num(cert['epsilon'])} "
                f"({cert['bound']}){paper_text}{eta}")

    def save_flower_log(self) -> Path | None:
        if self.run_id is None or not self.plan.run_dir.exists():
            return None
        r = self.flwr("log", str(self.run_id), "--show", timeout=60)
        path = self.plan.run_dir / "flower.log"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(ANSI.sub("", r.stdout + r.stderr))
        return path

    def spent_text(self) -> str:
        from .reporting.ledger import read_ledger
        ledger = self.plan.run_dir / "ledger.jsonl"
        try:
            contents = read_ledger(ledger)
        except (OSError, ValueError) as err:
            return f"could not read the ledger {ledger}: {err}"
        if not contents.rounds:
            return f"no round was accounted (ledger {ledger})"
        cert = contents.rounds[-1]["report"]["certified"]
        text = (f"privacy spent: {len(contents.rounds)} rounds accounted, certified eps "
                f"{_num(cert['epsilon'])} (mu {_num(cert['mu'])}, {cert['bound']}) at delta "
                f"{contents.rounds[-1]['report']['delta']:g}")
        if contents.open_round is not None:
            text += (f"; round {contents.open_round} was under way (resume with --resume and "
                     "resume-unfinished-round='account' to account it)")
        return text

    def interrupted(self, why: str) -> int:
        self.say(f"\n{why}: stopping the run")
        signal.signal(signal.SIGINT, self._on_signal)
        killed = stop_processes(self.flwr_home, spare_superlink=True)  # training ends now
        if self.run_id is not None:
            self.flwr("stop", str(self.run_id), timeout=60)  # the SuperLink records it as stopped
            deadline = time.monotonic() + STOP_GRACE
            while time.monotonic() < deadline and not str(self.status().get("status", "")).startswith("finished"):
                time.sleep(1.0)
        killed += stop_processes(self.flwr_home)
        self.say(f"stopped run {self.run_id or '(not started)'} and {len(killed)} processes")
        self.save_flower_log()
        self.say(self.spent_text())
        self.say(f"outputs so far: {self.plan.run_dir}")
        return 130

    def finish(self, info: dict[str, Any]) -> int:
        log = self.save_flower_log()
        status = info.get("status", "unknown")
        summary_path = self.plan.run_dir / "summary.json"
        if summary_path.exists():
            from .reporting.console import render_summary
            from .reporting.ledger import read_ledger
            contents = read_ledger(self.plan.run_dir / "ledger.jsonl")
            history = [{"round": e["round"], "report": e["report"], "metrics": e.get("metrics", {})}
                       for e in contents.rounds]
            if history:
                self.say(render_summary(history, max_rows=SUMMARY_ROWS))
            for warning in json.loads(summary_path.read_text()).get("warnings", []):  # e.g. chance-level accuracy
                self.say(warning)
        if status != "finished:completed":
            self.say(f"run {self.run_id} {status}: {info.get('status-details') or 'no details'}")
            self.say(self.spent_text())
            if log is not None:
                self.say(f"Flower's log: {log}")
            return 1
        self.say(f"run {self.run_id} finished:completed; {self.spent_text()}")
        files = [p.name for p in sorted(self.plan.run_dir.iterdir()) if p.is_file() and not p.name.startswith(".")]
        self.say(f"outputs: {self.plan.run_dir} ({', '.join(files)})")
        return 0

    def run(self) -> int:
        old = {s: signal.signal(s, self._on_signal) for s in (signal.SIGINT, signal.SIGTERM)}
        try:
            try:
                cpn = self.plan.config.clients_per_node
                cohort = f" x {cpn} clients each (cohorts)" if cpn > 1 else ""
                self.say(f"run '{self.plan.config.run_name}': {self.plan.num_rounds} rounds, "
                         f"{self.plan.config.clients_per_round} clients per round, {self.plan.supernodes} "
                         f"simulated SuperNodes{cohort}; outputs in {self.plan.run_dir}")
                from .preflight import preflight
                for note in preflight(self.plan.config):  # calibrated sigma, budget stop, noise warning
                    self.say(note)
                self.run_id = self.submit()
                c = self.plan.config
                self.say(f"started run {self.run_id}; certified = the sound bound for threat model "
                         f"'{c.threat_model}', epsilon at delta {c.delta:g}; Flower's log goes to "
                         f"{self.plan.run_dir / 'flower.log'}")
                info = self.follow()
                return self.finish(info)
            except Interrupted as why:
                return self.interrupted(f"{why} received")
        finally:
            try:
                stop_processes(self.flwr_home)  # the local SuperLink and all it started
            finally:
                for s, handler in old.items():
                    signal.signal(s, handler)


def _seconds_between(a: Any, b: Any) -> float | None:
    try:
        return (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds()
    except (TypeError, ValueError):
        return None


def _num(x: Any) -> str:
    try:
        x = float(x)
    except (TypeError, ValueError):
        return str(x)
    if x != x or x in (float("inf"), float("-inf")):
        return str(x)
    return f"{x:.4g}"


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
    except RuntimeError as err:
        print(f"fl-dp-flower run: {err}", file=sys.stderr)
        return 1


def cli(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="fl-dp-flower run", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    return main(parser.parse_args(argv))

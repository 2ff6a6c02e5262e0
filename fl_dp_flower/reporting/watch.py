"""``fl-dp-flower watch RUN_DIR``: a live terminal view of a run, read from its privacy ledger.

The view shows rounds done out of planned, clients per round and accuracy; the certified epsilon
against the budget and the epsilon the next planned round would bring (the accountant's dry run,
docs/MATH.md §15); the paper's bound, labelled "not a guarantee" when it is not sound; and the
run's events (resume, budget stop, node refusals, voided rounds, end).

Reading: the ledger is polled (no inotify: it works on network and slow filesystems); only
the bytes appended since the last read are read, and only complete lines are parsed, so a line
being written (or torn by a crash) is never misread. Ctrl-C ends the view cleanly. Nothing is
written. No torch, no flwr.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.records import AccountantConfig, RoundRecord

from fl_dp_flower.run_marker import read_marker
from .ledger import LedgerFollower
from .ledger import events as ev

_EVENT_TEXT = {
    ev.RESUME_EVENT: lambda d: f"resumed ({d.get('rounds_accounted')} rounds accounted)",
    ev.BUDGET_STOP_EVENT: lambda d: f"budget stop: {d.get('reason', '')}",
    ev.NODE_EXCLUDED_EVENT: lambda d: f"node {d.get('node_id')} excluded after {d.get('consecutive_refusals')} "
                               f"refusals: {d.get('reason', '')}",
    ev.PARTITION_CLAIMED_EVENT: lambda d: f"partition-id {d.get('partition_id')} contested by nodes {d.get('nodes')}: "
                                   "their replies are dropped, none is sampled again",
    ev.NODE_CAPPED_EVENT: lambda d: f"node {d.get('node_id')} flagged: num-examples {d.get('claimed')} capped "
                             f"{d.get('consecutive')} rounds in a row (weighted as {d.get('weighted_as')})",
    ev.ROUND_VOID_EVENT: lambda d: f"round {d.get('round')} voided ({d.get('reason')})",
    ev.TORN_TAIL_EVENT: lambda d: f"torn line {d.get('line')} found on resume",
    ev.UNFINISHED_ROUND_EVENT: lambda d: f"round {d.get('round')} charged as planned, not applied (unfinished)",
    ev.NOT_APPLIED_EVENT: lambda d: f"round(s) {d.get('rounds')} not applied (model lost before its "
                                    "checkpoint): out of the final-model bound",
    ev.FAILED_EVENT: lambda d: f"run failed: {d.get('reason', '')}",
    ev.END_EVENT: lambda d: f"run ended ({d.get('rounds_accounted')} rounds accounted)",
}


@dataclass
class RunView:
    """What the view shows, updated from ledger lines."""

    header: dict[str, Any] | None = None
    accountant: PrivacyAccountant | None = None
    rounds: list[dict[str, Any]] = field(default_factory=list)
    events: list[tuple[str, str]] = field(default_factory=list)
    ended: bool = False
    last_time: str | None = None
    resumed_plan: dict[str, Any] = field(default_factory=dict)  # the latest resume event's "plan"
    claims: dict[Any, set[Any]] = field(default_factory=dict)  # partition id -> nodes (partition-claimed events)

    def add(self, entry: dict[str, Any]) -> None:
        self.last_time = entry.get("time", self.last_time)
        kind = entry.get("kind")
        if kind == "header":
            self.header = entry
            self.accountant = PrivacyAccountant(AccountantConfig.from_dict(entry["accountant_config"]))
        elif kind == "round" and self.accountant is not None:
            self.accountant.step(RoundRecord.from_dict(entry["record"]))
            self.rounds.append(entry)
        elif kind == "event":
            name, data = entry.get("event", ""), entry.get("data") or {}
            if name == ev.ROUND_OPEN_EVENT:
                return
            if name == ev.PARTITION_CLAIMED_EVENT:  # shown only when a claim contests a partition id
                nodes = self.claims.setdefault(data.get("partition_id"), set())
                nodes.add(data.get("node_id"))
                if len(nodes) < 2:
                    return
                data = {**data, "nodes": ", ".join(map(str, sorted(nodes, key=str)))}
            if name == ev.RESUME_EVENT and isinstance(data.get("plan"), dict):
                self.resumed_plan = dict(data["plan"])  # a resume may plan fewer or more rounds
            if name == ev.RESUME_EVENT:  # as the resumed server (app/recovery.py): contests stay, single claims go
                self.claims = {p: nodes for p, nodes in self.claims.items() if len(nodes) > 1}
            self.ended = name in ev.CLOSING_EVENTS or (self.ended and name != ev.RESUME_EVENT)
            text = _EVENT_TEXT.get(name, lambda d: f"{name} {d}")(data)
            self.events.append((str(entry.get("time", ""))[11:19], text))

    # ------------------------------------------------------------------ numbers
    @property
    def app(self) -> dict[str, Any]:
        """The run config in force: the header's, with the latest resume's plan over it."""
        return {**((self.header or {}).get("app_config") or {}), **self.resumed_plan}

    def next_round_epsilon(self) -> float | None:
        """Certified epsilon after the next round, if it runs as planned (None when done)."""
        acct = self.accountant
        if acct is None or self.ended or acct.num_releases >= int(self.app.get("num-server-rounds", 0) or 0):
            return None
        return acct.peek(acct.config.planned_round(acct.num_releases + 1)).certified.epsilon


def _fmt(x: Any, digits: int = 4) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.{digits}g}"
    return str(x)


def run_status(view: RunView, ledger: Path) -> str:
    """Finished (the ledger's end), else what the run's launcher recorded and whether it lives.

    One channel each: the ledger (the ServerApp's) says whether the run ended; the launcher's
    marker ``.launcher.json`` beside it (``fl-dp-flower run`` only) says whether it was stopped.
    """
    if view.ended:
        return "finished"
    marker = read_marker(ledger.parent)
    if marker is None:
        return "running (or stopped without an end line)"
    state = marker.get("state")
    if state == "interrupted":
        return f"interrupted ({marker.get('why') or 'stopped by its launcher'}); resume with --resume"
    if state in ("completed", "failed"):
        return f"ended without an end line (launcher: {marker.get('status') or state})"
    if marker["alive"]:
        return "running"
    return "stopped (its launcher is gone and the ledger has no end line)"


def render(view: RunView, source: Path, *, now: float | None = None):
    """The view as a rich renderable."""
    from rich.console import Group
    from rich.markup import escape
    from rich.table import Table
    from rich.text import Text

    if view.header is None:
        return Text(f"waiting for a ledger at {source} ...")
    app, acct = view.app, view.accountant
    planned = int(app.get("num-server-rounds", 0) or 0)
    report = acct.report() if acct is not None else None
    last = view.rounds[-1] if view.rounds else None
    metrics = (last or {}).get("metrics", {})
    cert = report.certified if report else None
    budget = float(app.get("target-epsilon", 0.0) or 0.0)
    age = ""
    if view.last_time:
        seconds = (now or time.time()) - datetime.fromisoformat(view.last_time).timestamp()
        age = f"; last line {seconds:.0f} s ago"
    status = run_status(view, source)

    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    head.add_row("run", escape(f"{source}  [{status}{age}]"))
    head.add_row("rounds", f"{acct.num_releases if acct else 0} / {planned} planned; clients last round "
                            f"{report.clients if report else '-'} (plan {app.get('clients-per-round', '-')}); "
                            f"accuracy {_fmt(metrics.get('accuracy'), 3)}")
    if cert is not None and (acct.num_releases if acct else 0) == 0:
        head.add_row("certified", "no round accounted yet")
    elif cert is not None and report is not None:
        from .console import FINAL_MODEL_ASSUMES, add_remove_note, conditional_note, delta_text, mu_note

        final = f", if {FINAL_MODEL_ASSUMES}" if report.threat_model == "final-model" else ""
        head.add_row("certified", f"epsilon {_fmt(cert.epsilon)} (mu {_fmt(cert.mu)}{mu_note(report.certified_bound)}) at delta {delta_text(report.to_dict())}, "
                                  f"bound {report.certified_bound}, threat model {report.threat_model}, "
                                  f"replace-one{conditional_note(cert.to_dict())}{final}")
        head.add_row("add/remove-one", add_remove_note(report.to_dict()))
    nxt = view.next_round_epsilon()
    if budget > 0 and cert is not None:
        share = cert.epsilon / budget
        bar = "#" * min(20, int(round(20 * min(share, 1.0)))) + "." * (20 - min(20, int(round(20 * min(share, 1.0)))))
        over = "" if nxt is None else f"; next round -> {_fmt(nxt)}{' (over budget: the run stops)' if nxt > budget else ''}"
        head.add_row("budget", escape(f"[{bar}] {100 * share:.0f}% of epsilon {budget:g}{over}"))
    elif nxt is not None:
        head.add_row("next round", f"certified epsilon -> {_fmt(nxt)} if it runs as planned")
    if report is not None:
        paper = report.bounds["paper"]
        label = "a sound bound for this run" if paper.sound else "NOT A GUARANTEE (not sound for this run)"
        head.add_row("paper bound", f"epsilon {_fmt(paper.epsilon)} - the paper's stated bound, {label}")

    table = Table(title="recent rounds", title_justify="left")
    for col in ("round", "clients", "accuracy", "certified eps", "paper eps"):
        table.add_column(col, justify="right")
    for entry in view.rounds[-5:]:
        r = entry["report"]
        paper = r["bounds"]["paper"]
        table.add_row(str(entry["round"]), str(r["clients"]), _fmt(entry.get("metrics", {}).get("accuracy"), 3),
                      _fmt(r["certified"]["epsilon"]), _fmt(paper["epsilon"]) + ("" if paper["sound"] else "*"))
    events = Table(title="events", title_justify="left", show_header=False)
    events.add_column("time")
    events.add_column("event")
    for when, text in view.events[-6:] or [("", "none yet")]:
        events.add_row(when, escape(text))
    starred = any(not e["report"]["bounds"]["paper"]["sound"] for e in view.rounds[-5:])
    note = Text("* the paper's bound: not a guarantee for this run" if starred else "", style="dim")
    return Group(head, table, note, events)


def main(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    source = Path(args.run_dir)
    ledger = source / "ledger.jsonl" if source.is_dir() or not source.suffix else source
    follower, view = LedgerFollower(ledger), RunView()
    console = Console()
    if args.once or not sys.stdout.isatty():
        for entry in follower.poll():
            view.add(entry)
        console.print(render(view, ledger))
        return 0 if view.header is not None else 1
    try:
        with Live(render(view, ledger), console=console, refresh_per_second=4, screen=False) as live:
            while True:
                for entry in follower.poll():
                    view.add(entry)
                live.update(render(view, ledger))
                time.sleep(args.interval)
    except KeyboardInterrupt:
        console.print("stopped watching (the run is not affected)")
        return 0


__all__ = ["LedgerFollower", "RunView", "main", "render"]

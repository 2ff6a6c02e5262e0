"""What ``fl-dp-flower run`` prints and records about a run, read from its ledger and summary.

- :func:`round_line`: one ledger round as a terminal line (accuracy, certified epsilon, ETA);
- :func:`spent_text`: the privacy spent so far, read from the ledger (after Ctrl-C, a failure, or
  at the end), naming an open round and how to account it;
- :func:`shortfall_text`: "ended with k of n planned rounds" when a run stopped early;
- the launcher's marker ``<run dir>/.launcher.json`` is written through
  :mod:`fl_dp_flower.run_marker` (``fl-dp-flower watch`` reads it beside the ledger).

Standard library only (the ledger reader does not import torch or flwr).
"""

from __future__ import annotations

import math
from datetime import datetime
from pathlib import Path
from typing import Any


def num(x: Any) -> str:
    """A number in 4 significant digits (inf/nan and non-numbers as they are)."""
    try:
        x = float(x)
    except (TypeError, ValueError):
        return str(x)
    if not math.isfinite(x):
        return str(x)
    return f"{x:.4g}"


def seconds_between(a: Any, b: Any) -> float | None:
    try:
        return (datetime.fromisoformat(b) - datetime.fromisoformat(a)).total_seconds()
    except (TypeError, ValueError):
        return None


def round_line(entry: dict, index: int, rounds: list, total: int) -> str:
    """One ledger round as a terminal line (index: 1-based position in ``rounds``; total: planned)."""
    report, metrics = entry["report"], entry.get("metrics", {})
    cert = report["certified"]
    paper = report["bounds"]["paper"]
    acc = metrics.get("accuracy")
    done = entry["round"]
    eta = ""
    if index >= 2:  # rate between the ledger times of the first and this round (no start-up)
        spent = seconds_between(rounds[0].get("time"), entry.get("time"))
        if spent is not None:
            eta = f" | ETA {spent / (index - 1) * max(total - done, 0):.0f}s"
    paper_text = "" if paper.get("sound") else f" | paper {num(paper['epsilon'])} (not a guarantee)"
    return (f"round {done:>3}/{total} | clients {report['clients']:>3} | acc "
            f"{'  -  ' if acc is None else f'{acc:.3f}'} | certified eps {num(cert['epsilon'])} "
            f"({cert['bound']}){_large_delta(report)}{paper_text}{eta}")


def _large_delta(report: dict[str, Any]) -> str:
    """" at delta ..." when the screening drops' charge (docs/MATH.md §17.1) is not negligible, i.e. the
    certified epsilon does not hold at the run's delta (the header names that delta); "" otherwise."""
    screening = report.get("screening") or {}
    if screening.get("delta_total", report["delta"]) <= SCREENING_NEGLIGIBLE * report["delta"]:
        return ""
    return f" at delta {_delta(report)}"


#: a screening charge up to this factor of delta is left out of the round lines (the final "privacy
#: spent" line always gives the delta with the charge)
SCREENING_NEGLIGIBLE = 1.01


def spent_text(ledger: Path) -> str:
    """The privacy spent, read from the ledger."""
    from fl_dp_flower.reporting.ledger import read_ledger
    try:
        contents = read_ledger(ledger)
    except (OSError, ValueError) as err:
        return f"could not read the ledger {ledger}: {err}"
    if not contents.rounds:
        return f"no round was accounted (ledger {ledger})"
    cert = contents.rounds[-1]["report"]["certified"]
    text = (f"privacy spent: {len(contents.rounds)} rounds accounted, certified eps "
            f"{num(cert['epsilon'])} (mu {num(cert['mu'])}, {cert['bound']}) at delta "
            f"{_delta(contents.rounds[-1]['report'])}")
    if contents.open_round is not None:
        text += (f"; round {contents.open_round} was under way (resume with --resume and "
                 "resume-unfinished-round='account' to account it)")
    return text


def _delta(report: dict[str, Any]) -> str:
    """The delta the certified epsilon holds at (with screening drops charged, docs/MATH.md §17.1)."""
    screening = report.get("screening") or {}
    return f"{report['delta']:g} + {screening['delta']:.2g} (screening drops)" if screening else f"{report['delta']:g}"


def shortfall_text(summary: dict[str, Any]) -> str:
    """"; ended with k of n planned rounds (why)" when the summary shows fewer rounds than planned."""
    planned = summary.get("planned_rounds", summary.get("num_server_rounds"))
    done = summary.get("accounted_rounds", summary.get("rounds_accounted"))
    if not isinstance(planned, int) or not isinstance(done, int) or done >= planned:
        return ""
    why = summary.get("stop_reason") or summary.get("failure") or "see Flower's log"
    return f"; ended with {done} of {planned} planned rounds ({why})"

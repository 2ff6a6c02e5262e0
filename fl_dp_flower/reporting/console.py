"""Human-readable output: one log line per round and an end-of-run summary table.

Inputs are the accountant's ``report.to_dict()`` (see docs/ARCHITECTURE.md) and history
entries ``{"round": t, "report": {...}, "metrics": {...}}`` shaped like the ledger's round
lines. The paper's closed-form bound is always labelled "not a guarantee" when its
``sound`` flag is False.
"""

from __future__ import annotations

import io
import math
from typing import Any, Literal

from rich.console import Console
from rich.table import Table

from fl_dp_flower.privacy.bounds import FINAL_ITERATE_ASSUMPTION, rests_on_smoothness
from fl_dp_flower.privacy.client_sampling import CONDITIONED_BOUND
from fl_dp_flower.privacy.sample_sampling import BATCH_SAMPLED_BOUND
from fl_dp_flower.privacy.sampled import SAMPLED_BOUND
from fl_dp_flower.vocabulary import BOUND_NAMES as _REPORTED

# the sound bounds first, the paper's stated bound (often not a guarantee) last
BOUND_NAMES = tuple(n for n in _REPORTED if n != "paper") + ("paper",)


def fmt_num(x: Any, digits: int = 4) -> str:
    """Compact number: ``digits`` significant digits, ``inf``/``nan`` spelled out, None -> n/a."""
    if x is None:
        return "n/a"
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return f"{x:.{digits}g}"


def fmt_acc(x: Any) -> str:
    """Accuracy with three decimals (``n/a`` when unknown)."""
    return "n/a" if x is None else f"{float(x):.3f}"


#: printed next to a number that rests on L-smooth losses (privacy.bounds.CONDITIONAL_LABEL)
CONDITIONAL = "conditional on L-smooth losses"
#: what the final-model threat model assumes beyond the bound's own assumptions (docs/MATH.md §15)
FINAL_MODEL_ASSUMES = "participants do not reveal the global models they receive"


#: bounds whose epsilon is the amplified rounds' (their PLD) while their mu is the Gaussian-DP parameter the rounds
#: have without amplification (no smaller mu holds at every epsilon)
AMPLIFIED_BOUNDS = frozenset({SAMPLED_BOUND, CONDITIONED_BOUND, BATCH_SAMPLED_BOUND})


def mu_note(bound: str) -> str:
    """" (unamplified)" after the mu of an :data:`AMPLIFIED_BOUNDS` bound, whose epsilon is the amplified one; else
    "" (a mu of 7.6 beside an epsilon of 4 is not a mu-GDP claim of 7.6 read as epsilon 4)."""
    return " (unamplified)" if bound in AMPLIFIED_BOUNDS else ""


def conditional_note(bound: dict[str, Any]) -> str:
    """", conditional on L-smooth losses (L = 1)" for a bound that assumes L, ", assuming <it>" for any
    other assumption (the honest Poisson sampler of the amplified bound), "" for none."""
    assumes = bound.get("assumes") or []
    smooth = [a for a in assumes if a.startswith("L-smooth losses")]
    other = [a for a in assumes if a not in smooth]
    note = f", {CONDITIONAL} " + "; ".join(a.removeprefix("L-smooth losses ") for a in smooth) if smooth else ""
    return note.rstrip() + (", assuming " + "; ".join(other) if other else "")


def add_remove_note(report: dict[str, Any]) -> str:
    """"add/remove-one eps=1.75" beside the (replace-one) certified number, "" when not reported."""
    ar = report.get("add_remove") or {}
    if not ar:
        return ""
    relation = ar.get("relation", "add/remove-one")
    return f"{relation} mu={fmt_num(ar['mu'])}{mu_note(ar.get('bound', ''))} eps={fmt_num(ar['epsilon'])}"


def _paper_label(paper: dict[str, Any]) -> str:
    return "paper bound" if paper.get("sound") else "paper bound (not a guarantee)"


def delta_text(report: dict[str, Any]) -> str:
    """The delta the certified epsilon holds at: "1e-05", or with screening drops charged (docs/MATH.md
    §17.1) "1e-05 + 9.4e-09 (screening drops)"."""
    screening = report.get("screening") or {}
    if not screening:
        return f"{report['delta']:g}"
    return f"{report['delta']:g} + {screening['delta']:.2g} (screening drops)"


def format_round_line(report: dict[str, Any], *, accuracy: float | None, clients: int) -> str:
    """One log line for a finished round, e.g.

    ``round 3 | clients 10 | acc 0.912 | certified mu=1.234 eps=5.67 (delta=1e-05,
    composition, replace-one) | add/remove-one mu=0.617 eps=2.5 | paper bound (not a guarantee)
    mu=0.45 eps=1.2``

    ``accuracy=None`` under the final-model threat model leaves the accuracy out (no per-round
    model-derived output is published there, docs/MATH.md §15). A certified bound that rests on
    L-smooth losses says so; the add/remove-one guarantee follows the (replace-one) certified one.
    """
    cert = report["certified"]
    final_model = report.get("threat_model") == "final-model"
    parts = [f"round {report['round']}", f"clients {clients}"]
    if not (final_model and accuracy is None):
        parts.append(f"acc {fmt_acc(accuracy)}")
    label = "PLANNING ONLY (not a certificate)" if cert.get("planning_only") else "certified"
    parts.append(f"{label} mu={fmt_num(cert['mu'])}{mu_note(cert['bound'])} eps={fmt_num(cert['epsilon'])} "
                 f"(delta={delta_text(report)}, {cert['bound']}, {report.get('relation', 'replace-one')}"
                 f"{conditional_note(cert)}{', if ' + FINAL_MODEL_ASSUMES if final_model else ''})")
    if add_remove_note(report):
        parts.append(add_remove_note(report))
    paper = report.get("bounds", {}).get("paper")
    if paper is not None:
        parts.append(
            f"{_paper_label(paper)} mu={fmt_num(paper['mu'])} eps={fmt_num(paper['epsilon'])}"
        )
    return " | ".join(parts)


def shown_rounds(count: int, max_rows: int | None) -> list[int]:
    """Indices of the rows a table of ``count`` rounds shows: all, or ``max_rows`` evenly spaced
    ones that include the first and the last."""
    if max_rows is None or count <= max_rows:
        return list(range(count))
    if max_rows < 2:
        raise ValueError(f"max_rows must be >= 2, got {max_rows!r}")
    return sorted({round(i * (count - 1) / (max_rows - 1)) for i in range(max_rows)})


def summary_table(history: list[dict[str, Any]], max_rows: int | None = None) -> Table:
    """Per-round table: accuracy, loss, certified (mu, eps) and eps of every bound.

    Unsound bounds are marked with ``*`` and explained in the caption. ``max_rows``: show at most
    that many rounds, evenly spaced, first and last included (the caption says so).
    """
    title = "Privacy summary" + (f" (delta={delta_text(history[-1]['report'])})" if history else "")
    table = Table(title=title, show_lines=False)
    columns: list[tuple[str, Literal["left", "right"]]] = [
        ("round", "right"), ("clients", "right"), ("accuracy", "right"), ("loss", "right"),
        ("certified by", "left"), ("cert. mu", "right"), ("cert. eps", "right")]
    for name, justify in columns:
        table.add_column(name, justify=justify)
    for name in BOUND_NAMES:
        table.add_column(f"{name} eps", justify="right")
    any_unsound = any_conditional = any_iterate = any_amplified = False
    rows = shown_rounds(len(history), max_rows)
    for entry in (history[i] for i in rows):
        report, metrics = entry["report"], entry.get("metrics") or {}
        cert = report["certified"]
        any_amplified = any_amplified or cert["bound"] in AMPLIFIED_BOUNDS
        cells = [str(entry["round"]), str(report.get("clients", "")),
                 fmt_acc(metrics.get("accuracy")), fmt_num(metrics.get("loss"), 4),
                 cert["bound"], fmt_num(cert["mu"]), fmt_num(cert["epsilon"])]
        for name in BOUND_NAMES:
            bound = report.get("bounds", {}).get(name)
            if bound is None:
                cells.append("")
                continue
            conditional = rests_on_smoothness(bound.get("assumes") or ())
            iterate = FINAL_ITERATE_ASSUMPTION in (bound.get("assumes") or ())
            mark = ("" if bound.get("sound") else "*") + ("†" if conditional else "") + ("‡" if iterate else "")
            any_unsound = any_unsound or not bound.get("sound")
            any_conditional = any_conditional or conditional
            any_iterate = any_iterate or iterate
            cells.append(fmt_num(bound["epsilon"]) + mark)
        table.add_row(*cells)
    notes = []
    if len(rows) < len(history):
        notes.append(f"{len(rows)} of {len(history)} rounds shown; every round is in ledger.jsonl")
    iterate_note = "‡ assumes the released model is the last noisy-GD iterate" if any_iterate else ""
    if any_unsound:  # one line with the ‡ note: the summary fits one screen (the report spells ‡ out)
        notes.append("; ".join(filter(None, ("* not a guarantee for this run (shown for reference)", iterate_note))))
    elif iterate_note:
        notes.append(iterate_note)
    if any_conditional:
        notes.append(f"† {CONDITIONAL}: certifies only when the run asserts assume-smooth-losses")
    if any_amplified:
        notes.append("cert. mu of an amplified bound (" + ", ".join(sorted(AMPLIFIED_BOUNDS)) + "): the rounds' "
                     "Gaussian-DP parameter without amplification; cert. eps is the amplified one")
    last = history[-1]["report"] if history else {}
    if last.get("add_remove"):
        notes.append(f"bounds for replace-one neighbours; {add_remove_note(last)} (certified, last round)")
    if notes:
        table.caption = "\n".join(notes)
    return table


def render_summary(history: list[dict[str, Any]], *, width: int = 132, max_rows: int | None = None) -> str:
    """The summary table as plain text (no colour or style codes)."""
    buf = io.StringIO()
    console = Console(file=buf, width=width, color_system=None, force_terminal=False,
                      no_color=True, highlight=False)
    console.print(summary_table(history, max_rows))
    return buf.getvalue()

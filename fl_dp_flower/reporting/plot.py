"""End-of-run plot: epsilon per round (certified, composition, local DP, the paper's bound), the
budget line and accuracy; the title names sigma, clients per round, rounds and the threat model.

Uses matplotlib's Agg canvas directly (no pyplot, no display, no global backend switch).
The PNG is written atomically and owner-only (:func:`~.durable.atomic_write`). Infinite epsilons are not drawn (the legend says how many were skipped).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from .console import CONDITIONAL
from .durable import atomic_write


def _series(values: list[float]) -> tuple[list[float], int]:
    """Replace non-finite values by NaN (gaps in the line); return them and the inf count."""
    out, skipped = [], 0
    for v in values:
        v = float(v)
        if math.isfinite(v):
            out.append(v)
        else:
            out.append(math.nan)
            skipped += 1
    return out, skipped


def _label(text: str, skipped: int) -> str:
    return text + (f" (∞ in {skipped} round{'s' if skipped > 1 else ''}, not drawn)" if skipped else "")


def _settings_line(run_config: Mapping[str, Any], rounds_done: int) -> str:
    """"σ 0.8 · 10 clients/round · 5 of 10 rounds · threat model all-rounds" from a run config."""
    parts = []
    if "sigma" in run_config:
        parts.append(f"σ {float(run_config['sigma']):g}")
    if "clients-per-round" in run_config:
        parts.append(f"{run_config['clients-per-round']} clients/round")
    planned = run_config.get("num-server-rounds")
    parts.append(f"{rounds_done} of {planned} rounds" if planned else f"{rounds_done} rounds")
    if "threat-model" in run_config:
        parts.append(f"threat model {run_config['threat-model']}")
    return " · ".join(parts)


def privacy_figure(history: list[dict[str, Any]], *, delta: float,
                   run_config: Mapping[str, Any] | None = None) -> Figure:
    """The figure of :func:`plot_privacy_curve` (axes titled and labelled; nothing written)."""
    if not history:
        raise ValueError("cannot plot an empty history")
    run_config = run_config or {}
    rounds = [int(h["round"]) for h in history]
    reports = [h["report"] for h in history]
    cert, cert_inf = _series([r["certified"]["epsilon"] for r in reports])
    comp, comp_inf = _series([r["bounds"]["composition"]["epsilon"] for r in reports])
    local, local_inf = _series([r["bounds"]["local_dp"]["epsilon"] for r in reports])
    paper, paper_inf = _series([r["bounds"]["paper"]["epsilon"] for r in reports])
    paper_sound = all(bool(r["bounds"]["paper"]["sound"]) for r in reports)
    cert_names = sorted({str(r["certified"]["bound"]) for r in reports})
    budget = float(run_config.get("target-epsilon", 0.0) or 0.0)
    # a bound resting on L-smooth losses says so in the legend (issue 16 item 4)
    cert_cond = f", {CONDITIONAL}" if any(a.startswith("L-smooth") for r in reports
                                          for a in r["certified"].get("assumes", [])) else ""
    if any(r.get("sampling") for r in reports):
        cert_cond += ", amplified by Poisson client sampling (honest server-side sampler)"
    paper_cond = f", {CONDITIONAL}" if any(r["bounds"]["paper"].get("assumes") for r in reports) else ""

    fig = Figure(figsize=(8, 5.8), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    ax.plot(rounds, cert, color="tab:blue", linewidth=2.6, marker="o", markersize=4,
            label=_label(f"certified ({', '.join(cert_names)}{cert_cond})", cert_inf))
    ax.plot(rounds, comp, color="tab:green", linewidth=1.2, linestyle=":", marker="s",
            markersize=3, label=_label("composition (every global model)", comp_inf))
    ax.plot(rounds, local, color="tab:purple", linewidth=1.2, linestyle="-.", marker="v",
            markersize=3, label=_label("local DP (a curious server sees every upload)", local_inf))
    if paper_sound:
        ax.plot(rounds, paper, color="tab:red", linewidth=1.2, marker="^", markersize=3,
                label=_label(f"paper's bound{paper_cond}", paper_inf))
    else:
        ax.plot(rounds, paper, color="tab:red", linewidth=1.4, linestyle="--",
                label=_label(f"paper's stated bound (not certified{paper_cond})", paper_inf))
    if budget > 0:
        ax.axhline(budget, color="black", linewidth=1.2, linestyle=(0, (6, 3)), label=f"budget ε = {budget:g}")

    finite = [v for v in cert + comp + local + paper + ([budget] if budget > 0 else [])
              if math.isfinite(v) and v > 0]
    if finite and max(finite) / min(finite) > 100.0:
        ax.set_yscale("log")
    if not finite:
        ax.text(0.5, 0.5, "every epsilon is infinite", transform=ax.transAxes,
                ha="center", va="center", color="gray")
    ax.set_xlabel("round")
    ax.set_ylabel("ε")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    ax.set_title(f"Privacy loss after each round (δ = {delta:g})\n{_settings_line(run_config, len(history))}",
                 fontsize="medium")

    handles, labels = ax.get_legend_handles_labels()
    acc = [h.get("metrics", {}).get("accuracy") for h in history]
    if any(a is not None for a in acc):
        ax2 = ax.twinx()
        acc_y = [math.nan if a is None else float(a) for a in acc]
        ax2.plot(rounds, acc_y, color="tab:gray", linewidth=1.2, marker=".", label="accuracy")
        ax2.set_ylabel("accuracy")
        known = [a for a in acc_y if not math.isnan(a)]
        ax2.set_ylim(0.0, 1.0 if known and max(known) <= 1.0 else None)
        h2, l2 = ax2.get_legend_handles_labels()
        handles, labels = handles + h2, labels + l2
    ax.legend(handles, labels, loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2,
              fontsize="small", frameon=False)
    fig.tight_layout()
    return fig


def plot_privacy_curve(history: list[dict[str, Any]], path: str | os.PathLike[str], *,
                       delta: float, run_config: Mapping[str, Any] | None = None) -> Path:
    """Draw epsilon vs round and accuracy (second axis) to the PNG ``path``; returns the path.

    ``history`` entries are ``{"round", "report", "metrics"}`` like the ledger's round lines;
    ``run_config`` (dash keys, e.g. the ledger header's ``app_config``) gives the title's sigma,
    clients per round, planned rounds and threat model, and the budget line (``target-epsilon``).
    The y axis is logarithmic when the finite epsilons span more than two decades.
    """
    fig = privacy_figure(history, delta=delta, run_config=run_config)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, format="png", bbox_inches="tight"))
    return path


#: one curve of :func:`plot_accuracy_against_epsilon`: epsilons, mean accuracies, their spreads (None: no bars)
Curve = tuple[list[float], list[float], list[float] | None]


def plot_accuracy_against_epsilon(curves: Mapping[str, Curve], path: str | os.PathLike[str], *,
                                  xlabel: str, ylabel: str, title: str) -> Path:
    """A privacy-utility frontier: accuracy against epsilon (log axis), one labelled curve each, error
    bars where a spread is given; written like :func:`plot_privacy_curve`. Returns the path."""
    fig = Figure(figsize=(7, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for label, (eps, acc, spread) in curves.items():
        ax.errorbar(eps, acc, yerr=spread, marker="o", capsize=3 if spread else 0, label=label)
    ax.set_xscale("log")
    ax.set(xlabel=xlabel, ylabel=ylabel)
    ax.set_title(title, fontsize="small")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, format="png"))
    return path

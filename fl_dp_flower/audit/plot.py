"""The audit's plot: the attack's empirical trade-off curve against T_G(mu) of every bound.

A mu-GDP guarantee says every test's (FPR, FNR) lies on or above T_G(mu); an empirical point below
a bound's curve (beyond the sampling error the verdicts account for) means that bound is violated.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from fl_dp_flower.privacy import gdp
from fl_dp_flower.reporting.durable import atomic_write

from .run import AuditReport

_STYLE = {"paper": ("tab:red", "--"), "composition": ("tab:green", ":"), "final_model": ("tab:purple", "-."),
          "local_dp": ("tab:orange", ":"), "certified": ("tab:blue", "-")}


def plot_audit(report: AuditReport, path: str | Path) -> Path:
    """Write the PNG to ``path`` (atomically) and return the path."""
    path = Path(path)
    a = report.attack
    fig = Figure(figsize=(7.5, 5.6), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    alpha = np.geomspace(1e-5, 1.0, 400)
    for v in report.verdicts:
        if not v.applies:  # the bound does not cover this adversary's view
            continue
        color, style = _STYLE[v.bound]
        label = f"{v.bound}: T_G({v.mu:.3g}) — {v.outcome}" + ("" if v.sound else " (paper's stated bound)")
        ax.plot(alpha, gdp.tradeoff(v.mu, alpha), color=color, linestyle=style,
                linewidth=2.4 if v.bound == "certified" else 1.3, label=label)
    keep = a.curve_fpr > 0
    ax.plot(a.curve_fpr[keep], a.curve_fnr[keep], color="black", linewidth=1.8,
            label=f"attack (empirical), mu_lower = {a.mu_lower:.3g}")
    ax.plot([o.fpr for o in a.operating], [1 - o.tpr for o in a.operating], "ko", markersize=4)
    ax.set_xscale("log")
    ax.set_xlim(1e-4, 1.0)
    ax.set_ylim(0.0, 1.0)
    ax.set_xlabel("false-positive rate (type I error)")
    ax.set_ylabel("false-negative rate (type II error)")
    c = report.config
    ax.set_title(f"Audit ({report.canary} canary, {report.adversary} adversary): {c.algorithm}, {c.schedule}, "
                 f"m {c.clients}, K {c.local_steps}, lr {c.lr:g}, σ {c.sigma:g}, V {c.clip_norm:g}, "
                 f"T {report.rounds}; {report.trials:,} trials/world",
                 fontsize="small")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="lower left", fontsize="x-small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, format="png", bbox_inches="tight"))
    return path


def plot_sensitivity(curves: list, path: str | Path) -> Path:
    """Measured ||w_t - w'_t|| per round for each run (solid), with its tightest bound (dotted)."""
    path = Path(path)
    fig = Figure(figsize=(8, 5.4), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for i, c in enumerate(curves):
        color = f"C{i % 10}"
        rounds = np.arange(1, len(c.measured) + 1)
        ax.plot(rounds, c.measured, color=color, linewidth=1.8, label=f"{c.setup.label} (measured)")
        bound = np.minimum(c.clipping_bound, c.smooth_bound) if c.smooth_bound else np.asarray(c.clipping_bound)
        ax.plot(rounds, bound, color=color, linewidth=1.0, linestyle=":")
    ax.set_yscale("log")
    ax.set_xlabel("round t")
    ax.set_ylabel("||w_t − w'_t||  (dotted: its bound)")
    s = curves[0].setup
    ax.set_title(f"Sensitivity of the real trainer: m {s.clients}, K {s.local_steps}, lr {s.lr:g}, V {s.clip_norm:g}, "
                 f"σ {s.sigma:g}", fontsize="small")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize="x-small", frameon=False)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(path, lambda f: fig.savefig(f, format="png", bbox_inches="tight"))
    return path

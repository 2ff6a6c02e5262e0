"""Privacy-utility frontier: held-out accuracy against certified epsilon, one curve per clients/round.

Each point is a real run of the ServerApp and ClientApp code (``run_server`` on the in-process
grid of tests/local_grid.py, 10 nodes; cohort mode when m > 10): LeNet-5 on the embedded MNIST
subset, stage-wise schedule, lr 0.1, K 10, V 1, threat model all-rounds (certified = composition,
delta = 1e-5), the whole training set split evenly over the m clients. Outputs a markdown table
and docs/images/frontier.png.

Run: .venv/bin/python scripts/frontier.py [--rounds 10] [--clients 10 100 1000]
(about 6 minutes on 2 cores with the defaults; 1,000 clients per round cost ~8 s a round)
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

SIGMAS = {10: (0.02, 0.05, 0.1), 100: (0.05, 0.1, 0.3), 1000: (0.1, 0.3, 1.0), 10000: (0.3, 1.0, 3.0)}


def point(m: int, sigma: float, rounds: int) -> dict:
    from local_grid import run_local, tiny_config

    with tempfile.TemporaryDirectory() as out:
        cfg = tiny_config(Path(out), **{
            "clients-per-node": max(1, m // 10), "clients-per-round": m, "num-partitions": 10,
            "local-steps": 10, "batch-size": 32 if m <= 10 else 4, "lr": 0.1, "clip-norm": 1.0, "sigma": sigma,
            "schedule": "stage", "num-server-rounds": rounds, "seed": -1})
        start = time.perf_counter()
        outcome, _ = run_local(cfg, nodes=10)
        summary = outcome.summary
    return {"m": m, "sigma": sigma, "rounds": rounds, "epsilon": summary["final_report"]["certified"]["epsilon"],
            "accuracy": summary["final_accuracy"], "seconds": time.perf_counter() - start}


def plot(points: list[dict], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.5), dpi=110)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot()
    for m in sorted({p["m"] for p in points}):
        pts = sorted((p for p in points if p["m"] == m), key=lambda p: p["epsilon"])
        ax.plot([p["epsilon"] for p in pts], [p["accuracy"] for p in pts], "o-", label=f"m = {m:,} clients/round")
    ax.set_xscale("log")
    ax.set_xlabel("certified epsilon (delta = 1e-5, all-rounds)")
    ax.set_ylabel("held-out accuracy")
    ax.set_title(f"Privacy-utility frontier ({points[0]['rounds']} rounds, stage-wise, LeNet-5, MNIST subset)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "frontier.png")
    args = parser.parse_args()
    import logging

    logging.getLogger("flwr").setLevel(logging.ERROR)
    points = []
    for m in args.clients:
        for sigma in SIGMAS[m]:
            points.append(point(m, sigma, args.rounds))
            p = points[-1]
            print(f"m {m:>6,}  sigma {sigma:<5}  epsilon {p['epsilon']:10.4g}  accuracy {p['accuracy']:.3f}  "
                  f"({p['seconds']:.0f} s)", flush=True)
    plot(points, args.out)
    print(f"\n| clients/round m | sigma | certified epsilon | accuracy after {args.rounds} rounds |")
    print("|---|---|---|---|")
    for p in points:
        print(f"| {p['m']:,} | {p['sigma']} | {p['epsilon']:.4g} | {p['accuracy']:.3f} |")
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main()

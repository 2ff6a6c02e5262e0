"""Privacy-utility frontier: held-out accuracy against certified epsilon, one curve per clients/round.

Each point is a real run of the ServerApp and ClientApp code (``run_server`` on the in-process
grid of fl_dp_flower.testing, 10 nodes; cohort mode when m > 10): LeNet-5 on the embedded MNIST
subset with the main job's recipe - the 4,000 training images split evenly over the m clients, one
local step (K = 1) on each client's whole data (B = 4000/m), V = 1, lr 2, constant schedule - for
a fixed number of rounds. For each target epsilon, sigma is calibrated (privacy.planning.calibrate)
so that the run certifies exactly that epsilon at delta = 1e-5 under all-rounds composition.
Outputs a markdown table and docs/images/frontier.png.

Run: .venv/bin/python scripts/frontier.py [--rounds 30] [--clients 10 100 1000 4000]
(about 12 minutes on 2 cores with the defaults)
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

EPSILONS = (1.0, 2.0, 4.0, 8.0, 16.0)
RECIPE = {"local-steps": 1, "lr": 2.0, "clip-norm": 1.0, "schedule": "constant", "num-partitions": 10,
          "threat-model": "all-rounds", "seed": -1}


def calibrated_sigma(m: int, rounds: int, epsilon: float) -> float:
    from fl_dp_flower.privacy.planning import calibrate
    from fl_dp_flower.privacy.records import AccountantConfig

    config = AccountantConfig(algorithm="fedavg", schedule="constant", lr=RECIPE["lr"], local_steps=1,
                              clip_norm=RECIPE["clip-norm"], clients=m, sigma=1.0, smoothness=1.0, delta=1e-5,
                              threat_model="all-rounds")
    return calibrate(config, rounds, epsilon).sigma * (1 + 1e-9)  # a hair above: certified <= the target


def point(m: int, epsilon: float, rounds: int) -> dict:
    from fl_dp_flower.testing import run_local, tiny_config

    sigma = calibrated_sigma(m, rounds, epsilon)
    with tempfile.TemporaryDirectory() as out:
        cfg = tiny_config(Path(out), **{**RECIPE, "clients-per-node": max(1, m // 10), "clients-per-round": m,
                                        "batch-size": 4000 // m, "sigma": sigma, "num-server-rounds": rounds})
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
    ax.set_title(f"Privacy-utility frontier ({points[0]['rounds']} rounds, K = 1, lr 2, V 1, LeNet-5, MNIST subset)",
                 fontsize="small")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000, 4000])
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "images" / "frontier.png")
    args = parser.parse_args()
    import logging

    from flwr.common.logger import FLOWER_LOGGER  # imported first: importing it sets its level to DEBUG

    FLOWER_LOGGER.setLevel(logging.ERROR)  # the in-process rounds' Flower log
    points = []
    for m in args.clients:
        for epsilon in EPSILONS:
            points.append(point(m, epsilon, args.rounds))
            p = points[-1]
            print(f"m {m:>6,}  sigma {p['sigma']:<8.4g}  epsilon {p['epsilon']:10.4g}  accuracy {p['accuracy']:.3f}  "
                  f"({p['seconds']:.0f} s)", flush=True)
    plot(points, args.out)
    print(f"\n| clients/round m | sigma | certified epsilon | accuracy after {args.rounds} rounds |")
    print("|---|---|---|---|")
    for p in points:
        print(f"| {p['m']:,} | {p['sigma']:.4g} | {p['epsilon']:.4g} | {p['accuracy']:.3f} |")
    print(f"\nplot: {args.out}")


if __name__ == "__main__":
    main()

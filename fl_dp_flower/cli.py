"""Command line: ``fl-dp-flower run | verify | watch | privacy | audit | sensitivity | calibrate``.

``run`` runs the main job in Flower's simulation engine (:mod:`fl_dp_flower.launcher`);
``privacy`` prints every bound for a planned run of T identical rounds;
``calibrate`` finds the sigma that meets a target epsilon under a chosen bound;
``audit`` attacks a canary run and checks every bound (docs/audit.md);
``sensitivity`` measures the real trainer's sensitivity against its bounds.
Output is a table (rich) or JSON (``--json``). Bad input exits with status 2 and
a message naming the flag and the allowed range. Defaults are shown in ``--help`` and
in the table's title. The math (numpy, scipy) is imported only once a command runs.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
from typing import TYPE_CHECKING, Any, Callable, Sequence

if TYPE_CHECKING:
    from .privacy.records import AccountantConfig

from .vocabulary import ALGORITHMS, BOUND_CHOICES, SCHEDULES, THREAT_MODELS

# AccountantConfig field -> CLI flag, for translating validation messages.
_FIELD_FLAGS = {
    "algorithm": "--algorithm",
    "schedule": "--schedule",
    "lr": "--lr",
    "local_steps": "--local-steps",
    "clip_norm": "--clip-norm",
    "clients": "--clients",
    "sigma": "--sigma",
    "smoothness": "--smoothness",
    "prox_alpha": "--prox-alpha",
    "delta": "--delta",
    "threat_model": "--threat-model",
    "batch_size": "--batch-size",
    "cyclic_c": "--cyclic-c",
    "iterative_z": "--iterative-z",
    "assume_smooth_losses": "--assume-smooth-losses",
    "colluders": "--colluding-clients",
}


def _number(kind: Callable[[str], Any], lo: float, lo_open: bool, hi: float | None = None,
            hi_open: bool = True) -> Callable[[str], Any]:
    """argparse type: a finite number in the given interval (message states the range)."""
    left = "(" if lo_open else "["
    right = ")" if (hi is None or hi_open) else "]"
    interval = f"{left}{lo:g}, {'inf' if hi is None else format(hi, 'g')}{right}"

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a valid number; allowed range {interval}")
        ok = math.isfinite(value) and (value > lo if lo_open else value >= lo)
        if ok and hi is not None:
            ok = value < hi if hi_open else value <= hi
        if not ok:
            raise argparse.ArgumentTypeError(f"{text} is outside the allowed range {interval}")
        return value

    return parse


_POSITIVE = _number(float, 0.0, True)
_NONNEGATIVE = _number(float, 0.0, False)
_COUNT = _number(int, 1, False)
_PROBABILITY = _number(float, 0.0, True, 1.0, True)


def _add_common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--algorithm", choices=ALGORITHMS, default="fedavg")
    parser.add_argument("--schedule", choices=SCHEDULES, default="constant")
    parser.add_argument("--lr", type=_POSITIVE, default=0.1, help="learning-rate constant (> 0)")
    parser.add_argument("--local-steps", type=_COUNT, default=5, help="K, local steps per round (>= 1)")
    parser.add_argument("--clip-norm", type=_POSITIVE, default=1.0, help="V, clipping norm (> 0)")
    parser.add_argument("--clients", type=_COUNT, default=10, help="m, clients aggregated per round (>= 1)")
    parser.add_argument("--rounds", type=_COUNT, default=100, help="T, communication rounds (>= 1)")
    parser.add_argument("--smoothness", type=_NONNEGATIVE, default=1.0, help="L, smoothness constant (>= 0)")
    parser.add_argument("--prox-alpha", type=_POSITIVE, default=None, help="FedProx alpha (> L, lr <= 1/alpha)")
    parser.add_argument("--delta", type=_PROBABILITY, default=1e-5, help="delta in (0, 1)")
    parser.add_argument("--cyclic-c", type=_POSITIVE, default=None, help="cyclic c (>= c_K; default c_K)")
    parser.add_argument("--iterative-z", type=_POSITIVE, default=None, help="iterative z (>= z_K; default z_K)")
    parser.add_argument("--batch-size", type=_COUNT, default=None, help="B, mini-batch size (>= 1)")
    parser.add_argument("--per-sample-clipping", action="store_true", help="clip each sample's gradient (needs --batch-size)")
    parser.add_argument("--threat-model", choices=THREAT_MODELS, default="all-rounds")
    parser.add_argument("--assume-smooth-losses", action="store_true",
                        help="assert every (per-sample) loss is L-smooth with L = --smoothness (not true of "
                             "ReLU/max-pool models); without it no L-dependent bound certifies; needed by "
                             "--threat-model final-model")
    parser.add_argument("--colluding-clients", type=_number(int, 0, False), default=1,
                        help="c, participants colluding with the adversary (0 = outside observer, 1 = any "
                             "participant, who knows its own upload; docs/MATH.md §14.2a)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def build_parser() -> argparse.ArgumentParser:
    from .launcher import add_arguments as add_run_arguments

    formatter = argparse.ArgumentDefaultsHelpFormatter
    parser = argparse.ArgumentParser(prog="fl-dp-flower", description=__doc__.split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    run = commands.add_parser("run", help="the main job: a simulation with the privacy report",
                              formatter_class=formatter)
    add_run_arguments(run)
    verify = commands.add_parser("verify", help="check a privacy ledger: hash chain, structure, every round recomputed",
                                 formatter_class=formatter)
    verify.add_argument("ledger", help="path of a ledger.jsonl (or of its run folder)")
    verify.add_argument("--json", action="store_true", help="print JSON instead of text")
    verify.add_argument("--expected-head", action="append", default=[], metavar="SHA256",
                        help="the ledger head the run published (its log, summary.json 'ledger_head', Prometheus "
                             "fl_dp_ledger_head_info), kept outside the run folder: the ledger must reach it "
                             "(a cut tail fails). summary.json beside the ledger is checked too")
    verify.add_argument("--live", action="store_true",
                        help="the run is still running (or crashed and awaits its resume): a ledger without an end "
                             "event is expected instead of failing as possibly cut")
    watch = commands.add_parser("watch", help="live view of a running or finished run, read from its ledger",
                                formatter_class=formatter)
    watch.add_argument("run_dir", help="the run folder (<output-dir>/<run-name>) or its ledger.jsonl")
    watch.add_argument("--interval", type=_POSITIVE, default=1.0, help="seconds between reads of the ledger")
    watch.add_argument("--once", action="store_true", help="print one view and exit (no live display)")
    privacy = commands.add_parser("privacy", help="all privacy bounds of a planned run", formatter_class=formatter)
    _add_common(privacy)
    privacy.add_argument("--sigma", type=_POSITIVE, required=True, help="per-client noise std (> 0)")
    audit = commands.add_parser("audit", help="attack a canary (linear or kink) and check every printed bound",
                                formatter_class=formatter)
    _add_common(audit)
    audit.add_argument("--sigma", type=_POSITIVE, required=True, help="per-client noise std (> 0)")
    audit.add_argument("--trials", type=_number(int, 10, False), default=100_000,
                       help="evaluation trials per world (>= 10; as many shadow trials fit the test)")
    audit.add_argument("--seed", type=_number(int, 0, False), default=0, help="seed of the trials (>= 0)")
    audit.add_argument("--confidence", type=_PROBABILITY, default=0.95,
                       help="confidence of the lower bounds and intervals, in (0, 1)")
    audit.add_argument("--plot", default=None, help="write the trade-off plot (PNG) to this path")
    audit.add_argument("--device", default="auto", help="torch device of the trials (auto: cuda if present)")
    from .audit.commands import add_audit_arguments
    add_audit_arguments(audit)
    sens = commands.add_parser("sensitivity", help="measured ||w_T - w'_T|| of the real trainer against its bounds",
                               formatter_class=formatter)
    from .audit.commands import add_sensitivity_arguments
    add_sensitivity_arguments(sens, _POSITIVE, _COUNT, _NONNEGATIVE)
    calib = commands.add_parser("calibrate", help="the sigma that meets a target epsilon", formatter_class=formatter)
    _add_common(calib)
    calib.add_argument("--target-epsilon", type=_POSITIVE, required=True, help="target epsilon (> 0)")
    calib.add_argument("--bound", choices=BOUND_CHOICES, default="certified")
    return parser


def _config(args: argparse.Namespace, parser: argparse.ArgumentParser, sigma: float) -> "AccountantConfig":
    from .privacy.records import AccountantConfig, smoothness_problems

    if args.per_sample_clipping and args.batch_size is None:
        parser.error("--per-sample-clipping needs --batch-size (an integer >= 1)")
    assume_smooth = bool(getattr(args, "assume_smooth_losses", False))
    problems = smoothness_problems(args.threat_model, "per-sample" if args.per_sample_clipping else "per-batch",
                                   args.local_steps, args.smoothness, assume_smooth)
    if problems:
        parser.error(_flagged("; ".join(problems)))
    try:
        return AccountantConfig(
            algorithm=args.algorithm, schedule=args.schedule, lr=args.lr, local_steps=args.local_steps,
            clip_norm=args.clip_norm, clients=args.clients, sigma=sigma, smoothness=args.smoothness,
            prox_alpha=args.prox_alpha, delta=args.delta, threat_model=args.threat_model,
            clipping="per-sample" if args.per_sample_clipping else "per-batch",
            batch_size=args.batch_size, cyclic_c=args.cyclic_c, iterative_z=args.iterative_z,
            assume_smooth_losses=assume_smooth,
            colluders=args.colluding_clients,
        )
    except ValueError as exc:
        parser.error(_flagged(str(exc)))
    raise AssertionError("unreachable")


def _flagged(message: str) -> str:
    """Rewrite AccountantConfig field names in a validation message as CLI flags."""
    for field_name, flag in sorted(_FIELD_FLAGS.items(), key=lambda kv: -len(kv[0])):
        message = re.sub(rf"\b{field_name}\b", flag, message)
    return message


_ADVERSARY = {
    "paper": "final model",
    "composition": "every global model",
    "final_model": "final model (L-smooth losses)",
    "local_dp": "every client upload",
}


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.6g}"


def _settings(args: argparse.Namespace) -> str:
    """The planned run in one line, defaults included (what ``privacy --sigma 1`` really means)."""
    extra = f", alpha {args.prox_alpha:g}" if args.prox_alpha is not None else ""
    return (f"{args.algorithm}{extra}, {args.schedule} schedule, lr {args.lr:g}, K {args.local_steps}, "
            f"V {args.clip_norm:g}, m {args.clients} clients/round, T {args.rounds} rounds, L {args.smoothness:g}, "
            f"{'per-sample (B ' + str(args.batch_size) + ')' if args.per_sample_clipping else 'per-batch'} clipping, "
            f"{args.colluding_clients} colluding client(s)")


_THREAT_RULE = {
    "all-rounds": "composition (the adversary sees every global model)",
    "final-model": "the smallest certifiable final-model bound",
    "curious-server": "local_dp (the server sees every upload)",
}


def _print_plan(result: dict[str, Any], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Privacy after {result['rounds']} rounds (delta = {result['delta']:g}, "
                        f"sigma = {args.sigma:g})\n{_settings(args)}")
    for col in ("bound", "adversary sees", "mu (GDP)", "epsilon", "status"):
        table.add_column(col)
    from .reporting.console import FINAL_MODEL_ASSUMES, add_remove_note, conditional_note

    for name, value in result["bounds"].items():
        status = "sound" if value["sound"] else "paper's stated bound - NOT a guarantee"
        table.add_row(name, _ADVERSARY[name], _fmt(value["mu"]), _fmt(value["epsilon"]),
                      status + conditional_note(value))
    cert = result["certified"]
    console = Console(width=None if sys.stdout.isatty() else 160)  # no wrapping when piped
    console.print(table)
    assumes = conditional_note(cert) + (f", if {FINAL_MODEL_ASSUMES}" if args.threat_model == "final-model" else "")
    console.print(f"certified ({cert['bound']}, chosen by threat model {args.threat_model}: "
                  f"{_THREAT_RULE[args.threat_model]}{assumes}): mu = {_fmt(cert['mu'])}, "
                  f"epsilon = {_fmt(cert['epsilon'])} for {result['relation']} neighbours; "
                  f"{add_remove_note(result)}")


def _verify(args: argparse.Namespace) -> int:
    """Exit 0: every check passed; 1: a check failed (the first failing line is named); 2: no ledger."""
    from pathlib import Path

    from .reporting.durable import json_safe
    from .reporting.verify import verify_ledger

    path = Path(args.ledger)
    if path.is_dir():
        path = path / "ledger.jsonl"
    if not path.is_file():
        print(f"fl-dp-flower verify: no ledger at {path}", file=sys.stderr)
        return 2
    heads = {f"--expected-head #{n}": h for n, h in enumerate(args.expected_head, start=1)}
    summary = path.parent / "summary.json"
    if summary.is_file():
        try:
            published = json.loads(summary.read_text()).get("ledger_head")
        except (OSError, ValueError, AttributeError):
            published = None
        if isinstance(published, str) and published:
            heads[str(summary)] = published
    result = verify_ledger(path, expected_heads=heads, live=args.live)
    if args.json:
        print(json.dumps(json_safe(result.to_dict()), indent=2, allow_nan=False))
        return 0 if result.ok else 1
    chain = ("hash chain intact" if result.ok else "hash chain checked up to the failure") if result.chained \
        else "no hash chain (schema 1)"
    print(f"ledger {path} (schema {result.schema}, {result.lines} lines): {chain}; "
          f"{result.rounds_verified} rounds recomputed in {result.seconds:.2f} s")
    for note in result.notes:
        print(f"note: {note}")
    for checked in result.heads_checked:
        print(f"published head reached ({checked})")
    if result.ok:
        print(f"OK: every recorded number follows from the recorded rounds; head {result.head or '-'}"
              + ("" if result.ended or not result.chained else " (no end event: the run is live)"))
        return 0
    print(f"FAILED at line {result.failure_line}: {result.failure}")
    return 1


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command == "run":
        from .launcher import main as run_main
        return run_main(args)
    if args.command == "verify":
        return _verify(args)
    if args.command == "watch":
        from .reporting.watch import main as watch_main
        return watch_main(args)
    if args.command == "audit":
        from .audit.commands import audit_command
        return audit_command(args, parser)
    if args.command == "sensitivity":
        from .audit.commands import sensitivity_command
        return sensitivity_command(args, parser)
    from .privacy.planning import calibrate, plan  # numpy/scipy: only now
    from .reporting.durable import json_safe

    if args.command == "privacy":
        config = _config(args, parser, args.sigma)
        try:
            result = plan(config, args.rounds).to_dict()
        except ValueError as exc:
            parser.error(_flagged(str(exc)))
        if args.json:
            print(json.dumps(json_safe(result), indent=2, allow_nan=False))
        else:
            _print_plan(result, args)
        return 0
    config = _config(args, parser, 1.0)
    try:
        result = calibrate(config, args.rounds, args.target_epsilon, args.bound).to_dict()
    except ValueError as exc:
        parser.error(_flagged(str(exc)))
    if args.json:
        print(json.dumps(json_safe(result), indent=2, allow_nan=False))
    else:
        from .reporting.console import conditional_note

        status = ("" if result["sound"] else "  (paper's stated bound - NOT a guarantee)") + conditional_note(result)
        print(f"{_settings(args)}, threat model {args.threat_model}")
        print(f"sigma = {result['sigma']:.6g} gives {result['bound']}: mu = {_fmt(result['mu'])}, "
              f"epsilon = {_fmt(result['epsilon'])} at delta = {args.delta:g}{status}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

"""Command line: ``fl-dp-flower run | verify | watch | privacy | audit | sensitivity | calibrate``.

``run`` runs the main job in Flower's simulation engine (:mod:`fl_dp_flower.app.launcher`);
``privacy`` prints every bound of a planned run and its per-round certified epsilon;
``calibrate`` finds the sigma that meets a target epsilon under a chosen bound.
The planning commands (and ``audit``) take the run config's own keys as flags, with the run's
defaults, and can read the app's pyproject.toml, a ``--preset`` and ``--run-config`` overrides
(:mod:`fl_dp_flower.app.plan_flags`): planning and running agree by construction;
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
import sys
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

from fl_dp_flower.app.plan_flags import flagged, fmt_number as _fmt, planned_accountant_config, settings_line as _settings
from fl_dp_flower.vocabulary import BOUND_CHOICES


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
    """The planning flags (``privacy``, ``calibrate``, ``audit``): the run config's own keys, generated
    from AppConfig (:mod:`fl_dp_flower.app.plan_flags`)."""
    from fl_dp_flower.app.plan_flags import add_plan_arguments

    add_plan_arguments(parser)


def build_parser() -> argparse.ArgumentParser:
    from fl_dp_flower.app.launcher import add_arguments as add_run_arguments

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
    audit = commands.add_parser("audit", help="attack a canary (linear or kink) and check every printed bound",
                                formatter_class=formatter)
    _add_common(audit)
    audit.add_argument("--trials", type=_number(int, 10, False), default=100_000,
                       help="evaluation trials per world (>= 10; as many shadow trials fit the test)")
    audit.add_argument("--seed", type=_number(int, 0, False), default=0, help="seed of the trials (>= 0)")
    audit.add_argument("--confidence", type=_PROBABILITY, default=0.95,
                       help="confidence of the lower bounds and intervals, in (0, 1)")
    audit.add_argument("--plot", default=None, help="write the trade-off plot (PNG) to this path")
    audit.add_argument("--device", default="auto", help="torch device of the trials (auto: cuda if present)")
    from fl_dp_flower.app.audit_commands import add_audit_arguments
    add_audit_arguments(audit)
    sens = commands.add_parser("sensitivity", help="measured ||w_T - w'_T|| of the real trainer against its bounds",
                               formatter_class=formatter)
    from fl_dp_flower.app.audit_commands import add_sensitivity_arguments
    add_sensitivity_arguments(sens, _POSITIVE, _COUNT, _NONNEGATIVE)
    calib = commands.add_parser("calibrate", help="the sigma that meets a target epsilon", formatter_class=formatter)
    _add_common(calib)
    calib.add_argument("--bound", choices=BOUND_CHOICES, default="certified")
    return parser


_ADVERSARY = {
    "paper": "final model",
    "composition": "every global model",
    "final_model": "final model (L-smooth losses)",
    "local_dp": "every client upload",
    "sampled": "every global model and each round's members",
    "sampled_secret": "every global model and each round's count; a secret sample",
    "secure_aggregation": "the secure sum of the uploads (SecAgg+)",
    "batch_sampled": "every global model (all-rounds) or every upload (curious-server); each site's batch draws "
                     "secret (honest sites)",
}


#: what an amplified bound's printed mu and epsilon are (the rounds' PLD gives epsilon; mu is without amplification)
_AMPLIFIED = {
    "sampled": "sampled: epsilon from the PLD of the amplified rounds (docs/MATH.md §19); its mu is the Gaussian-DP "
               "parameter the rounds have without amplification (no smaller mu holds at every epsilon)",
    "sampled_secret": "sampled_secret: epsilon from the PLD of the rounds conditioned on their counts (docs/MATH.md §22); "
                      "its mu is the Gaussian-DP parameter the rounds have without amplification; it holds only while "
                      "nobody who reads the results learns which clients took part",
    "batch_sampled": "batch_sampled: epsilon from the PLD of the rounds amplified by each site's Poisson batch "
                     "(docs/MATH.md §23); its mu is the Gaussian-DP parameter the rounds have without amplification; "
                     "it assumes honest sites whose draws stay secret"}
_THREAT_RULE = {
    "all-rounds": "composition, amplified ('sampled') with Poisson client sampling, conditioned on the count "
                  "('sampled_secret') with a secret sample, amplified by the sites' Poisson batches ('batch_sampled') "
                  "(the adversary sees every global model)",
    "final-model": "the smallest certifiable final-model bound",
    "curious-server": "local_dp, amplified by the sites' Poisson batches ('batch_sampled') (the server sees every "
                      "upload)",
    "secure-aggregation": "secure_aggregation: the Skellam bound against a server that sees only the secure sum (SecAgg+)",
}


def _print_plan(result: dict[str, Any], args: argparse.Namespace) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"Privacy after {result['rounds']} rounds (delta = {result['delta']:g}, "
                        f"sigma = {args.sigma:g})\n{_settings(args)}")
    for col in ("bound", "adversary sees", "mu (GDP)", "epsilon", "status"):
        table.add_column(col)
    from fl_dp_flower.reporting.console import (
        FINAL_MODEL_ASSUMES,
        add_remove_note,
        conditional_note,
        mu_note,
    )

    for name, value in result["bounds"].items():
        status = "sound" if value["sound"] else (
            "paper's stated bound - NOT a guarantee" if name == "paper" else "NOT a guarantee for this run")
        table.add_row(name, _ADVERSARY[name], _fmt(value["mu"]) + mu_note(name), _fmt(value["epsilon"]),
                      status + conditional_note(value))
    cert = result["certified"]
    console = Console(width=None if sys.stdout.isatty() else 160)  # no wrapping when piped
    console.print(table)
    threat = args.config.threat_model
    assumes = conditional_note(cert) + (f", if {FINAL_MODEL_ASSUMES}" if threat == "final-model" else "")
    console.print(f"certified ({cert['bound']}, chosen by threat model {threat}: "
                  f"{_THREAT_RULE[threat]}{assumes}): mu = {_fmt(cert['mu'])}{mu_note(cert['bound'])}, "
                  f"epsilon = {_fmt(cert['epsilon'])} for {result['relation']} neighbours; "
                  f"{add_remove_note(result)}")
    for name in (name for name in _AMPLIFIED if name in result["bounds"]):
        console.print(_AMPLIFIED[name], highlight=False)
    per_round = result["per_round"]
    shown = per_round if len(per_round) <= 12 else per_round[:6] + per_round[-6:]
    if shown:
        console.print("certified epsilon per round (the run's accountant on the planned rounds): " + ", ".join(
            f"{r['round']}: {_fmt(r['epsilon'])}" for r in shown)
            + ("" if shown is per_round else " (every round: --json)"), highlight=False)
    for note in result["notes"]:
        console.print(note, highlight=False)


def _verify(args: argparse.Namespace) -> int:
    """Exit 0: every check passed; 1: a check failed (the first failing line is named); 2: no ledger."""
    from pathlib import Path

    from fl_dp_flower.reporting.durable import json_safe
    from fl_dp_flower.reporting.verify import verify_ledger

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
        from fl_dp_flower.app.launcher import main as run_main
        return run_main(args)
    if args.command == "verify":
        return _verify(args)
    if args.command == "watch":
        from fl_dp_flower.reporting.watch import main as watch_main
        return watch_main(args)
    if args.command in ("audit", "privacy", "calibrate"):
        from fl_dp_flower.app.plan_flags import resolve
        resolve(args, parser)
    if args.command == "audit":
        from fl_dp_flower.app.audit_commands import audit_command
        return audit_command(args, parser)
    if args.command == "sensitivity":
        from fl_dp_flower.app.audit_commands import sensitivity_command
        return sensitivity_command(args, parser)
    if args.command == "privacy":
        return _privacy(args, parser)
    return _calibrate(args, parser)


#: Above this many rounds ``privacy`` prints the closed forms only (the replay costs about 1 ms a round).
PER_ROUND_LIMIT = 20_000


def _notes(args: argparse.Namespace) -> list[str]:
    """What the run would say before it starts (calibrated sigma, budget stop, noise), or its refusal."""
    from fl_dp_flower.app.config import ConfigError
    from fl_dp_flower.app.preflight import preflight

    try:
        return preflight(args.config)
    except ConfigError as err:
        return ["the run would be refused: " + str(err).removeprefix("invalid run config:\n  - ")]


def _privacy(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """Every bound after the planned rounds, the run's per-round certified epsilon, and the notes."""
    from fl_dp_flower.privacy.planning import plan, plan_and_run  # numpy/scipy: only now
    from fl_dp_flower.reporting.durable import json_safe

    config = planned_accountant_config(args, parser)
    replay = args.rounds <= PER_ROUND_LIMIT
    try:
        planned, run = plan_and_run(config, args.rounds, args.config.budget_epsilon) if replay else (
            plan(config, args.rounds), None)
        result = planned.to_dict()
    except ValueError as exc:
        parser.error(flagged(str(exc)))
    result["sigma"] = config.sigma
    result["per_round"] = [{"round": r.round, "bound": r.certified_bound, "mu": r.certified.mu,
                            "epsilon": r.certified.epsilon} for r in (run.reports if run else ())]
    result["stopped_by_budget"] = run.stopped_by_budget if run else None
    skipped = f"more than {PER_ROUND_LIMIT:,} rounds: no per-round replay (about 1 ms a round); the table is the closed form"
    result["notes"] = _notes(args) if replay else [skipped]
    result["run_config"] = {"source": args.config_source, "values": args.config.to_run_config()}
    if args.json:
        print(json.dumps(json_safe(result), indent=2, allow_nan=False))
    else:
        _print_plan(result, args)
    return 0


def _calibrate(args: argparse.Namespace, parser: argparse.ArgumentParser) -> int:
    """The exact sigma of a bound at 'target-epsilon', and what ``sigma = "auto"`` picks for the run."""
    from fl_dp_flower.privacy.planning import calibrate, calibrate_sigma  # numpy/scipy: only now
    from fl_dp_flower.reporting.durable import json_safe

    target = args.config.target_epsilon
    if not target > 0:
        parser.error("--target-epsilon: calibrate needs a target epsilon > 0 (flag, --run-config or the app's "
                     "'target-epsilon')")
    config = planned_accountant_config(args, parser, 1.0)
    try:
        result = calibrate(config, args.rounds, target, args.bound).to_dict()
        auto = calibrate_sigma(config, args.rounds, target) if args.rounds <= PER_ROUND_LIMIT else None
    except ValueError as exc:
        parser.error(flagged(str(exc)))
    result["run"] = None if auto is None else {
        "sigma": auto.sigma, "bound": auto.report.certified_bound, "epsilon": auto.report.certified.epsilon,
        "mu": auto.report.certified.mu}
    if args.json:
        print(json.dumps(json_safe(result), indent=2, allow_nan=False))
    else:
        from fl_dp_flower.reporting.console import conditional_note, mu_note

        status = ("" if result["sound"] else "  (paper's stated bound - NOT a guarantee)") + conditional_note(result)
        print(f"{_settings(args)}\nthreat model {args.config.threat_model}")
        print(f"sigma = {result['sigma']:.6g} gives {result['bound']}: mu = {_fmt(result['mu'])}{mu_note(result['bound'])}, "
              f"epsilon = {_fmt(result['epsilon'])} at delta {args.config.delta:g}{status}")
        if result["bound"] in _AMPLIFIED:
            print(_AMPLIFIED[result["bound"]])
        if auto is not None:
            print(f"sigma = 'auto' in this run config picks sigma = {auto.sigma:g} (rounded up): certified "
                  f"epsilon {_fmt(auto.report.certified.epsilon)} ({auto.report.certified_bound}) after "
                  f"{args.rounds} rounds")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

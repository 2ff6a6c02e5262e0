"""A main-job run planned before anything starts: overrides, presets, validation, resume checks.

``fl-dp-flower run`` (:mod:`fl_dp_flower.app.launcher`) builds a :class:`Plan` from its flags and the
``KEY=VALUE`` overrides: the preset (:mod:`fl_dp_flower.app.presets`) is laid over the pyproject
defaults and under the overrides, the whole is validated against
:class:`~fl_dp_flower.app.config.AppConfig` (errors name the key), and a resume is checked against
its ledger with the ServerApp's own rules, all in about a second. Standard library and pydantic.
"""

from __future__ import annotations

import argparse
import json
import re
import tomllib
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

from fl_dp_flower.errors import FlDpError
from fl_dp_flower.app.app_project import app_project
from fl_dp_flower.app.presets import PRESETS

ROOT = app_project()  # the Flower app project `flwr run` submits (checkout root, or the wheel's)
#: Flower's own split of a ``--run-config`` string into pairs (flwr/common/config.py).
_PAIR = re.compile(r"(\S+?)=('[^']*'|\"[^\"]*\"|\S+)")


class UsageError(FlDpError, ValueError):
    """Bad overrides or flags: reported in one message, exit status 2, before anything starts."""


# ------------------------------------------------------------------ overrides
def parse_overrides(text: str) -> dict[str, Any]:
    """A ``--run-config`` string as Flower splits it, one TOML value per key; errors name the key.

    Raises UsageError for a value that is not TOML (``lr=abc``), a key given twice, or text
    that is not ``key=value``.
    """
    out: dict[str, Any] = {}
    rest = _PAIR.sub(" ", text).strip()
    if rest:
        raise UsageError(f"cannot read {rest!r} in the overrides: write key=value pairs separated by spaces "
                         "(strings in quotes: run-name='x')")
    for key, raw in _PAIR.findall(text):
        if key in out:
            raise UsageError(f"'{key}' is given twice in the overrides")
        try:
            out[key] = tomllib.loads(f"v = {raw}")["v"]
        except tomllib.TOMLDecodeError:
            raise UsageError(f"'{key}' = {raw}: not a valid value; write strings in quotes ({key}='{raw}'), "
                             "numbers as 0.1 or 10, booleans as true/false") from None
    return out


def to_toml(values: dict[str, Any]) -> str:
    """Flat ``key = value`` TOML of run-config values (str, bool, int, float)."""
    lines = []
    for key, value in values.items():
        if isinstance(value, str):
            text = json.dumps(value)  # a TOML basic string is a JSON string for these characters
        elif isinstance(value, bool):
            text = "true" if value else "false"
        elif isinstance(value, (int, float)):
            text = repr(value)
        else:
            raise UsageError(f"'{key}' = {value!r}: not a run-config value")
        lines.append(f'"{key}" = {text}')
    return "\n".join(lines) + "\n"


def pyproject_run_config(app_dir: Path = ROOT) -> dict[str, Any]:
    """The ``[tool.flwr.app.config]`` defaults of the app."""
    return tomllib.loads((app_dir / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


@dataclass(frozen=True)
class Plan:
    """A validated main-job run: what to submit and where its outputs go."""

    overrides: dict[str, Any]
    run_dir: Path
    supernodes: int
    allow_fixed_seed: bool
    num_rounds: int
    config: Any  # AppConfig


def make_plan(args: argparse.Namespace, *, app_dir: Path = ROOT, now: datetime | None = None) -> Plan:
    """Validate flags + overrides against AppConfig (raises UsageError with the message to print)."""
    from fl_dp_flower.app.config import (  # pydantic: imported only when a run is planned
        AppConfig,
        ConfigError,
        with_auto_sigma,
    )
    from fl_dp_flower.app.preflight import preflight

    overrides = parse_overrides(" ".join(args.overrides))
    for key, flag in (("run-name", "--run-name"), ("output-dir", "--output-dir"), ("resume", "--resume")):
        if key in overrides and getattr(args, flag[2:].replace("-", "_")) not in (None, False):
            raise UsageError(f"'{key}' is set both as {flag} and in the overrides: keep one")
    overrides = {**PRESETS[args.preset], **with_auto_sigma(overrides)}  # target-epsilon alone picks sigma
    stamp = (now or datetime.now()).strftime("%Y%m%d-%H%M%S")
    overrides.setdefault("run-name", args.run_name or f"main-{stamp}")
    out_dir = Path(str(overrides.get("output-dir") or args.output_dir or "outputs")).expanduser()
    overrides["output-dir"] = str(out_dir if out_dir.is_absolute() else (Path.cwd() / out_dir).resolve())
    if args.resume:
        overrides["resume"] = True
    try:
        config = AppConfig.from_run_config({**pyproject_run_config(app_dir), **overrides})
        preflight(config)  # a budget that fits no round is refused now, not after the run starts
    except ConfigError as err:
        raise UsageError(str(err)) from None
    run_dir = Path(config.output_dir) / config.run_name
    ledger = run_dir / "ledger.jsonl"
    if config.resume and not ledger.exists():
        raise UsageError(f"--resume: there is no ledger at {ledger}; check --run-name and --output-dir")
    if not config.resume and ledger.exists():
        raise UsageError(f"run '{config.run_name}' already has a ledger at {ledger}: pass --resume to continue "
                         "it, or choose another --run-name")
    if config.resume:
        check_resume(config, ledger)
    if config.seed >= 0 and not args.allow_fixed_seed:
        raise UsageError(f"'seed' = {config.seed} makes every client's noise reproducible (whoever knows the seed "
                         "can subtract it); nodes refuse it unless allowed: pass --allow-fixed-seed for an "
                         "experiment, or leave seed = -1")
    supernodes = args.supernodes or config.num_partitions
    if supernodes * config.clients_per_node < config.clients_per_round:
        raise UsageError(f"--supernodes {supernodes} x 'clients-per-node' = {config.clients_per_node} offer fewer "
                         f"clients than 'clients-per-round' = {config.clients_per_round}")
    return Plan(overrides, run_dir, supernodes, bool(args.allow_fixed_seed), config.num_server_rounds, config)


def check_resume(config: Any, ledger: Path) -> None:
    """Refuse at once (UsageError) a resume the ServerApp would refuse after starting up."""
    from fl_dp_flower.reporting.ledger import PrivacyLedger
    try:
        contents = PrivacyLedger.check_resumable(ledger, accountant_config=config.accountant_config().to_dict())
    except ValueError as err:
        raise UsageError(f"--resume: {err}; resume with the preset and settings the run started with") from None
    from fl_dp_flower.app.data_split import data_split_changes
    moved = data_split_changes(contents.header, config.to_run_config())
    if moved is not None:
        raise UsageError(f"--resume: {moved}")
    if contents.open_round is not None and config.resume_unfinished_round == "refuse":
        raise UsageError(f"--resume: round {contents.open_round} of {ledger} was broadcast but has no complete round "
                         "line, so its privacy may be spent; to continue, add resume-unfinished-round='account' "
                         "(the round is accounted as planned from a single client)")
    accounted = len(contents.rounds)
    if accounted >= config.num_server_rounds:
        raise UsageError(f"--resume: all {config.num_server_rounds} rounds are already accounted in {ledger} "
                         f"({accounted}); raise num-server-rounds to train more")

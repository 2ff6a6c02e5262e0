"""Flags of the planning commands (``privacy``, ``calibrate``, ``audit``), generated from the run config.

Every key of :class:`~fl_dp_flower.app.config.AppConfig` is a flag of the same name
(``local-steps`` -> ``--local-steps``), except :data:`RUN_ONLY` (where a run writes, how it is
served, how it resumes: nothing a plan depends on). A key another engineer adds to the run
config becomes a flag here without a line of this module. Defaults are the run's own:

1. the ``[tool.flwr.app.config]`` table of ``--app`` (a folder or its pyproject.toml; default:
   the current folder's pyproject.toml when it has that table, else the package's defaults);
2. ``--preset`` (the launcher's named run configs, :mod:`fl_dp_flower.app.presets`);
3. ``--run-config "key=value ..."`` (Flower's syntax, as ``flwr run --run-config``);
4. the flags themselves.

This is the launcher's order (pyproject, preset, overrides), so ``fl-dp-flower privacy --preset
quick --run-config "sigma=0.8"`` plans exactly the run ``fl-dp-flower run --preset quick
"sigma=0.8"`` starts. Old names kept as aliases: ``--rounds`` (``--num-server-rounds``),
``--clients`` (``--clients-per-round``), ``--per-sample-clipping`` (``--clipping per-sample``).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import tomllib
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_args, get_origin

from fl_dp_flower.app.presets import PRESETS

if TYPE_CHECKING:
    from fl_dp_flower.app.config import AppConfig
    from fl_dp_flower.privacy.records import AccountantConfig

#: run-config keys (underscored) that no plan depends on: no flag for them.
RUN_ONLY = frozenset({
    "output_dir", "run_name", "resume", "resume_unfinished_round", "seed", "data_dir", "round_timeout",
    "metrics_port", "metrics_host", "metrics_certfile", "metrics_keyfile", "metrics_auth_file", "metrics_linger",
    # the server's post-processing of the aggregate and the validation split: no bound depends on them
    "server_optimizer", "server_lr", "server_lr_end", "server_momentum", "server_adam_beta2", "server_adam_eps",
    "server_weight_decay", "release_average", "release_ema_decay", "release_tail_fraction", "validation_fraction",
})
#: extra option strings of a key's flag (the planning CLI's former names).
ALIASES: dict[str, tuple[str, ...]] = {"num_server_rounds": ("--rounds",), "clients_per_round": ("--clients",)}
_UNSET = argparse.SUPPRESS  # a flag not given leaves no attribute: the lower layers decide


def _dash(name: str) -> str:
    return name.replace("_", "-")


def planning_fields() -> list[str]:
    """The AppConfig fields (underscored) that are flags, in the run config's order."""
    from fl_dp_flower.app.config import AppConfig

    return [name for name in AppConfig.model_fields if name not in RUN_ONLY]


def _parser_of(name: str, annotation: Any) -> Any:
    """argparse type of one field: a number or string; its range is checked by AppConfig."""
    from fl_dp_flower.app.config import AUTO_SIGMA, describe_range

    def parse(text: str) -> Any:
        if name == "sigma" and text == AUTO_SIGMA:
            return text
        try:
            return annotation(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: must be {describe_range(name)}") from None

    return parse


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    """``--app``, ``--preset``, ``--run-config``, one flag per planning key, and ``--json``."""
    from fl_dp_flower.app.config import AppConfig, describe_range

    parser.add_argument("--app", default=None, metavar="PATH",
                        help="Flower app folder (or its pyproject.toml) whose [tool.flwr.app.config] is the base "
                             "(default: ./pyproject.toml when it has that table, else the package's defaults)")
    parser.add_argument("--preset", choices=tuple(PRESETS), default=None,
                        help="a named run config of `fl-dp-flower run --preset`, over the app's table")
    parser.add_argument("--run-config", default="", metavar='"KEY=VALUE ..."',
                        help="run-config overrides as for `flwr run --run-config` (over the preset; "
                             "flags override them)")
    group = parser.add_argument_group("run config (each flag overrides the key of the same name; "
                                      "default: the app's value)")
    for name in planning_fields():
        info = AppConfig.model_fields[name]
        ann, flags = info.annotation, [f"--{_dash(name)}", *ALIASES.get(name, ())]
        text = (info.description + "; " if info.description else "") + describe_range(name)
        text = (text + f"; package default {info.default!r}").replace("%", "%%")
        if ann is bool:
            group.add_argument(*flags, dest=name, action=argparse.BooleanOptionalAction, default=_UNSET,
                               help=text)
        elif get_origin(ann) is Literal:
            group.add_argument(*flags, dest=name, choices=get_args(ann), default=_UNSET, help=text)
        else:
            group.add_argument(*flags, dest=name, type=_parser_of(name, ann), default=_UNSET, metavar="X",
                               help=text)
    group.add_argument("--per-sample-clipping", dest="clipping", action="store_const", const="per-sample",
                       default=_UNSET, help="the same as --clipping per-sample")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def app_run_config(app: str | None) -> tuple[dict[str, Any], str]:
    """(the ``[tool.flwr.app.config]`` table, where it came from) for ``--app``."""
    if app is None:
        candidate = Path("pyproject.toml")
        if candidate.is_file() and "config" in tomllib.loads(candidate.read_text()).get(
                "tool", {}).get("flwr", {}).get("app", {}):
            return _table(candidate), str(candidate.resolve())
        return {}, "the package's defaults"
    path = Path(app)
    path = path / "pyproject.toml" if path.is_dir() else path
    if not path.is_file():
        raise ValueError(f"--app {app}: no pyproject.toml at {path}")
    return _table(path), str(path.resolve())


def _table(path: Path) -> dict[str, Any]:
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as err:
        raise ValueError(f"--app: {path} is not valid TOML ({err})") from None
    table = data.get("tool", {}).get("flwr", {}).get("app", {}).get("config")
    if isinstance(table, dict):
        return table
    raise ValueError(f"--app: {path} has no [tool.flwr.app.config] table")


def resolve(args: argparse.Namespace, parser: argparse.ArgumentParser) -> AppConfig:
    """The run config the plan is about (layers as in the module docstring); exits 2 on bad input.

    Also sets ``args.config`` (the AppConfig), ``args.config_source`` (the layers, in words), every
    planning key as resolved (``args.sigma``, ``args.threat_model``, ...) and the former names
    ``args.rounds``, ``args.clients``, ``args.per_sample_clipping``.
    """
    from fl_dp_flower.app.config import AppConfig, ConfigError, with_auto_sigma
    from fl_dp_flower.app.run_plan import UsageError, parse_overrides

    try:
        base, source = app_run_config(args.app)
        overrides = parse_overrides(args.run_config)
    except (ValueError, UsageError) as err:
        parser.error(str(err))
    known = {_dash(name) for name in AppConfig.model_fields}
    ignored = sorted(key for key in base if key not in known)
    if ignored:  # a user's own app has its own keys: planning needs only the package's
        print(f"note: ignoring run-config key(s) {', '.join(ignored)} of {source}: not fl-dp-flower keys, they do not "
              "change the plan", file=sys.stderr)
        base = {key: value for key, value in base.items() if key in known}
    flags = {_dash(name): getattr(args, name) for name in planning_fields() if hasattr(args, name)}
    user = with_auto_sigma({**overrides, **flags})  # target-epsilon without sigma picks sigma, as in `run`
    values = {**base, **(PRESETS[args.preset] if args.preset else {}), **user}
    try:
        config = AppConfig.from_run_config(values)
    except ConfigError as err:
        parser.error(flagged(str(err)))
    layers = [source] + ([f"preset {args.preset}"] if args.preset else []) + (
        [f'--run-config "{args.run_config}"'] if overrides else []) + (["flags"] if flags else [])
    args.config, args.config_source = config, " + ".join(layers)
    for name in planning_fields():  # every key as resolved, for code that reads args.<key>
        setattr(args, name, getattr(config, name))
    args.rounds, args.clients = config.num_server_rounds, config.clients_per_round
    args.per_sample_clipping = config.clipping == "per-sample"
    return config


#: AccountantConfig field -> run-config key, for the accountant's own validation messages.
_ACCOUNTANT_KEYS = {"clients": "clients-per-round", "prox_alpha": "prox-alpha", "clip_norm": "clip-norm",
                    "local_steps": "local-steps", "batch_size": "batch-size", "threat_model": "threat-model",
                    "cyclic_c": "cyclic-c", "iterative_z": "iterative-z", "target_epsilon": "target-epsilon"}


def flagged(message: str) -> str:
    """Name the flag beside each run-config key a message cites: ``'lr'`` -> ``'lr' (--lr)``."""
    from fl_dp_flower.app.config import AppConfig

    keys = {_dash(n) for n in AppConfig.model_fields} - {_dash(n) for n in RUN_ONLY}
    message = re.sub(r"'([a-z][a-z-]*)'", lambda m: f"'{m[1]}' (--{m[1]})" if m[1] in keys else m[0], message)
    for field, key in _ACCOUNTANT_KEYS.items():
        message = re.sub(rf"(?<![-'\w]){field}(?![-\w])", f"{key} (--{key})", message)  # not inside a dash key
    return message


def planned_accountant_config(args: argparse.Namespace, parser: argparse.ArgumentParser,
                              sigma: float | None = None) -> AccountantConfig:
    """The planned run as the accountant sees it (the resolved run config, at ``sigma`` when given);
    a validation error exits through ``parser.error`` naming the flags (``privacy``, ``calibrate``, ``audit``)."""
    import dataclasses

    config = args.config if getattr(args, "config", None) is not None else resolve(args, parser)
    try:
        acct = config.accountant_config()
        return acct if sigma is None or sigma == acct.sigma else dataclasses.replace(acct, sigma=sigma)
    except ValueError as exc:
        parser.error(flagged(str(exc)))
    raise AssertionError("unreachable")


def fmt_number(x: float) -> str:
    """A bound's number in tables: 6 significant digits, 'inf' for an infinite one."""
    return "inf" if math.isinf(x) else f"{x:.6g}"


def _clients(c: AppConfig) -> str:
    if c.client_sampling == "poisson":
        planned = c.federation_settings().planned_clients
        return f"Poisson sampling q {c.sampling_rate:g} of N {c.clients_per_round} clients (plan: {planned}/round)"
    return f"m {c.clients_per_round} clients/round"


def settings_line(args: argparse.Namespace) -> str:
    """The planned run in one line, defaults included (what ``privacy`` with no flag really means)."""
    c = args.config
    extra = f", alpha {c.prox_alpha:g}" if c.algorithm == "fedprox" else ""
    clipping = f"per-sample (B {c.batch_size})" if c.clipping == "per-sample" else f"per-batch (B {c.batch_size})"
    return (f"{c.algorithm}{extra}, {c.schedule} schedule, lr {c.lr:g}, K {c.local_steps}, V {c.clip_norm:g}, "
            f"{_clients(c)}, T {c.num_server_rounds} rounds, L {c.smoothness:g}, "
            f"{clipping} clipping, {c.colluding_clients} colluding client(s)\nrun config: {args.config_source}")

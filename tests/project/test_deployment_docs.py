"""Static checks of the operator's commands in docs/deployment.md and the pages that repeat them.

* every ``flwr <command> ...`` line in a code block of the README and docs/ parses with the installed
  flwr CLI (command, sub-command, options, argument types; ``<placeholders>`` become ``1``), so a
  renamed or removed option of Flower fails here, not on an operator's terminal;
* the systemd units of docs/deployment.md (SuperLink and SuperNode) are complete: absolute
  ``ExecStart`` into the venv, ``UMask=0077``, restart, network ordering, and the SuperNode's
  ``--node-config`` (one systemd argument) parses with Flower's parser into the guardrails;
  (their flags are checked against ``--help`` in tests/project/test_docker_files.py);
* a documented deployment run with a privacy budget certifies at a useful delta: the screening drops'
  charge (docs/MATH.md §17.1, (1 + e^eps) x the summed check levels) must not swamp ``delta``.
  With the default levels (1e-12 each) the deployment example certified at delta = 1e-5 + 1 from round 2
  on (measured with real processes), which certifies nothing.
"""

from __future__ import annotations

import dataclasses
import re
import shlex

import click
import pytest
import typer.main
from flwr.cli.app import app as flwr_app
from flwr.common.config import parse_config_args

from doc_commands import DOCS, ROOT, _joined_blocks, documented_run_configs, parse_overrides, pyproject_defaults
from fl_dp_flower.app.config import AppConfig, ConfigError
from fl_dp_flower.privacy.accountant import PrivacyAccountant

DEPLOYMENT = ROOT / "docs" / "deployment.md"
FLWR = typer.main.get_command(flwr_app)


def documented_flwr_commands() -> list[tuple[str, str]]:
    """(source, the text after ``flwr``) of every flwr CLI line in a code block of README/docs."""
    found = []
    for path in DOCS:
        for line, block in _joined_blocks(path.read_text()):
            for n, text in enumerate(block.splitlines()):
                m = re.match(r"\s*(?:[A-Z_]+=\S+\s+)*flwr\s+(.*)", text)
                if m:
                    found.append((f"{path.name}:{line + n}", m.group(1).split(" #")[0]))
    return found


def parse_flwr(text: str) -> None:
    """Parse one flwr command line as the installed CLI would (no command is run)."""
    argv = shlex.split(re.sub(r"<[^>]*>", "1", text))
    cmd, used = FLWR, []
    while isinstance(cmd, click.Group):
        assert argv, f"flwr {' '.join(used)}: a sub-command is missing"
        sub = argv.pop(0)
        assert sub in cmd.commands, f"flwr {' '.join(used)} has no command {sub!r} ({sorted(cmd.commands)})"
        used.append(sub)
        cmd = cmd.commands[sub]
    cmd.make_context(" ".join(used), argv)  # raises click's UsageError / BadParameter / NoSuchOption


FLWR_COMMANDS = documented_flwr_commands()


def test_the_docs_show_the_operator_commands():
    used = {" ".join(shlex.split(text)[:2]) for _, text in FLWR_COMMANDS}
    assert {"supernode register", "supernode ls", "supernode unregister"} <= used
    assert {t.split()[0] for _, t in FLWR_COMMANDS} >= {"run", "ls", "log", "stop"}


@pytest.mark.parametrize("source, text", FLWR_COMMANDS, ids=[s for s, _ in FLWR_COMMANDS])
def test_documented_flwr_command_parses(source, text):
    try:
        parse_flwr(text)
    except (click.ClickException, AssertionError) as exc:
        raise AssertionError(f"{source}: flwr {text} is rejected by flwr's CLI: {exc}") from None


@pytest.mark.parametrize("text", ["ls prod --run-id abc", "log 1 prod --follow", "supernode remove 1 prod"])
def test_a_wrong_flwr_command_is_caught(text):
    with pytest.raises((click.ClickException, AssertionError)):
        parse_flwr(text)


# ------------------------------------------------------------------ systemd units
def units() -> dict[str, dict[str, list[str]]]:
    """{program: {key: [values]}} of every ```ini block of docs/deployment.md."""
    out = {}
    for block in re.findall(r"```ini\n(.*?)```", DEPLOYMENT.read_text(), re.S):
        keys: dict[str, list[str]] = {}
        for line in block.splitlines():
            if "=" in line and not line.startswith(("#", "[")):
                key, value = line.split("=", 1)
                keys.setdefault(key, []).append(value)
        program = shlex.split(keys["ExecStart"][0])[0].rsplit("/", 1)[-1]
        out[program] = keys
    return out


def test_systemd_units_of_superlink_and_supernode():
    found = units()
    assert set(found) == {"flower-superlink", "flower-supernode"}
    for program, keys in found.items():
        argv = shlex.split(keys["ExecStart"][0])  # systemd's quoting rules agree with shlex for these lines
        assert argv[0] == f"/opt/fl-dp/venv/bin/{program}", argv[0]  # absolute, the venv of §2.1
        assert keys["UMask"] == ["0077"] and keys["Restart"] == ["always"] and keys["User"] == ["fl-dp"]
        assert keys["Wants"] == keys["After"] == ["network-online.target"]  # After= alone does not pull it in
        env = dict(v.split("=", 1) for v in keys["Environment"])
        assert env["PATH"].startswith("/opt/fl-dp/venv/bin:")  # flower-superexec is started by name
        assert env["FLWR_HOME"] and env["FLWR_TELEMETRY_ENABLED"] == "0"
        if program == "flower-superlink":
            assert "--database" in argv and "--disable-runtime-dependency-installation" in argv
        else:
            assert env["CUDA_VISIBLE_DEVICES"] == "0"
            node_config = parse_config_args([argv[argv.index("--node-config") + 1]])
            assert node_config["partition-id"] == 0 and node_config["num-partitions"] == 2
            assert node_config["data-dir"] == "/srv/data"
            assert {"min-sigma", "max-clip-norm", "max-local-steps", "max-lr"} <= set(node_config)


# ------------------------------------------------------------------ delta with the screening charge
def certified_delta_total(text: str) -> tuple[float, AppConfig]:
    """The delta the certified epsilon holds at after every round of a run config as planned, with the
    server's screening levels charged as the strategy charges them (each round: noise-check-alpha +
    update-bound-alpha)."""
    config = AppConfig.from_run_config({**pyproject_defaults(), **parse_overrides(text)})
    acct = config.accountant_config()
    accountant = PrivacyAccountant(acct)
    level = config.noise_check_alpha + config.update_bound_alpha
    for t in range(1, config.num_server_rounds + 1):
        report = accountant.step(dataclasses.replace(acct.planned_round(t), screening_drop=level))
    return report.delta_total, config


BUDGETED = [d for d in documented_run_configs()
            if d.source.startswith("deployment.md") and "target-epsilon" in d.text and "<" not in d.text]


def test_the_deployment_docs_show_a_budgeted_run():
    assert BUDGETED


@pytest.mark.parametrize("doc", BUDGETED, ids=[d.source for d in BUDGETED])
def test_a_documented_budget_certifies_at_a_useful_delta(doc):
    delta_total, config = certified_delta_total(doc.text)
    assert delta_total <= 1.01 * config.delta, (
        f"{doc.source}: the certified epsilon holds at delta {delta_total:.3g}, not {config.delta:g}: lower "
        "noise-check-alpha / update-bound-alpha (docs/deployment.md §2.6)")


def test_the_default_screening_levels_swamp_delta_at_the_examples_epsilon():
    """What the check above catches: the same example at the default levels holds at delta = 1 (without its budget),
    and with its budget the config refuses it before round 1."""
    text = re.sub(r"\s(noise-check-alpha|update-bound-alpha)=\S+", "", BUDGETED[0].text)
    with pytest.raises(ConfigError, match="at the budget's epsilon 35"):
        certified_delta_total(text)
    delta_total, _ = certified_delta_total(re.sub(r"\starget-epsilon=\S+", "", text))
    assert delta_total == 1.0

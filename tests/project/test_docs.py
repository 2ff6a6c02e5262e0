"""Every run config the README and docs/ show is valid and trains every round it asks for.

A documented command that stops before its first round, or that a budget cuts short, would
teach a user that the package does not work. Each config is merged with the pyproject defaults,
validated by ``AppConfig`` and replayed through the accountant exactly as the strategy's budget
rules would (all ``clients-per-round`` replies arriving). The README's deployment config also
drives a real deployment run (tests/integration/test_deployment.py).
"""

from __future__ import annotations

import re

import pytest

from doc_commands import ROOT, DocRunConfig, documented_cli_commands, documented_run_configs, parse_overrides, pyproject_defaults
from fl_dp_flower.app.config import AppConfig, with_auto_sigma
from fl_dp_flower.app.presets import PRESETS
from fl_dp_flower.privacy.accountant import Budget, PrivacyAccountant
from fl_dp_flower.strategies.budget import check_before_broadcast, check_replies, BudgetExhausted

CONFIGS = [d for d in documented_run_configs() if "<" not in d.text]  # "<the same settings ...>" placeholders


def test_the_docs_show_run_configs():
    sources = {d.source.split(":")[0] for d in CONFIGS}
    assert {"README.md", "deployment.md"} <= sources and len(CONFIGS) >= 6


def rounds_that_train(config: AppConfig) -> int:
    """Rounds the strategy runs when every sampled client replies (its budget rules, exactly)."""
    acct_cfg = config.accountant_config()
    accountant = PrivacyAccountant(acct_cfg)
    budget = Budget(config.target_epsilon, config.delta) if config.target_epsilon > 0 else None
    for t in range(1, config.num_server_rounds + 1):
        record = acct_cfg.planned_round(t)
        if budget is not None:
            try:
                check_before_broadcast(accountant, budget)
                check_replies(accountant, budget, record)
            except BudgetExhausted:
                return t - 1
        accountant.step(record)
    return config.num_server_rounds


@pytest.mark.parametrize("doc", CONFIGS, ids=[d.source for d in CONFIGS])
def test_documented_run_config_trains_every_round(doc: DocRunConfig):
    preset = PRESETS[doc.preset] if doc.command == "main-job" else {}
    overrides = parse_overrides(doc.text)
    if doc.command == "main-job":  # the launcher: a target epsilon without sigma picks sigma
        overrides = with_auto_sigma(overrides)
    config = AppConfig.from_run_config({**pyproject_defaults(), **preset, **overrides})
    assert rounds_that_train(config) == config.num_server_rounds, (
        f"{doc.source}: {doc.text!r} stops after {rounds_that_train(config)} of {config.num_server_rounds} rounds")


def test_a_budget_that_cuts_a_run_short_is_detected():
    """The check above can fail: the old docs config (sigma 0.5, target 8) trained no round."""
    old = "clients-per-round=2 num-partitions=2 num-server-rounds=10 sigma=0.5 target-epsilon=8.0 min-replies=2"
    config = AppConfig.from_run_config({**pyproject_defaults(), **parse_overrides(old)})
    assert rounds_that_train(config) == 0


def test_every_run_config_key_is_in_the_configuration_table():
    """The table moved from the README to docs/configuration.md (generated; tests/project/test_docs_configuration.py)."""
    readme = (ROOT / "docs" / "configuration.md").read_text()
    documented = set(re.findall(r"^\| `([a-z0-9-]+)`", readme, re.M))
    documented |= set(re.findall(r"^\| `[a-z0-9-]+`, `([a-z0-9-]+)`", readme, re.M))
    assert set(pyproject_defaults()) <= documented, sorted(set(pyproject_defaults()) - documented)


def test_every_math_reference_points_at_a_section_of_docs_math():
    headings = set(re.findall(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", (ROOT / "docs" / "MATH.md").read_text(), re.M))
    cited: dict[str, list[str]] = {}
    for path in [*ROOT.glob("fl_dp_flower/**/*.py"), *ROOT.glob("tests/**/*.py"), *ROOT.glob("bench/*.py"),
                 ROOT / "README.md", *ROOT.glob("docs/*.md")]:
        for ref in re.findall(r"MATH\.md §(\d+(?:\.\d+)?)", path.read_text()):
            cited.setdefault(ref, []).append(path.name)
    assert len(cited) >= 15
    missing = {ref: where for ref, where in cited.items() if ref not in headings}
    assert not missing, missing
    # every document the package cites by section is one a user has: a file of this repo
    for path in ROOT.glob("fl_dp_flower/**/*.py"):
        for doc in re.findall(r"([\w./-]+\.md) §", path.read_text()):
            assert (ROOT / doc).is_file(), f"{path.name} cites {doc}, which is not in the repository"


CLI_COMMANDS = documented_cli_commands()


def test_the_docs_show_cli_commands():
    assert {argv[0] for _, argv in CLI_COMMANDS} >= {"privacy", "calibrate", "audit", "watch", "verify", "sensitivity"}


@pytest.mark.parametrize("source, argv", CLI_COMMANDS, ids=[s for s, _ in CLI_COMMANDS])
def test_documented_cli_command_parses(source, argv):
    """Every documented ``fl-dp-flower`` command is accepted by the CLI's parser (flags and ranges)."""
    from fl_dp_flower.app.cli import build_parser

    try:
        build_parser().parse_args(argv)
    except SystemExit as exc:  # argparse's error exit
        raise AssertionError(f"{source}: fl-dp-flower {' '.join(argv)} is rejected (exit {exc.code})") from None


PLANNING = [(s, argv) for s, argv in CLI_COMMANDS if argv[0] in ("privacy", "calibrate")]


@pytest.mark.parametrize("source, argv", PLANNING, ids=[s for s, _ in PLANNING])
def test_documented_planning_command_runs(source, argv, capsys):
    """Every documented ``privacy`` / ``calibrate`` command runs to exit 0 (not only parses: the run
    config's cross-checks, e.g. final-model's assertions, apply to the planners too)."""
    from fl_dp_flower.app.cli import main

    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    assert code == 0, f"{source}: fl-dp-flower {' '.join(argv)} exits {code}: {capsys.readouterr().err[-600:]}"

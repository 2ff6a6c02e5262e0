"""docs/library.md's python blocks, written to files under their ``# <name>.py`` headers and run as written on
an in-process grid (the ``run_simulation`` block is compiled only: Ray takes too long for a test; it was run
by hand, and my_check.py runs the same apps)."""

from __future__ import annotations

import importlib
import json
import math
import re
import sys
from pathlib import Path

import pytest
from flwr.app import ArrayRecord, Context, RecordDict

from fl_dp_flower.testing import LocalGrid, task_identity

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "library.md"
BLOCKS = {block.split("\n", 1)[0].lstrip("# ").strip(): block
          for block in re.findall(r"```python\n(.*?)```", PAGE.read_text(), re.S) if block.startswith("# ")}
MODULES = [name.removesuffix(".py") for name in BLOCKS]


@pytest.fixture
def page(tmp_path, monkeypatch):
    """The page's files in a fresh folder, importable, with the ledger written there."""
    for name, block in BLOCKS.items():
        (tmp_path / name).write_text(block)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.chdir(tmp_path)
    for module in MODULES:
        monkeypatch.delitem(sys.modules, module, raising=False)
    yield tmp_path
    for module in MODULES:
        sys.modules.pop(module, None)


def _context() -> Context:
    return Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})


def _rounds(ledger: Path) -> list[dict]:
    return [e for e in map(json.loads, ledger.read_text().splitlines()) if e["kind"] == "round"]


def test_the_page_has_every_step():
    assert set(BLOCKS) == {"my_task.py", "my_plan.py", "my_apps.py", "my_simulation.py", "my_check.py",
                           "my_poisson.py", "my_flower_dp.py", "my_own_loop.py"}
    compile(BLOCKS["my_simulation.py"], "docs/library.md:my_simulation.py", "exec")
    from flwr.simulation import run_simulation  # noqa: F401  (what the block imports)


def test_the_plan_fits_the_budget_in_every_round(page, capsys):
    plan = importlib.import_module("my_plan")
    assert capsys.readouterr().out.strip() == f"sigma {plan.sigma}: certified epsilon 7.994 (composition)"
    assert plan.planned.rounds == 10 and plan.settings.sigma == 1.343


def test_the_apps_train_every_planned_round_and_the_ledger_verifies(page, capsys):
    from fl_dp_flower.app.cli import main as cli

    importlib.import_module("my_check")  # runs the ServerApp on a LocalGrid of 4 nodes
    out = capsys.readouterr().out
    assert "epsilon 7.994 at delta 1.01e-05 after 10 rounds (composition)" in out
    assert "'dp-certified-epsilon': 7.99" in out
    rounds = _rounds(page / "outputs" / "ledger.jsonl")
    assert len(rounds) == 10 and rounds[-1]["report"]["certified"]["epsilon"] <= 8.0
    assert cli(["verify", "outputs/ledger.jsonl"]) == 0


def test_poisson_sampling_is_accounted_with_the_sampled_bound(page):
    poisson = importlib.import_module("my_poisson")
    apps = importlib.import_module("my_apps")
    with task_identity():
        poisson.strategy.start(grid=LocalGrid(apps.client_app, 4),
                               initial_arrays=ArrayRecord(importlib.import_module("my_task").LogReg().state_dict()))
    spent = poisson.strategy.privacy_spent()
    assert spent.num_releases == 5 and spent.bound == "sampled"


def test_flowers_wrapper_with_the_gdp_accountant(page, capsys):
    flower = importlib.import_module("my_flower_dp")
    with task_identity():
        flower.main(LocalGrid(flower.client_app, 4), _context())
    mu = float(capsys.readouterr().out.strip().rsplit("mu ", 1)[1])
    assert mu == pytest.approx(math.sqrt(5), rel=1e-12)


def test_the_own_loop_trains_like_dp_train(page, caplog):
    apps, own = importlib.import_module("my_apps"), importlib.import_module("my_own_loop")
    with task_identity():
        apps.main(LocalGrid(own.client_app, 4), _context())
    assert len(_rounds(page / "outputs" / "ledger.jsonl")) == 10
    assert "dropped reply" not in caplog.text


def _mistakes():
    """The construction-time rows of the page's mistakes table: (row, call, error, message)."""
    from fl_dp_flower import Budget, DPSettings, FederationSettings, NoisyFedAvg, PrivacyAccountant, open_ledger

    good = dict(sigma=0.5, clip_norm=1.0, local_steps=5, batch_size=32, lr=0.1)
    settings, federation = DPSettings(**good), FederationSettings(clients_per_round=3)
    plan = settings.accountant_config(clients=3)
    poisson = FederationSettings(clients_per_round=4, client_sampling="poisson", sampling_rate=0.5)

    def resume_with_other_sigma(tmp: Path):
        ledger, _ = open_ledger(tmp / "ledger.jsonl", plan)
        with ledger:  # the ledger is created with its first line (a run that wrote nothing leaves no file)
            ledger.on_event("round-open", {"round": 1})
        open_ledger(tmp / "ledger.jsonl", DPSettings(**{**good, "sigma": 0.7}).accountant_config(clients=3), resume=True)

    return [
        ("sigma=-1", lambda tmp: DPSettings(**{**good, "sigma": -1}), ValueError, "sigma must be a finite number > 0"),
        ('"0.5"', lambda tmp: DPSettings(**{**good, "sigma": "0.5"}), ValueError, "sigma must be a number > 0"),
        ("lr=0", lambda tmp: DPSettings(**{**good, "lr": 0}), ValueError, "lr must be a finite number > 0"),
        ('schedule="linear"', lambda tmp: DPSettings(**{**good, "schedule": "linear"}), ValueError,
         "schedule must be one of"),
        ("sampling_rate=1.5", lambda tmp: FederationSettings(client_sampling="poisson", sampling_rate=1.5), ValueError,
         r"sampling_rate must be in \(0, 1\]"),
        ("delta=0.5", lambda tmp: settings.accountant_config(clients=3, delta=0.5), ValueError,
         r"delta must be a number in \(0, 0.1\)"),
        ("other settings", lambda tmp: NoisyFedAvg(DPSettings(**{**good, "sigma": 1.0}), PrivacyAccountant(plan),
                                                   federation=federation), ValueError,
         r"sigma: accountant 0.5 != settings 1.0"),
        ("no accountant", lambda tmp: NoisyFedAvg(settings, None, federation=federation), TypeError,
         "accountant must be a fl_dp_flower PrivacyAccountant"),
        ("tuple budget", lambda tmp: NoisyFedAvg(settings, PrivacyAccountant(plan), federation=federation,
                                                 budget=(8, 1e-5)), TypeError, "budget must be a Budget or None"),
        ("budget delta", lambda tmp: NoisyFedAvg(settings, PrivacyAccountant(plan), federation=federation,
                                                 budget=Budget(8, 1e-6)), ValueError, "budget delta 1e-06 != the accountant's"),
        ("poisson with clients=", lambda tmp: settings.accountant_config(clients=2, population=4, sampling_rate=0.5),
         ValueError, r"name the population: accountant_config\(population=N, sampling_rate=q\)"),
        ("poisson without sampling_rate", lambda tmp: NoisyFedAvg(settings, PrivacyAccountant(
            settings.accountant_config(clients=3)), federation=poisson), ValueError, "expected 0.5"),
        ("resume, other sigma", resume_with_other_sigma, ValueError, r"differs in key\(s\) \['sigma'\]"),
        ("fraction_train=0.5", lambda tmp: NoisyFedAvg(settings, PrivacyAccountant(plan), federation=federation,
                                                       fraction_train=0.5), TypeError,
         r"FederationSettings\(clients_per_round=k\).*client_sampling='poisson', sampling_rate=q"),
    ]


@pytest.mark.parametrize("row, call, error, message", _mistakes(), ids=[m[0] for m in _mistakes()])
def test_the_mistakes_table_errors_name_the_field(row, call, error, message, tmp_path):
    """What the page's table says each mistake gives, raised before round 1."""
    with pytest.raises(error, match=message):
        call(tmp_path)

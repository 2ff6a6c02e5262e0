"""Planning and running agree by construction (issue 21.2, 21.3).

``fl-dp-flower privacy --preset quick --run-config "..."`` is compared, round for round, with the
ledger of the run the launcher would start with the same preset and overrides: the launcher's own
``make_plan`` resolves the run config, and the real ServerApp (``run_server``) runs it on the real
ClientApp in process (fl_dp_flower.testing), with the run's accountant and budget rule.
"""

from __future__ import annotations

import argparse
import json
import math

import pytest
from fl_dp_flower.app.testing import run_local

from fl_dp_flower.app.serverapp import LEDGER, SUMMARY
from fl_dp_flower.app.cli import main
from fl_dp_flower.privacy import gdp
from fl_dp_flower.reporting import read_ledger
from fl_dp_flower.app.run_plan import make_plan

# A few quick rounds on 3 in-process nodes (the quick preset's keys are the pyproject's).
SMALL = ("clients-per-round=3 num-partitions=3 min-replies=1 local-steps=2 batch-size=16 lr=0.05 "
         "num-server-rounds=3 seed=0")


def _launcher_config(tmp_path, overrides: str, name: str):
    args = argparse.Namespace(overrides=[overrides], preset="quick", run_name=name, output_dir=str(tmp_path),
                              resume=False, supernodes=None, allow_fixed_seed=True)
    return make_plan(args).config


def _planned(capsys, overrides: str) -> dict:
    assert main(["privacy", "--preset", "quick", "--run-config", overrides, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def _ledger_epsilons(config) -> list[float]:
    out, _ = run_local(config)
    return [r["report"]["certified"]["epsilon"] for r in read_ledger(out.run_dir / LEDGER).rounds]


def test_privacy_with_the_quick_preset_equals_its_run_round_for_round(tmp_path, capsys):
    overrides = SMALL + " sigma=0.8"
    planned = _planned(capsys, overrides)
    config = _launcher_config(tmp_path, overrides, "fixed-sigma")
    assert planned["run_config"]["values"] == config.to_run_config() | {
        k: planned["run_config"]["values"][k] for k in ("output-dir", "run-name")}
    ran = _ledger_epsilons(config)
    assert len(ran) == 3
    assert [r["epsilon"] for r in planned["per_round"]] == pytest.approx(ran, rel=1e-12)
    assert planned["certified"]["epsilon"] == pytest.approx(ran[-1], rel=1e-9)  # the closed form, too
    # independent reference (docs/MATH.md §7.1, §14.2a): constant FedAvg, per-batch clipping,
    # replace-one, one colluding participant: mu = sqrt(T) * 2 K lr V / (sigma sqrt(m - 1)), V = 2
    mu = math.sqrt(3) * 2 * 2 * 0.05 * 2.0 / (0.8 * math.sqrt(3 - 1))
    assert ran[-1] == pytest.approx(gdp.epsilon(mu, 1e-5), rel=1e-9)


def test_sigma_auto_trains_every_round_within_the_target_and_planning_agrees(tmp_path, capsys):
    overrides = SMALL + " sigma='auto' target-epsilon=4.0"
    planned = _planned(capsys, overrides)
    config = _launcher_config(tmp_path, overrides, "auto")
    assert config.sigma == planned["sigma"] == config.sigma_calibration.sigma
    ran = _ledger_epsilons(config)
    assert len(ran) == 3 and ran[-1] <= 4.0 and ran[-1] == pytest.approx(4.0, rel=1e-3)
    assert [r["epsilon"] for r in planned["per_round"]] == pytest.approx(ran, rel=1e-12)
    assert any("calibrated sigma = " in note for note in planned["notes"])


def test_a_budget_that_stops_the_run_early_stops_the_plan_at_the_same_round(tmp_path, capsys):
    overrides = SMALL + " sigma=0.8 target-epsilon=1.7"  # round 1: eps 1.356, round 2: 1.993 (c = 1)
    planned = _planned(capsys, overrides)
    config = _launcher_config(tmp_path, overrides, "budget")
    out, _ = run_local(config)
    ran = [r["report"]["certified"]["epsilon"] for r in read_ledger(out.run_dir / LEDGER).rounds]
    assert planned["stopped_by_budget"] and 0 < len(ran) < 3
    assert [r["epsilon"] for r in planned["per_round"]] == pytest.approx(ran, rel=1e-12)
    assert json.loads((out.run_dir / SUMMARY).read_text())["stopped_by_budget"]
    assert any(f"stops the run after round {len(ran)} of 3" in note for note in planned["notes"])

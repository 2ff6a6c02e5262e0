"""A whole run under threat-model "secure-aggregation" (docs/MATH.md §20): the real ServerApp and ClientApp
on the in-process grid, every train round through SecAgg+ with the integer upload; the ledger certifies
the Skellam bound of the clients in each sum, and verify reproduces it."""

from __future__ import annotations

import json
import math

import pytest

from fl_dp_flower.app.threat import node_assumptions, run_grid
from fl_dp_flower.app.config import AppConfig
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.reporting.ledger import read_ledger
from fl_dp_flower.reporting.verify import verify_ledger
from fl_dp_flower.strategies.secagg import SecAggGrid
from fl_dp_flower.testing import LocalGrid
from fl_dp_flower.app.testing import run_local, tiny_config
from fl_dp_flower.training.models import parameter_count


def test_a_run_certifies_the_skellam_bound_of_the_secure_sums(tmp_path):
    config = tiny_config(tmp_path, **{"threat-model": "secure-aggregation", "clients-per-round": 5,
                                      "num-partitions": 5, "min-replies": 5, "num-server-rounds": 2,
                                      "model": "cnn-tanh"})
    outcome, _ = run_local(config, nodes=5, copy_content=True)
    ledger = tmp_path / "run" / "ledger.jsonl"
    contents = read_ledger(ledger)
    assert [line["record"]["node_ids"] for line in contents.rounds] == [[1, 2, 3, 4, 5]] * 2
    header = contents.header["accountant_config"]
    assert header["sum_dimension"] == parameter_count(config.dataset, "cnn-tanh") == 26_010  # the model's size
    assert header["sum_grid_step"] > 0
    report = contents.rounds[-1]["report"]
    assert report["certified"]["bound"] == "secure_aggregation" and math.isinf(report["certified"]["mu"])
    assert any("Skellam" in a for a in report["certified"]["assumes"])
    # the same number from the config alone: the accountant over the planned rounds
    planned = PrivacyAccountant(config.accountant_config())
    planned.extend(config.accountant_config().planned_round(t) for t in (1, 2))
    assert report["certified"]["epsilon"] == pytest.approx(planned.report().certified.epsilon, rel=1e-12)
    assert verify_ledger(ledger).ok
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_report"]["certified"]["bound"] == "secure_aggregation"
    assert any("Skellam" in a for a in summary["node_assumptions"])
    del outcome


def test_the_run_grid_is_secagg_only_under_secure_aggregation(tmp_path):
    grid = LocalGrid(None, 2, {})
    assert run_grid(grid, AppConfig.from_run_config({"threat-model": "all-rounds"})) is grid
    config = AppConfig.from_run_config({"threat-model": "secure-aggregation", "secagg-num-shares": 5,
                                        "clients-per-round": 8, "min-replies": 5})
    wrapped = run_grid(grid, config)
    assert isinstance(wrapped, SecAggGrid) and wrapped.grid == config.secure_sum_grid()
    assert any("Skellam" in a for a in node_assumptions(config))


@pytest.mark.parametrize("keys, message", [
    ({"clients-per-node": 4}, "needs 'clients-per-node' = 1"),
    ({"sigma": "auto", "target-epsilon": 4.0}, "not available with threat-model 'secure-aggregation'"),
    ({"client-sampling": "poisson", "sampling-rate": 0.5}, "secure-aggregation"),
    ({"min-replies": 4}, "'min-replies' - 'colluding-clients' >= 4"),
    ({"secagg-num-shares": 4}, "'secagg-num-shares' = 0 or >= 5"),
])
def test_what_secure_aggregation_cannot_combine_with_is_refused_naming_the_key(keys, message):
    with pytest.raises(Exception, match=message):
        AppConfig.from_run_config({"threat-model": "secure-aggregation", "clients-per-round": 8, "min-replies": 5,
                                   **keys})

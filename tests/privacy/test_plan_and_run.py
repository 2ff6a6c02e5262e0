"""plan_and_run: the plan and the per-round replay of the same rounds from one replay, equal to plan() and
planned_run() apart (the CLI's `privacy` command prints both)."""

from __future__ import annotations

import pytest

from fl_dp_flower.privacy.planning import plan, plan_and_run, planned_run
from fl_dp_flower.privacy.records import AccountantConfig

_BASE = {"lr": 0.5, "local_steps": 1, "clip_norm": 1.0, "sigma": 1.0, "clipping": "per-sample", "batch_size": 1}
CONFIGS = {
    "secret sample": {**_BASE, "clients": 90, "population": 900, "sample_secrecy": "secret", "colluders": 1},
    "Poisson clients": {**_BASE, "clients": 10, "sampling_rate": 0.5, "population": 20, "colluders": 1},
    "Poisson batches": {**_BASE, "clients": 1, "batch_size": 8, "batch_rate": 0.1, "colluders": 0},
    "closed form": {**_BASE, "clients": 10, "colluders": 1},
}


@pytest.mark.parametrize("name", CONFIGS)
def test_one_replay_gives_the_plan_and_the_run(name):
    config = AccountantConfig(**CONFIGS[name])
    planned, run = plan_and_run(config, 12)
    assert planned.to_dict() == plan(config, 12).to_dict()
    assert [r.to_dict() for r in run.reports] == [r.to_dict() for r in planned_run(config, 12).reports]
    assert len(run.reports) == 12


def test_a_run_stopped_by_its_budget_still_plans_every_round():
    config = AccountantConfig(**CONFIGS["secret sample"])
    full = plan(config, 12)
    budget = planned_run(config, 12).reports[5].certified.epsilon  # the sixth round's epsilon: the seventh exceeds it
    planned, run = plan_and_run(config, 12, budget)
    assert run.stopped_by_budget and run.rounds_trained == 6
    assert planned.to_dict() == full.to_dict() and planned.rounds == 12

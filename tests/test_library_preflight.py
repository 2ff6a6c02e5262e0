"""Issue 30 item 5: the reference app's preflight (early budget stop and the sigma that would fit, a
budget no round fits, noise that drowns the signal) for library users: a public function
(fl_dp_flower.preflight_notes) and the strategy's log before round 1."""

from __future__ import annotations

import dataclasses
import logging

from flwr.app import ArrayRecord
from flwr.clientapp import ClientApp

from fl_dp_flower import (Budget, DPSettings, FederationSettings, NoisyFedAvg, PrivacyAccountant, dp_train,
                          preflight_notes)
from fl_dp_flower.privacy.planning import planned_run
from fl_dp_flower.testing import LocalGrid, task_identity
from tests.test_public_api import NODES, TinyNet, load_data

SETTINGS = DPSettings(sigma=0.5, clip_norm=1.0, local_steps=2, batch_size=8, lr=0.1)
PLAN = SETTINGS.accountant_config(clients=NODES)
TEN_ROUNDS_EPS = planned_run(PLAN, 10).reports[-1].certified.epsilon


def test_an_early_budget_stop_is_said_with_the_sigma_that_fits():
    target = planned_run(PLAN, 3).reports[-1].certified.epsilon * 1.0001  # fits 3 of 10 planned rounds
    [note] = preflight_notes(PLAN, 10, target_epsilon=target)
    assert "stops the run after round 3 of 10" in note
    sigma = float(note.rsplit("sigma >= ", 1)[1].split()[0])
    # independent of the note's arithmetic: at that sigma the accountant's own replay trains all 10 rounds,
    # 1% below it does not
    assert not planned_run(dataclasses.replace(PLAN, sigma=sigma), 10, target).stopped_by_budget
    assert planned_run(dataclasses.replace(PLAN, sigma=sigma * 0.99), 10, target).stopped_by_budget
    assert preflight_notes(PLAN, 10, target_epsilon=TEN_ROUNDS_EPS * 1.0001) == []


def test_a_budget_no_round_fits_and_drowning_noise_are_warned():
    first = planned_run(PLAN, 1).reports[0].certified.epsilon
    [note] = preflight_notes(PLAN, 10, target_epsilon=first / 2)
    assert note.startswith("warning: budget epsilon") and "fits no round" in note
    # 4 clients, sigma 5, 10,000 values: noise sqrt(10) * 5 * sqrt(10000 / 4) = 790 >> 10 rounds x 0.2
    loud = dataclasses.replace(PLAN, sigma=5.0, clients=4)
    [drown] = preflight_notes(loud, 10, dimension=10_000)
    assert "the planned noise drowns the learning signal" in drown and "790.6" in drown
    assert preflight_notes(PLAN, 10, dimension=10) == []


def test_the_strategy_logs_the_preflight_before_round_1(caplog):
    caplog.set_level(logging.WARNING)
    target = planned_run(PLAN, 2).reports[-1].certified.epsilon * 1.0001
    strategy = NoisyFedAvg(SETTINGS, PrivacyAccountant(PLAN), budget=Budget(target, PLAN.delta),
                           federation=FederationSettings(clients_per_round=NODES, num_server_rounds=4))
    app = ClientApp()
    app.train()(dp_train(TinyNet, load_data))
    with task_identity():
        strategy.start(grid=LocalGrid(app, NODES), initial_arrays=ArrayRecord(TinyNet().state_dict()))
    messages = [r.getMessage() for r in caplog.records]
    said = next(i for i, m in enumerate(messages) if "preflight: warning: budget epsilon" in m)
    assert "stops the run after round 2 of 4" in messages[said]
    assert strategy.accountant.num_releases == 2


def test_a_budget_no_round_fits_is_refused_before_round_1():
    """Review U1: the strategy warned, then started and trained nothing; now start() refuses before any broadcast."""
    import pytest

    from fl_dp_flower.strategies.pending import BudgetFitsNoRound

    first = planned_run(PLAN, 1).reports[0].certified.epsilon
    strategy = NoisyFedAvg(SETTINGS, PrivacyAccountant(PLAN), budget=Budget(first / 2, PLAN.delta),
                           federation=FederationSettings(clients_per_round=NODES, num_server_rounds=4))
    app = ClientApp()
    app.train()(dp_train(TinyNet, load_data))
    grid = LocalGrid(app, NODES)
    with task_identity(), pytest.raises(BudgetFitsNoRound, match="fits no round: the first planned round alone"):
        strategy.start(grid=grid, initial_arrays=ArrayRecord(TinyNet().state_dict()))
    assert strategy.accountant.num_releases == 0


def test_a_budget_whose_screening_charge_swamps_delta_is_refused_at_construction():
    """Review U1: Budget(100, 1e-5) ran and privacy_spent() said delta 1.0; the screening checks' charge at the
    budget's epsilon, (1 + e^eps) x rounds x levels (docs/MATH.md §17.1), now has to stay within delta / 10."""
    import pytest

    from fl_dp_flower.reply_checks import ReplyChecks

    federation = FederationSettings(clients_per_round=NODES, num_server_rounds=5)
    with pytest.raises(ValueError, match=r"at the budget's epsilon 35, noise_check_alpha \+ update_bound_alpha"):
        NoisyFedAvg(SETTINGS, PrivacyAccountant(PLAN), budget=Budget(35.0, PLAN.delta), federation=federation)
    NoisyFedAvg(SETTINGS, PrivacyAccountant(PLAN), budget=Budget(35.0, PLAN.delta), federation=federation,
                reply_checks=ReplyChecks(noise_check_alpha=1e-23, update_bound_alpha=1e-23))
    NoisyFedAvg(SETTINGS, PrivacyAccountant(PLAN), budget=Budget(4.0, PLAN.delta), federation=federation)


def test_the_budget_stop_also_holds_the_delta_with_the_screening_charge():
    """Review V1: the construction-time rule (charge at the budget's epsilon over num_server_rounds) was bypassed by
    start(num_rounds=60) and by a resume whose earlier rounds ran at larger levels (delta_total 2e-5 and 1.0 under a
    Budget(35, 1e-5)). The budget stop itself now refuses a round whose guarantee would hold only at a delta past
    1.1 x the budget's, screening charge included (Budget.exceeded_by)."""
    from fl_dp_flower.reply_checks import ReplyChecks

    settings = DPSettings(sigma=0.15, clip_norm=1.0, local_steps=1, batch_size=8, lr=0.1)
    plan = settings.accountant_config(clients=NODES)
    budget = Budget(35.0, plan.delta)
    accountant = PrivacyAccountant(plan)
    strategy = NoisyFedAvg(settings, accountant, budget=budget,
                           federation=FederationSettings(clients_per_round=NODES, num_server_rounds=2),
                           reply_checks=ReplyChecks(noise_check_alpha=1.5e-22, update_bound_alpha=1.5e-22))
    app = ClientApp()
    app.train()(dp_train(TinyNet, load_data))
    with task_identity():
        strategy.start(grid=LocalGrid(app, NODES), initial_arrays=ArrayRecord(TinyNet().state_dict()), num_rounds=60)
    report = accountant.report()
    assert strategy.stop_reason is not None and "past 1.1 x the budget's delta" in strategy.stop_reason
    assert report.certified.epsilon <= 35.0 and report.delta_total <= 1.1 * plan.delta < report.delta_total * 1.1
    # a resume whose earlier rounds ran at the default levels: no further round fits
    earlier = PrivacyAccountant(plan)
    earlier.extend(dataclasses.replace(plan.planned_round(t), screening_drop=2e-12) for t in range(1, 11))
    assert earlier.would_exceed(dataclasses.replace(plan.planned_round(11), screening_drop=2e-23), budget)

"""The budget rule of the secure-aggregation threat model (strategies/budget.py, docs/MATH.md §20): the sum
is revealed at unmasking, so the check runs before the broadcast at the fewest contributors the protocol
unmasks, and a round that arrived is never discarded unaccounted."""

from __future__ import annotations

import dataclasses

import pytest

from fl_dp_flower.privacy.accountant import Budget, PrivacyAccountant
from fl_dp_flower.privacy.records import AccountantConfig
from fl_dp_flower.strategies.budget import BudgetExhausted, check_before_broadcast, check_replies, pre_broadcast_record

CONFIG = AccountantConfig(lr=0.1, local_steps=2, clip_norm=1.0, clients=20, sigma=1.0, colluders=1,
                          threat_model="secure-aggregation")


def test_the_pre_broadcast_record_is_the_costliest_sum_that_can_be_unmasked():
    acc = PrivacyAccountant(CONFIG)
    assert pre_broadcast_record(acc, 5).weights == pytest.approx([0.2] * 5)
    assert pre_broadcast_record(acc).clients == 1  # not told: local DP
    assert pre_broadcast_record(acc, 50).clients == 20  # never more than planned
    outside = PrivacyAccountant(dataclasses.replace(CONFIG, threat_model="all-rounds"))
    assert pre_broadcast_record(outside, 5).clients == 20  # the other threat models: unchanged


def test_the_broadcast_stops_when_a_small_sum_would_not_fit_though_the_full_one_would():
    acc = PrivacyAccountant(CONFIG)
    full = acc.peek(CONFIG.planned_round(1)).certified.epsilon
    small = acc.peek(CONFIG.planned_round(1, 3)).certified.epsilon
    budget = Budget((full + small) / 2, CONFIG.delta)
    check_before_broadcast(acc, budget, worst_clients=20)
    with pytest.raises(BudgetExhausted, match="if only 3 contributor"):
        check_before_broadcast(acc, budget, worst_clients=3)


def test_a_revealed_round_is_never_discarded():
    acc = PrivacyAccountant(CONFIG)
    tiny = Budget(1e-3, CONFIG.delta)
    check_replies(acc, tiny, CONFIG.planned_round(1))  # no raise: the sum was already unmasked
    outside = PrivacyAccountant(dataclasses.replace(CONFIG, threat_model="all-rounds"))
    with pytest.raises(BudgetExhausted):
        check_replies(outside, tiny, CONFIG.planned_round(1))

"""Issue 33: the accounting of a sampled round made cheaper without changing a number.

- :func:`gaussian_pld` is dp-accounting's ``from_gaussian_mechanism`` bit for bit (PMF arrays, offsets, masses,
  epsilons), with and without the library's internal builder;
- :class:`RoundByRoundPLD` remembers the epsilons of its composition and of its kept trials (one query per
  (PLD, delta)), keeps several trials per round, forgets what it no longer holds, and returns the same floats
  as fresh queries;
- ``PrivacyAccountant.peek_epsilon`` is ``peek(...).certified.epsilon`` to the bit, without the add/remove PLD;
- the strategy's per-round questions (report, planned peek, step) cost 5 epsilon queries a round with a
  secret sample (tests/strategies/test_accounting_calls.py counts them through the real strategy).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from dp_accounting.pld import privacy_loss_distribution as pld

from fl_dp_flower.privacy import pld_rounds, sampled
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.records import AccountantConfig
from fl_dp_flower.privacy.sampled import DISCRETIZATION, _round_pld, gaussian_pld

DELTA = 1e-5


def _same_pmf(x, y) -> bool:
    if type(x) is not type(y) or x._infinity_mass != y._infinity_mass or x._discretization != y._discretization:
        return False
    if hasattr(x, "_loss_probs"):  # sparse
        return bool(x._loss_probs == y._loss_probs)
    return bool(x._lower_loss == y._lower_loss and np.array_equal(x._probs, y._probs))


def _same_pld(a, b) -> bool:
    pmfs = [(a._pmf_remove, b._pmf_remove)] + ([] if a._symmetric else [(a._pmf_add, b._pmf_add)])
    return a._symmetric == b._symmetric and all(_same_pmf(x, y) for x, y in pmfs)


@pytest.mark.parametrize("mu", [1e-3, 0.05, 0.3, 1.0529667554433122, 2.9])
def test_gaussian_pld_is_dp_accountings_bit_for_bit(mu):
    library = pld.from_gaussian_mechanism(1.0, sensitivity=mu, value_discretization_interval=DISCRETIZATION)
    ours = gaussian_pld(mu, DISCRETIZATION)
    assert _same_pld(ours, library)
    for delta in (1e-3, DELTA, 1e-9):
        assert ours.get_epsilon_for_delta(delta) == library.get_epsilon_for_delta(delta)


def test_gaussian_pld_falls_back_to_the_library_builder(monkeypatch):
    expected = pld.from_gaussian_mechanism(1.0, sensitivity=0.7, value_discretization_interval=1e-3)
    built = []
    monkeypatch.setattr(sampled, "_builder", lambda module: built.append(module))  # returns None
    assert _same_pld(gaussian_pld(0.7, 1e-3), expected) and built == [pld]


def test_the_sampled_pair_composes_as_with_the_library_gaussian():
    """The sampled bound's round PLD (mixture with p) and a composition of three: as built from the library's."""
    def library(p, mu):
        g = pld.from_gaussian_mechanism(1.0, sensitivity=mu, value_discretization_interval=DISCRETIZATION)
        return g.compute_mixture(pld.identity(DISCRETIZATION), p)

    pairs = [(0.1, 1.05), (0.0961, 1.07), (1.0, 0.4)]
    ours, theirs = _round_pld(*pairs[0]), library(*pairs[0])
    assert _same_pld(ours, theirs)
    for p, mu in pairs[1:]:
        ours, theirs = ours.compose(_round_pld(p, mu)), theirs.compose(library(p, mu))
    assert _same_pld(ours, theirs) and ours.get_epsilon_for_delta(DELTA) == theirs.get_epsilon_for_delta(DELTA)


class _Fake:
    """A stand-in PLD: composition is a tuple of keys; epsilon queries are counted."""

    queries: Counter = Counter()

    def __init__(self, keys: tuple) -> None:
        self.keys = keys

    def compose(self, other: "_Fake") -> "_Fake":
        return _Fake(self.keys + other.keys)

    def get_epsilon_for_delta(self, delta: float) -> float:
        _Fake.queries[(self.keys, delta)] += 1
        return float(sum(self.keys)) + delta


def test_round_by_round_remembers_epsilons_per_pld_and_delta_and_keeps_the_rounds_trials():
    _Fake.queries.clear()
    plds = pld_rounds.RoundByRoundPLD(lambda key: _Fake((key,)))
    plds.push(1)
    assert plds.epsilon(DELTA) == plds.epsilon(DELTA) == 1 + DELTA
    assert plds.epsilon(1e-3) == 1 + 1e-3
    assert _Fake.queries == Counter({((1,), DELTA): 1, ((1,), 1e-3): 1})
    planned, actual = plds.peek(2), plds.peek(3)
    assert plds.peek(2) is planned and plds.peek(3) is actual  # both trials kept: no second convolution
    assert plds.epsilon(DELTA, planned) == plds.epsilon(DELTA, planned) == 3 + DELTA
    assert plds.epsilon(DELTA, actual) == 4 + DELTA
    plds.push(3)  # the kept trial becomes the composition, its epsilon with it
    assert plds.epsilon(DELTA) == 4 + DELTA and plds.count == 2
    assert _Fake.queries[((1, 3), DELTA)] == 1 and _Fake.queries[((1, 2), DELTA)] == 1
    assert plds.peek(2) is not planned  # trials are for one round only
    assert set(k for k, _ in plds._epsilons) == {id(plds._pld)}  # the forgotten PLDs' epsilons dropped
    stranger = _Fake((7,))  # a PLD it does not hold: asked every time, never remembered
    plds.epsilon(DELTA, stranger), plds.epsilon(DELTA, stranger)
    assert _Fake.queries[((7,), DELTA)] == 2
    for key in range(10, 10 + 2 * pld_rounds.TRIALS):  # at most TRIALS trials kept
        plds.epsilon(DELTA, plds.peek(key))
    assert len(plds._trials) == pld_rounds.TRIALS and len(plds._epsilons) <= pld_rounds.TRIALS + 1


def test_an_abandoned_round_is_still_inf():
    plds = pld_rounds.RoundByRoundPLD(lambda key: _Fake((key,)), too_wide=lambda key: key > 5)
    plds.push(1)
    assert plds.epsilon(DELTA, plds.peek(9)) == float("inf")
    plds.push(9)
    assert plds.abandoned and plds.epsilon(DELTA) == float("inf") and plds.delta(1.0) == 1.0


def _secret_config(**changes) -> AccountantConfig:
    base = dict(algorithm="fedavg", schedule="constant", lr=0.5, local_steps=1, clip_norm=1.0, clients=36,
                sigma=0.3, clipping="per-batch", batch_size=1, colluders=1, sampling_rate=0.1,
                sample_secrecy="secret", population=360)
    return AccountantConfig(**{**base, **changes})


@pytest.mark.parametrize("secrecy", ["secret", "public"])
def test_peek_epsilon_is_peeks_certified_epsilon_and_the_round_costs_five_queries(monkeypatch, secrecy):
    queries = Counter()
    original = pld.PrivacyLossDistribution.get_epsilon_for_delta

    def counting(self, delta):
        queries["all"] += 1
        return original(self, delta)
    monkeypatch.setattr(pld.PrivacyLossDistribution, "get_epsilon_for_delta", counting)
    config = _secret_config(sample_secrecy=secrecy)
    fresh, acct = PrivacyAccountant(config), PrivacyAccountant(config)
    for t, clients in enumerate([33, 40, 29, 37, 36], start=1):
        record = _secret_config(clients=clients).planned_round(t)
        planned = config.planned_round(t)
        queries.clear()
        before = acct.report().certified.epsilon
        expected = acct.peek_epsilon(planned)
        assert acct.would_exceed(record, _budget(expected)) == (acct.peek(record).certified.epsilon > expected)
        report = acct.step(record)
        # report: 0 (remembered); planned: sampled + secret; the replies (would_exceed, peek): sampled under both
        # relations + secret; step: 0 (the peeked trials, remembered). Round 5 runs as planned: one trial serves both.
        if t > 1:
            assert queries["all"] == {"secret": 5 if t < 5 else 3, "public": 3 if t < 5 else 2}[secrecy], t
        fresh_before = fresh.report().certified.epsilon
        assert (before, expected) == (fresh_before, fresh.peek(planned).certified.epsilon)
        assert report.to_dict() == fresh.step(record).to_dict()  # every number as an accountant without reuse


def _budget(epsilon):
    from fl_dp_flower.privacy.report import Budget
    return Budget(epsilon, DELTA)

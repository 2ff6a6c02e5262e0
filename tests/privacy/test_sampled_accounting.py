"""The amplified bound of Poisson client sampling (docs/MATH.md §19) against independent references.

- Exact: the composed pair (1-q) bottom + q N(mu_t, 1) vs (1-q) bottom + q N(0, 1) has disjoint
  "bottom" atoms, so its hockey-stick divergence is the expectation over which rounds the target
  was in: delta(eps) = E_J[delta_G(sqrt(sum_{t in J} mu_t^2))(eps)] (binomial sum for equal mu_t,
  a sum over subsets for small T, in mpmath). The PLD (dp-accounting, pessimistic) must sit on it.
- RDP: the same pair has D_alpha = log((1 - q) + q exp(alpha (alpha - 1) mu^2 / 2)) / (alpha - 1)
  (both directions), additive over rounds; converted with the standard rule it is an upper bound
  the PLD must stay below.
- The real mechanism: a 1-D instance with per-client noise (variance depends on who took part),
  integrated numerically (scipy quad): its hockey-stick divergence never exceeds the bound.
"""

from __future__ import annotations

import itertools
import math

import mpmath
import numpy as np
import pytest
from scipy import integrate, optimize, stats

from fl_dp_flower.privacy import gdp
from fl_dp_flower.privacy.sampled import SampledComposition, composed_epsilon, round_mu

DELTA = 1e-5


def _exact_delta(q: float, mus: list[float], eps: float) -> float:
    """delta(eps) of the composed pairs, exactly (mpmath), by the participation subsets J."""
    T = len(mus)
    if len(set(mus)) == 1:  # binomial in the number of rounds the target was in
        return float(mpmath.fsum(mpmath.binomial(T, j) * mpmath.mpf(q) ** j * mpmath.mpf(1 - q) ** (T - j)
                                 * (gdp.delta(mus[0] * math.sqrt(j), eps) if j else 0.0) for j in range(T + 1)))
    total = mpmath.mpf(0)
    for mask in itertools.product((0, 1), repeat=T):
        j = sum(mask)
        if j:
            mu = math.sqrt(math.fsum(m * m for m, b in zip(mus, mask) if b))
            total += mpmath.mpf(q) ** j * mpmath.mpf(1 - q) ** (T - j) * gdp.delta(mu, eps)
    return float(total)


def _exact_epsilon(q: float, mus: list[float], delta: float) -> float:
    f = lambda e: math.log(max(_exact_delta(q, mus, e), 1e-300)) - math.log(delta)  # noqa: E731
    if f(0.0) <= 0:
        return 0.0
    hi = 1.0
    while f(hi) > 0:
        hi *= 2
    return optimize.brentq(f, 0.0, hi, xtol=1e-10, rtol=1e-12)


def _rdp_epsilon(q: float, mus: list[float], delta: float) -> float:
    """Standard RDP -> (eps, delta): min over orders of RDP(alpha) + log(1/delta)/(alpha - 1)."""
    alpha = np.concatenate([np.linspace(1.01, 10, 400), np.linspace(10, 512, 600)])[:, None]
    log_1mq = math.log1p(-q) if q < 1 else -np.inf
    per_round = np.logaddexp(log_1mq, math.log(q) + alpha * (alpha - 1) * np.square(mus)[None, :] / 2) / (alpha - 1)
    return float(np.min(per_round.sum(axis=1) + math.log(1 / delta) / (alpha[:, 0] - 1)))


GRID = [(q, mu, T) for q in (0.01, 0.25, 1.0) for mu in (0.05, 0.4, 1.5) for T in (1, 10, 60)]


@pytest.mark.parametrize("q, mu, T", GRID)
def test_pld_equals_the_exact_hockey_stick_and_stays_below_rdp(q, mu, T):
    exact = _exact_epsilon(q, [mu] * T, DELTA)
    fast = composed_epsilon(q, [mu] * T, DELTA)
    # the accountant composes round by round (only for the shorter runs: it is the same PLD code)
    rounds = SampledComposition(q)
    for _ in range(min(T, 10)):
        rounds.push(mu)
    if T <= 10:
        assert rounds.epsilon(DELTA) == pytest.approx(fast, abs=1e-6 + 1e-4 * T)
    # pessimistic discretisation: never below the exact value, at most ~1e-4 per round above it
    assert fast >= exact - 1e-7
    assert fast <= exact + 1e-4 * T + 1e-6
    assert fast <= _rdp_epsilon(q, [mu] * T, DELTA) + 1e-9


def test_heterogeneous_rounds_against_the_exact_subset_sum():
    q, mus = 0.3, [0.2, 1.1, 0.6, 0.05, 2.5, 0.9, 0.4]
    acct = SampledComposition(q)
    for m in mus:
        acct.push(m)
    exact = _exact_epsilon(q, mus, DELTA)
    assert exact - 1e-7 <= acct.epsilon(DELTA) <= exact + 1e-4 * len(mus) + 1e-6
    assert acct.epsilon(DELTA) <= _rdp_epsilon(q, mus, DELTA)
    assert composed_epsilon(q, mus, DELTA) == pytest.approx(acct.epsilon(DELTA), abs=1e-6)


def test_full_participation_is_gaussian_dp():
    mus = [0.3, 0.7, 0.1, 0.5]
    acct = SampledComposition(1.0)
    for m in mus:
        acct.push(m)
    assert acct.epsilon(DELTA) == pytest.approx(gdp.epsilon(math.sqrt(sum(m * m for m in mus)), DELTA), abs=5e-4)


def test_amplification_is_real_and_the_clt_mu_is_only_an_approximation():
    """q = 0.25 with 4x fewer contributions per round costs about the full-participation epsilon
    (mu_clt = sqrt(q) * composition mu), but the exact tail is heavier than the CLT's."""
    T, mu_full = 60, 0.8907235 / math.sqrt(60)
    mu_sampled = mu_full * 2  # a quarter of the contributions: twice the per-round mu
    acct = SampledComposition(0.25)
    for _ in range(T):
        acct.push(mu_sampled)
    eps = acct.epsilon(DELTA)
    assert acct.mu_clt() == pytest.approx(0.8907235, rel=1e-6)
    assert gdp.epsilon(0.8907235, DELTA) < eps < gdp.epsilon(mu_sampled * math.sqrt(T), DELTA)
    assert eps == pytest.approx(_exact_epsilon(0.25, [mu_sampled] * T, DELTA), abs=T * 1e-4)


def test_round_mu_counts_only_the_noise_outside_the_coalition():
    assert round_mu(2.0, 0.5, 100, 0) == pytest.approx(2.0 / (0.5 * 10))
    assert round_mu(2.0, 0.5, 101, 1) == pytest.approx(2.0 / (0.5 * 10))
    assert round_mu(2.0, 0.5, 1, 1) == round_mu(2.0, 0.5, 0, 0) == pytest.approx(4.0)  # the target alone
    with pytest.raises(ValueError, match="contributions"):
        round_mu(2.0, 0.5, -1, 0)


def _mechanism_density(y: float, target: float, others: int, q: float, sigma: float) -> float:
    """Density (without the no-one atom) of the sum of the contributions of a 1-D round: each of
    ``others`` zero updates and the target's update ``target`` in with probability q, every
    contribution with its own N(0, sigma^2) noise (so the variance depends on who took part)."""
    out = 0.0
    for k in range(others + 1):
        w_others = math.comb(others, k) * q**k * (1 - q) ** (others - k)
        if k:
            out += (1 - q) * w_others * stats.norm.pdf(y, 0.0, sigma * math.sqrt(k))
        out += q * w_others * stats.norm.pdf(y, target, sigma * math.sqrt(k + 1))
    return out


@pytest.mark.parametrize("q, others, gamma", [(0.5, 2, 1.0), (0.2, 3, 3.0), (0.9, 1, 0.5)])
def test_the_real_mechanism_with_per_client_noise_never_exceeds_the_bound(q, others, gamma):
    """Replace-one: the target's update is +gamma/2 or -gamma/2. The exact hockey-stick divergence of
    the real round (quadrature) <= E over the others' participation of q * delta_G(gamma/(sigma sqrt(n+1))),
    which is <= the accountant's pair for the smallest count it may see (the target alone)."""
    sigma = 1.0
    for eps in (0.0, 0.3, 1.0, 2.0):
        g = math.exp(eps)
        hs = integrate.quad(lambda y: max(0.0, _mechanism_density(y, gamma / 2, others, q, sigma)
                                          - g * _mechanism_density(y, -gamma / 2, others, q, sigma)),
                            -40, 40, limit=400, points=[0.0])[0]
        bound = sum(math.comb(others, k) * q**k * (1 - q) ** (others - k) * q
                    * gdp.delta(round_mu(gamma, sigma, k + 1, 0), eps) for k in range(others + 1))
        assert hs <= bound + 1e-9
        assert bound <= q * gdp.delta(round_mu(gamma, sigma, 0, 0), eps) + 1e-15


@pytest.mark.parametrize("clients", [10, 20])
def test_calibration_plans_at_the_accountants_own_rate_for_a_small_population(clients):
    """With N 20 and one colluder the accountant weighs a round by k/(N - c) = 10/19, not q = 0.5: a
    calibration at q found a sigma the planned run then exceeded, and refused the target as unmeetable."""
    import dataclasses

    from fl_dp_flower.privacy.planning import calibrate_sigma, plan
    from fl_dp_flower.privacy.records import AccountantConfig

    config = AccountantConfig(lr=0.5, local_steps=1, clip_norm=1.0, clients=clients, sigma=1.0, clipping="per-sample",
                              batch_size=1, colluders=1, sampling_rate=0.5, population=20)
    sigma = calibrate_sigma(config, 30, 1.0).sigma
    planned = plan(dataclasses.replace(config, sigma=sigma), 30)
    assert 0.99 < planned.certified.epsilon <= 1.0

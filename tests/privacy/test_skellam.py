"""The Skellam accountant (privacy/skellam.py, issue 20) against independent references.

1. The exact Renyi divergence of 1-D Skellam laws Sk(lam) = Poisson(lam) - Poisson(lam) for integer shifts, from
   pmf_x = e^{-z} I_x(z) (z = 2 lam = the variance) with the Bessel ratios I_{v+1}/I_v by backward recurrence
   (checked against mpmath's besseli and scipy), summed over coordinates (a product law's divergence is the sum).
2. The RDP -> (eps, delta) conversion against dp_accounting's ``compute_epsilon``.
3. The Gaussian limit against gdp.rdp_epsilon / gdp.epsilon (RDP of a Gaussian: order mu^2 / 2).
4. grid_plan's wrap bound against numpy's Poisson sampler and scipy's exact Skellam tail.
5. The main job: Gamma 4, sigma 0.55, m 4000, 60 rounds, c 0, d 61706, delta 1e-5: step 2^-15, eps 4.151
   (order 6); the real sum's GDP value is 3.8303.
"""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
from scipy import optimize, special, stats

from fl_dp_flower.privacy import gdp
from fl_dp_flower.privacy.skellam import (ORDERS, GridPlan, SkellamRound, composed_rdp, epsilon_from_rdp, grid_plan,
                                          honest_clients, rounded_sensitivity, skellam_epsilon, skellam_rdp,
                                          skellam_tail_bound, wrap_bound)

DELTA = 1e-5


# ----------------------------------------------------------------------------- reference 1: exact divergence


def _log_pmf(variance: float, top: int) -> np.ndarray:
    """log P(Sk = x) for x = 0..top, Sk with per-coordinate variance z: e^{-z} I_x(z).

    Ratios r_v = I_{v+1}(z) / I_v(z) by the backward recurrence r_{v-1} = 1 / (2 v / z + r_v) (stable: it
    follows the minimal solution I_v), started far above ``top`` from Amos' approximation."""
    z = float(variance)
    n = top + 200 + int(10 * math.sqrt(z))
    r = z / (n + 2 + math.sqrt((n + 2) ** 2 + z * z))
    logs = np.empty(n)
    for v in range(n, 0, -1):
        r = 1.0 / (2.0 * v / z + r)
        logs[v - 1] = math.log(r)
    out = np.empty(top + 1)
    out[0] = math.log(special.ive(0, z))
    out[1:] = out[0] + np.cumsum(logs[:top])
    return out


def _exact_divergence(shift: int, variance: float, order: int) -> float:
    """D_order(Sk + shift || Sk), in nats, summed over every integer where it is not negligible."""
    k = abs(int(shift))
    if k == 0:
        return 0.0
    width = int(40 * math.sqrt(variance)) + 60
    x = np.arange(-width, order * k + width + 1)
    table = _log_pmf(variance, order * k + width + k + 1)
    terms = order * table[np.abs(x - k)] + (1 - order) * table[np.abs(x)]
    top = terms.max()
    assert terms[0] < top - 70 and terms[-1] < top - 70, "the sum's range misses mass"
    return float(special.logsumexp(terms)) / (order - 1)


@pytest.mark.parametrize("variance", [5.0, 500.0, 5e3, 1e5])
def test_the_reference_pmf_matches_mpmath_and_scipy(variance):
    table = _log_pmf(variance, 3000)
    mpmath.mp.dps = 40
    for x in (0, 1, 7, 100, 1000, 3000):
        if variance <= 5e3:
            ref = float(mpmath.log(mpmath.besseli(x, variance)) - variance)
            assert table[x] == pytest.approx(ref, rel=1e-12, abs=1e-12)
        scipy_ref = stats.skellam.logpmf(x, variance / 2, variance / 2)
        if np.isfinite(scipy_ref) and scipy_ref > -600:
            assert table[x] == pytest.approx(scipy_ref, rel=1e-9, abs=1e-9)


def _shift_vectors(variance: float) -> list[np.ndarray]:
    u = max(1, round(math.sqrt(variance) / 4))
    return [np.array(v) for v in ([1], [u], [u, -2 * u, 1], [3 * u, u, u, 0, -1])]


@pytest.mark.parametrize("variance", [5.0, 50.0, 500.0, 5e3, 1e5, 1e6])
def test_the_rdp_bound_is_at_least_the_exact_divergence_of_integer_shifts(variance):
    """Theorem 3.5 >= the exact Renyi divergence (both directions: the law is symmetric) at orders 2, 3, 5, 10, 30.

    At variance 5 the bound is loose (exact/bound 0.26..0.71); from 5e3 on exact/bound > 0.98."""
    for vec in _shift_vectors(variance):
        l2, l1 = float(np.linalg.norm(vec)), float(np.abs(vec).sum())
        for order in (2, 3, 5, 10, 30):
            exact = sum(_exact_divergence(k, variance, order) for k in vec)
            bound = skellam_rdp(order, l2, l1, variance)
            assert bound >= exact, (list(vec), order, bound, exact)
            if variance >= 5e3:
                assert exact / bound > 0.98, (list(vec), order, bound, exact)


@pytest.mark.parametrize("variance", [1.0, 2.0, 5.0, 50.0, 500.0])
def test_the_bound_holds_for_shifts_far_beyond_the_noise_and_order_100(variance):
    for k in (1, 2, 5, 10, 20, 50, 100):
        for order in (2, 5, 30, 100):
            assert skellam_rdp(order, k, k, variance) >= _exact_divergence(k, variance, order), (k, order)


@pytest.mark.parametrize("variance", [1e5, 1e6])
def test_the_leading_term_approaches_the_exact_divergence_at_large_variance(variance):
    for vec in _shift_vectors(variance):
        lead = 30 * float(vec @ vec) / (2 * variance)
        exact = sum(_exact_divergence(k, variance, 30) for k in vec)
        assert abs(exact - lead) / exact < 1e-2


def test_a_bound_with_the_variance_read_as_the_poisson_rate_would_undercount():
    """The test above can fail: reading mu as each Poisson's rate (variance 2 mu) halves the bound."""
    variance, order, k = 5e3, 10, 18
    exact = _exact_divergence(k, variance, order)
    assert skellam_rdp(order, k, k, 2 * variance) < exact <= skellam_rdp(order, k, k, variance)


# ----------------------------------------------------------------------------- the bound's pieces


def test_rounded_sensitivity_adds_one_per_coordinate():
    assert rounded_sensitivity(4.0, 2.0 ** -15, 61706) == pytest.approx(
        (4.0 * 2 ** 15 + math.sqrt(61706), math.sqrt(61706) * (4.0 * 2 ** 15 + math.sqrt(61706))), rel=1e-15)
    assert rounded_sensitivity(0.0, 0.5, 9) == (3.0, 9.0)


def test_a_round_is_the_bound_at_its_variance_and_sensitivity():
    r = SkellamRound(client_sensitivity=0.3, sigma=0.7, honest=honest_clients(12, 2), step=2.0 ** -8, dimension=50)
    assert r.honest == 10 and r.variance == pytest.approx(10 * (0.7 * 256) ** 2, rel=1e-15)
    l2, l1 = rounded_sensitivity(0.3, 2.0 ** -8, 50)
    curve = r.rdp([2, 7, 64])
    assert curve == pytest.approx([skellam_rdp(a, l2, l1, r.variance) for a in (2, 7, 64)], rel=1e-14)
    other = SkellamRound(0.5, 0.7, 3, 2.0 ** -8, 50)
    assert composed_rdp([r, r, other], [2, 7, 64]) == pytest.approx(2 * curve + other.rdp([2, 7, 64]), rel=1e-14)
    assert composed_rdp([], [2, 3]).tolist() == [0.0, 0.0]


def test_honest_clients_never_drop_below_the_target():
    assert honest_clients(4000, 0) == 4000 and honest_clients(4000, 1) == 3999 and honest_clients(3, 5) == 1


# ----------------------------------------------------------------------------- reference 2: dp_accounting


def test_epsilon_from_rdp_matches_dp_accounting():
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    rounds = [SkellamRound(4.0, 0.55, 4000, 2.0 ** -15, 61706)] * 60
    curves = [composed_rdp(rounds), np.array(ORDERS) * 0.3 ** 2 / 2, np.array(ORDERS) * 4.0 ** 2 / 2,
              composed_rdp([SkellamRound(1.0, 0.05, 2, 2.0 ** -4, 100)])]
    for curve in curves:
        for delta in (1e-3, 1e-5, 1e-10):
            eps, order = epsilon_from_rdp(curve, ORDERS, delta)
            ref_eps, ref_order = compute_epsilon(list(ORDERS), curve.tolist(), delta)
            assert eps == pytest.approx(ref_eps, rel=1e-12, abs=1e-15) and order == ref_order


# ----------------------------------------------------------------------------- reference 3: the Gaussian limit


def test_huge_variance_gives_the_gaussian_rdp_epsilon_and_never_beats_exact_gdp():
    """D2 = Gamma/s + sqrt(d) -> Gamma/s and the Skellam becomes Gaussian: eps -> the Gaussian-RDP eps of
    mu^2 = sum_t (Gamma_t / (sigma_t sqrt(honest_t)))^2, and stays above the exact GDP eps."""
    rounds = [SkellamRound(1.0, 1.0, 10, 2.0 ** -20, 4)] * 30 + [SkellamRound(0.5, 2.0, 3, 2.0 ** -22, 4)] * 20
    mu = math.sqrt(30 * (1.0 / math.sqrt(10)) ** 2 + 20 * (0.5 / (2.0 * math.sqrt(3))) ** 2)
    for delta in (1e-3, 1e-5, 1e-9):
        eps = skellam_epsilon(rounds, delta)
        assert eps == pytest.approx(gdp.rdp_epsilon(mu, delta, ORDERS)[0], rel=1e-2)
        assert eps >= gdp.epsilon(mu, delta)


# ----------------------------------------------------------------------------- reference 4: the grid


def test_the_chernoff_tail_is_above_the_exact_skellam_tail():
    for rate in (0.5, 5.0, 50.0, 500.0):
        for z in (0.5, 1.0, 2.0, 4.0, 7.0):
            k = math.ceil(z * math.sqrt(2 * rate))
            exact = stats.skellam.sf(k - 1, rate, rate)  # P(X >= k)
            chernoff = skellam_tail_bound(k, rate)
            assert exact <= chernoff <= max(1e-300, 60 * (z + 1) * exact)
    assert skellam_tail_bound(0, 3.0) == 1.0 and skellam_tail_bound(1, 0.0) == 0.0


def _empirical_wraps(plan_step: float, sigma: float, bound: float, m: int, d: int, bits: int, trials: int,
                     rng: np.random.Generator) -> float:
    """Share of rounds where some coordinate of the worst clean sum m round(B/s) plus the m clients' Skellam
    noise (numpy's Poisson sampler) leaves (-Q/2, Q/2)."""
    clean = m * math.floor(bound / plan_step + 0.5)
    rate = sigma * sigma / (2 * plan_step * plan_step)
    wraps = 0
    for _ in range(trials):
        noise = rng.poisson(m * rate, d) - rng.poisson(m * rate, d)  # sum of m Sk(rate) = Sk(m rate)
        wraps += bool(np.any(np.abs(clean + noise) >= 2 ** (bits - 1)))
    return wraps / trials


def test_a_tiny_modulus_plan_wraps_no_more_often_than_stated_and_a_finer_step_would():
    """Q = 2^12, d 1000, m 8, B 1, sigma 1.8: the plan (step 2^-6) states 0.032; the simulated worst clean sum
    wraps in 0.1 % of rounds, as scipy's exact Skellam tail says; step 2^-7 wraps in every round."""
    sigma, b, m, d, bits = 1.8, 1.0, 8, 1000, 12
    plan = grid_plan(sigma, b, m, d, rounds=1, wrap_probability=0.05, modulus_bits=bits)
    assert isinstance(plan, GridPlan) and math.frexp(plan.step)[0] == 0.5  # a power of two
    assert plan.step == 2.0 ** -6 and plan.modulus == 4096 and 0.01 < plan.wrap_bound <= 0.05
    assert plan.poisson_rate == pytest.approx(sigma ** 2 / (2 * plan.step ** 2), rel=1e-15)
    assert wrap_bound(plan.step / 2, sigma, b, m, d, 1, bits) > 0.05  # the smallest power of two that passes
    # the exact probability of the simulated event: |m round(B/s) + Sk(m rate)| >= Q/2 in some coordinate
    clean, half, rate = m * math.floor(b / plan.step + 0.5), 2 ** (bits - 1), m * plan.poisson_rate
    one = stats.skellam.sf(half - clean - 1, rate, rate) + stats.skellam.cdf(-half - clean, rate, rate)
    exact = -math.expm1(d * math.log1p(-one))
    assert 1e-4 < exact <= plan.wrap_bound
    trials = 8000
    seen = _empirical_wraps(plan.step, sigma, b, m, d, bits, trials, np.random.default_rng(20))
    assert abs(seen - exact) <= 4 * math.sqrt(exact / trials) and seen <= plan.wrap_bound
    # a step twice finer wraps in most rounds (the check above is not vacuous), and its bound says so
    fine = plan.step / 2
    seen = _empirical_wraps(fine, sigma, b, m, d, bits, 200, np.random.default_rng(21))
    assert seen > 0.5 and wrap_bound(fine, sigma, b, m, d, 1, bits) >= seen


def test_grid_plan_to_dict_and_rounds_in_the_union_bound():
    one = grid_plan(0.55, 2.0, 100, 1000, rounds=1, wrap_probability=1e-6, modulus_bits=20)
    many = grid_plan(0.55, 2.0, 100, 1000, rounds=10 ** 6, wrap_probability=1e-6, modulus_bits=20)
    assert many.step >= one.step
    assert one.to_dict()["step"] == one.step and set(one.to_dict()) >= {"step", "modulus", "poisson_rate",
                                                                       "wrap_bound"}


@pytest.mark.parametrize("kwargs, field", [
    ({"sigma": 0.0}, "sigma"), ({"update_bound": -1.0}, "update_bound"), ({"clients": 0}, "clients"),
    ({"dimension": 1.5}, "dimension"), ({"rounds": 0}, "rounds"), ({"wrap_probability": 1.0}, "wrap_probability"),
    ({"wrap_probability": True}, "wrap_probability"), ({"modulus_bits": 33}, "modulus_bits"),
    ({"modulus_bits": 1}, "modulus_bits"), ({"clients": 5000, "modulus_bits": 12}, "modulus_bits"),
])
def test_grid_plan_names_the_bad_field(kwargs, field):
    args = {"sigma": 0.55, "update_bound": 2.0, "clients": 10, "dimension": 100, "rounds": 5,
            "wrap_probability": 1e-6, "modulus_bits": 30, **kwargs}
    with pytest.raises(ValueError, match=field):
        grid_plan(**args)


@pytest.mark.parametrize("call, field", [
    (lambda: skellam_rdp(1, 1.0, 1.0, 1.0), "order"), (lambda: skellam_rdp(2.0, 1.0, 1.0, 1.0), "order"),
    (lambda: skellam_rdp(2, -1.0, 1.0, 1.0), "l2"), (lambda: skellam_rdp(2, 2.0, 1.0, 1.0), "l1"),
    (lambda: skellam_rdp(2, 1.0, 1.0, 0.0), "variance"), (lambda: SkellamRound(1.0, 1.0, 0, 0.1, 3), "honest"),
    (lambda: SkellamRound(1.0, 1.0, 1, 0.0, 3), "step"), (lambda: SkellamRound(-1.0, 1.0, 1, 0.1, 3),
                                                          "client_sensitivity"),
    (lambda: rounded_sensitivity(1.0, 0.1, 0), "dimension"), (lambda: composed_rdp([1.0]), "rounds"),
    (lambda: epsilon_from_rdp([1.0], [2], 0.0), "delta"), (lambda: epsilon_from_rdp([1.0, 2.0], [2], 1e-5), "rdp"),
    (lambda: epsilon_from_rdp([-1.0], [2], 1e-5), "rdp"), (lambda: SkellamRound(1.0, 1.0, 1, 0.1, 3).rdp([]),
                                                           "orders"),
])
def test_bad_input_names_the_field(call, field):
    with pytest.raises(ValueError, match=field):
        call()


# ----------------------------------------------------------------------------- reference 5: the main job


def _main_job(sigma: float = 0.55, colluders: int = 0) -> list[SkellamRound]:
    plan = grid_plan(sigma, 2.0, 4000, 61706, rounds=60, wrap_probability=1e-7)
    return [SkellamRound(4.0, sigma, honest_clients(4000, colluders), plan.step, 61706)] * 60


def test_main_job_step_2_to_the_minus_16_eps_4_147_against_gdp_3_8303():
    """Gamma 4, sigma 0.55, m 4000, 60 rounds, c 0, d 61706, B 2, sums modulo 2^32, wrap <= 1e-7: step 2^-16 =
    1.5e-5, eps 4.147 at delta 1e-5 (order 6); the real sum's GDP eps is 3.8303 (docs/MATH.md §20.2), +8.3 %."""
    rounds = _main_job()
    assert rounds[0].step == 2.0 ** -16
    eps, order = epsilon_from_rdp(composed_rdp(rounds), ORDERS, DELTA)
    assert 3.8303 <= eps <= 1.1 * 3.8303 and eps == pytest.approx(4.147, abs=1e-3)
    assert ORDERS[0] < order < ORDERS[-1]
    assert skellam_epsilon(_main_job(colluders=1), DELTA) > eps


@pytest.mark.parametrize("target", [0.1, 0.5, 20.0])
def test_main_job_order_is_not_the_largest_at_small_eps(target):
    """Sigma scaled so that the main job's eps is ``target``: the chosen order is interior (below the largest)."""
    sigma = optimize.brentq(lambda s: skellam_epsilon(_main_job(s), DELTA) - target, 0.05, 50.0, xtol=1e-6)
    eps, order = epsilon_from_rdp(composed_rdp(_main_job(sigma)), ORDERS, DELTA)
    assert eps == pytest.approx(target, rel=1e-3)
    assert ORDERS[0] < order < ORDERS[-1]


def test_the_grid_is_never_finer_than_sigma_over_2_to_the_16():
    """numpy's Poisson sampler drifts above rates ~1e13 (review finding: variance 3 % low at 1.7e14), so the plan
    keeps lam = sigma^2 / (2 s^2) below 2^31 even where the wrap bound would allow a finer grid."""
    plan = grid_plan(0.5, 0.001, 3, 61706, rounds=1, wrap_probability=1e-9)
    assert plan.step >= 0.5 / 2**16 and plan.poisson_rate < 2**31


def test_the_log_clamp_bound_is_above_the_exact_clamp_probability():
    """One client, one value, small numbers: the bound on P(|round(Delta/s) + Sk| >= 2^29) against scipy's exact
    Skellam tail at the worst clean part, shifted so that the exact probability is not negligible."""
    from fl_dp_flower.privacy.skellam import CLIENT_HALF_RANGE, log_clamp_bound

    step, b = 1.0, CLIENT_HALF_RANGE - 60.5  # the clean part can reach 2^29 - 60
    sigma = 20.0  # rate 200 per side
    rate = sigma**2 / 2
    exact = stats.skellam.sf(60 - 1, rate, rate)  # P(Sk >= 60): one side suffices at the worst clean part
    bound = math.exp(log_clamp_bound(step, sigma, b, 1, 1))
    assert exact <= bound <= 1.0 and exact > 1e-6
    assert log_clamp_bound(2.0**-16, 0.55, 2.0, 4000, 61706) < -1e7  # the main job: never

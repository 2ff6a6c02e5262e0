"""Tests of fl_dp_flower.privacy.gdp against independent references.

References: mpmath (60-80 digits) implementations of Lemma 3 and its inverse written here,
dp_accounting's analytic Gaussian (Balle-Wang) and RdpAccountant, and closed forms. A Gaussian
mechanism with sensitivity 1 and noise std 1/mu is exactly mu-GDP (docs/MATH.md §12).
"""

from __future__ import annotations

import math
import warnings

import mpmath
import numpy as np
import pytest

from fl_dp_flower.privacy import gdp

dp_accounting = pytest.importorskip("dp_accounting")
from dp_accounting import dp_event  # noqa: E402
from dp_accounting import gaussian_mechanism  # noqa: E402
from dp_accounting.rdp import rdp_privacy_accountant  # noqa: E402

MUS = [1e-6, 1e-3, 0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 100, 1000]
DELTAS = [1e-12, 1e-8, 1e-5, 1e-3, 0.1, 0.5]


# ----------------------------------------------------------------------------- mpmath references


def mp_delta(mu, eps, dps: int = 80):
    """Lemma 3 in mpmath, straight from the formula (high precision absorbs the cancellation)."""
    with mpmath.workdps(dps):
        mu, eps = mpmath.mpf(mu), mpmath.mpf(eps)
        return +(mpmath.ncdf(-eps / mu + mu / 2) - mpmath.exp(eps) * mpmath.ncdf(-eps / mu - mu / 2))


def mp_epsilon(mu, delta, dps: int = 60):
    """Root of delta(eps) = delta in mpmath: doubling bracket, 60 bisections, then Newton."""
    with mpmath.workdps(dps):
        mu, target = mpmath.mpf(mu), mpmath.mpf(delta)
        if mp_delta(mu, 0, dps) <= target:
            return mpmath.mpf(0)
        lo, hi = mpmath.mpf(0), mpmath.mpf(1)
        while mp_delta(mu, hi, dps) > target:
            lo, hi = hi, 2 * hi
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if mp_delta(mu, mid, dps) > target else (lo, mid)
        eps = (lo + hi) / 2
        for _ in range(30):  # Newton on log delta(eps) - log target; d delta/d eps = -e^eps Phi(c-h)
            d = mp_delta(mu, eps, dps)
            slope = -mpmath.exp(eps) * mpmath.ncdf(-eps / mu - mu / 2) / d
            step = (mpmath.log(d) - mpmath.log(target)) / slope
            eps -= step
            if abs(step) <= eps * mpmath.mpf(10) ** (-(dps - 15)):
                return eps
        raise RuntimeError(f"mpmath reference did not converge for mu={mu}, delta={delta}")


def rel_err(value: float, ref) -> float:
    return float(abs(mpmath.mpf(value) - ref) / abs(ref))


# ----------------------------------------------------------------------------- epsilon(mu, delta)


def test_epsilon_matches_mpmath_on_grid():
    worst = 0.0
    zero_cases = 0
    for mu in MUS:
        for d in DELTAS:
            got = gdp.epsilon(mu, d)
            if mp_delta(mu, 0) <= d:  # delta >= delta(0): epsilon is exactly 0
                assert got == 0.0, (mu, d, got)
                zero_cases += 1
                continue
            ref = mp_epsilon(mu, d)
            assert got > 0.0
            worst = max(worst, rel_err(got, ref))
            assert rel_err(got, ref) <= 1e-9, (mu, d, got, ref)
    assert 0 < zero_cases < len(MUS) * len(DELTAS)  # the grid exercises both branches
    assert worst <= 1e-13  # measured ~1e-15; guards against silent degradation


def test_epsilon_zero_iff_delta_at_least_delta0():
    # delta(0) = erf(mu / (2 sqrt 2)); just above / just below it
    for mu in [1e-3, 0.3, 2.0]:
        d0 = float(mp_delta(mu, 0))
        assert gdp.epsilon(mu, d0 * (1 + 1e-9)) == 0.0
        below = gdp.epsilon(mu, d0 * (1 - 1e-6))
        assert below > 0.0
        assert rel_err(below, mp_epsilon(mu, d0 * (1 - 1e-6))) <= 1e-6  # ill-conditioned near delta(0)
    # opacus' fixed bracket fails here (docs/MATH.md §10): answer is 0
    assert gdp.epsilon(1e-3, 1e-3) == 0.0


def test_epsilon_large_mu_beyond_fixed_brackets():
    # epsilon > 500 (mu >= 30 at delta = 1e-5) must still be exact
    ref = mp_epsilon(60.0, 1e-5)
    assert ref > 500
    assert rel_err(gdp.epsilon(60.0, 1e-5), ref) <= 1e-12


def test_epsilon_edge_cases():
    assert gdp.epsilon(math.inf, 1e-5) == math.inf
    assert gdp.epsilon(0.0, 1e-5) == 0.0
    assert gdp.epsilon(3.0, 1.0) == 0.0
    assert gdp.epsilon(math.inf, 1.0) == 0.0


# ----------------------------------------------------------------------------- delta(mu, epsilon)


@pytest.mark.parametrize(
    "mu",
    [1e-12, 1e-8, 1e-6, 1e-4, 1e-3, 0.01, 0.1, 0.5, 1, 1.9, 2, 2.1, 3, 5, 10, 30, 100, 300, 1000, 1e4],
)
def test_delta_matches_mpmath(mu):
    scaled = [k * mu for k in (0.3, 1, 3, 10, 30)]  # keeps delta representable for tiny mu
    fixed = [0, 1e-15, 1e-12, 1e-9, 1e-6, 1e-3, 0.01, 0.1, 0.5, 1, 2, 5, 10, 30, 100, 300,
             1000, 2000, 5000, 1e4, 1e5, 5e5, 5e7]
    epsilons = scaled + fixed
    checked = 0
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no overflow / invalid-value warnings
        for eps in epsilons:
            got = gdp.delta(mu, eps)
            ref = mp_delta(mu, eps)
            if ref < 1e-300:  # underflows in double precision
                assert 0.0 <= got < 1e-290, (mu, eps, got)
                continue
            assert rel_err(got, ref) <= 1e-11, (mu, eps, got, ref)
            checked += 1
    assert checked >= 4


def test_delta_epsilon_in_the_thousands():
    # e^eps would overflow for eps > 709; the log-space form must not
    cases = [(50.0, 1500.0), (100.0, 4900.0), (100.0, 5500.0), (100.0, 6000.0), (1000.0, 5e5), (1000.0, 5.1e5)]
    for mu, eps in cases:
        ref = mp_delta(mu, eps)
        assert 1e-300 < ref < 0.999
        assert rel_err(gdp.delta(mu, eps), ref) <= 1e-11


def test_delta_tiny_mu_no_cancellation():
    # 2 Phi(mu/2) - 1 and Phi(c+h) - e^eps Phi(c-h) cancel catastrophically for tiny mu
    for mu, eps in [(1e-10, 0.0), (1e-10, 1e-11), (1e-8, 1e-7), (1e-6, 1e-6), (1e-6, 2e-5)]:
        ref = mp_delta(mu, eps)
        assert rel_err(gdp.delta(mu, eps), ref) <= 1e-12, (mu, eps)


def test_delta_edge_cases():
    assert gdp.delta(0.0, 1.0) == 0.0
    assert gdp.delta(math.inf, 5.0) == 1.0
    assert gdp.delta(2.0, math.inf) == 0.0
    assert gdp.delta(1.0, 0.0) == pytest.approx(math.erf(1 / (2 * math.sqrt(2))), rel=1e-15)
    # strictly decreasing in epsilon, increasing in mu
    ds = [gdp.delta(1.0, e) for e in np.linspace(0, 10, 41)]
    assert all(a > b for a, b in zip(ds, ds[1:]))
    ds = [gdp.delta(m, 1.0) for m in np.geomspace(0.1, 10, 41)]
    assert all(a < b for a, b in zip(ds, ds[1:]))


# ----------------------------------------------------------------------------- dp_accounting


MATH12_MUS = [1e-3, 0.01, 0.05, 0.1, 0.3, 0.5, 1, 2, 3, 5, 10, 20, 30, 50]
MATH12_DELTAS = [1e-8, 1e-5, 1e-3]


def test_epsilon_matches_dp_accounting_analytic_gaussian():
    for mu in MATH12_MUS:
        for d in MATH12_DELTAS:
            ref = gaussian_mechanism.get_epsilon_gaussian(sigma=1.0 / mu, delta=d, tol=1e-15)
            got = gdp.epsilon(mu, d)
            if ref == 0:
                assert got == 0.0, (mu, d)
            else:
                assert got == pytest.approx(ref, rel=1e-9, abs=0), (mu, d)


def test_default_rdp_orders_are_dp_accountings():
    assert gdp.DEFAULT_RDP_ORDERS == tuple(rdp_privacy_accountant.DEFAULT_RDP_ORDERS)
    assert isinstance(gdp.DEFAULT_RDP_ORDERS, tuple)


def test_rdp_epsilon_matches_rdp_accountant():
    for mu in MATH12_MUS + [1e-6, 100.0]:
        for d in MATH12_DELTAS + [1e-12, 0.1, 0.5]:
            acct = rdp_privacy_accountant.RdpAccountant()
            acct.compose(dp_event.GaussianDpEvent(noise_multiplier=1.0 / mu))
            ref_eps, ref_order = acct.get_epsilon_and_optimal_order(d)
            got_eps, got_order = gdp.rdp_epsilon(mu, d)
            if ref_eps == 0:
                assert got_eps == 0.0, (mu, d)
                continue
            assert got_eps == pytest.approx(ref_eps, rel=1e-9, abs=0), (mu, d)
            assert got_order == ref_order, (mu, d)
            # RDP conversion is an upper bound on the exact epsilon
            assert got_eps >= gdp.epsilon(mu, d) * (1 - 1e-12)


def test_rdp_epsilon_custom_orders_and_edges():
    orders = [1.5, 2.0, 8.0, 32.0]
    acct = rdp_privacy_accountant.RdpAccountant(orders=orders)
    acct.compose(dp_event.GaussianDpEvent(noise_multiplier=0.5))
    ref_eps, ref_order = acct.get_epsilon_and_optimal_order(1e-6)
    got_eps, got_order = gdp.rdp_epsilon(2.0, 1e-6, orders=orders)
    assert got_eps == pytest.approx(ref_eps, rel=1e-12) and got_order == ref_order
    assert gdp.rdp_epsilon(0.0, 1e-5)[0] == 0.0
    assert gdp.rdp_epsilon(math.inf, 1e-5)[0] == math.inf


def test_rdp_matches_renyi_divergence_of_gaussians():
    # D_zeta(N(mu,1) || N(0,1)) = 1/(zeta-1) log int p^zeta q^(1-zeta), by quadrature in mpmath
    for mu, zeta in [(0.7, 1.5), (1.0, 2.0), (2.5, 8.0)]:
        with mpmath.workdps(30):
            p = lambda x: mpmath.npdf(x, mu, 1)  # noqa: E731
            q = lambda x: mpmath.npdf(x, 0, 1)  # noqa: E731
            integral = mpmath.quad(lambda x: p(x) ** zeta * q(x) ** (1 - zeta), [-mpmath.inf, 0, mu, mpmath.inf])
            ref = mpmath.log(integral) / (zeta - 1)
        assert rel_err(gdp.rdp(mu, zeta), ref) <= 1e-12
    assert gdp.rdp(math.inf, 2.0) == math.inf
    assert gdp.rdp(0.0, 2.0) == 0.0


# ----------------------------------------------------------------------------- tradeoff, compose, mu_for


def mp_tradeoff(mu, alpha):
    with mpmath.workdps(50):
        ppf = mpmath.sqrt(2) * mpmath.erfinv(2 * (1 - mpmath.mpf(alpha)) - 1)  # Phi^{-1}(1 - alpha)
        return mpmath.ncdf(ppf - mu)


def test_tradeoff_matches_mpmath_and_properties():
    alphas = np.array([1e-12, 1e-6, 1e-3, 0.05, 0.3, 0.5, 0.7, 0.95, 0.999])
    for mu in [0.1, 1.0, 3.0]:
        t = gdp.tradeoff(mu, alphas)
        assert isinstance(t, np.ndarray) and t.shape == alphas.shape
        for a, v in zip(alphas, t):
            assert rel_err(v, mp_tradeoff(mu, a)) <= 1e-12, (mu, a)
        assert np.all(t <= 1 - alphas) and np.all(np.diff(t) < 0)
        # symmetry T(T(alpha)) = alpha (away from alpha ~ 1 - 1e-16 where T(alpha) loses digits)
        mid = alphas[(alphas >= 1e-3) & (alphas <= 0.95)]
        np.testing.assert_allclose(gdp.tradeoff(mu, gdp.tradeoff(mu, mid)), mid, rtol=1e-10)
    np.testing.assert_allclose(gdp.tradeoff(0.0, alphas), 1 - alphas, rtol=1e-13)
    assert isinstance(gdp.tradeoff(1.0, 0.2), float)
    assert gdp.tradeoff(1.0, 0.0) == 1.0 and gdp.tradeoff(1.0, 1.0) == 0.0
    assert gdp.tradeoff(math.inf, 0.3) == 0.0


def test_compose_closed_form():
    assert gdp.compose([3.0, 4.0]) == 5.0
    assert gdp.compose([0.5] * 100) == pytest.approx(5.0, rel=1e-15)
    assert gdp.compose([]) == 0.0
    assert gdp.compose([1e200, 1e200]) == pytest.approx(math.sqrt(2) * 1e200, rel=1e-15)  # no overflow
    assert gdp.compose([1e-200] * 4) == pytest.approx(2e-200, rel=1e-15)  # no underflow
    assert gdp.compose([1.0, math.inf]) == math.inf
    rng = np.random.default_rng(0)
    mus = rng.uniform(0, 3, size=50)
    ref = mpmath.sqrt(mpmath.fsum(mpmath.mpf(float(m)) ** 2 for m in mus))
    assert rel_err(gdp.compose(mus), ref) <= 1e-15
    assert rel_err(gdp.compose(iter(mus.tolist())), ref) <= 1e-15  # any iterable


def test_mu_for_round_trips_and_matches_mpmath():
    for eps in [1e-3, 0.1, 1.0, 8.0, 100.0, 3000.0]:
        for d in [1e-12, 1e-5, 0.1, 0.7]:
            mu = gdp.mu_for(eps, d)
            assert 0 < mu < math.inf
            # independent: delta at mu* equals the target (mu* is the largest admissible mu)
            assert rel_err(d, mp_delta(mu, eps)) <= 1e-10, (eps, d, mu)
            assert gdp.epsilon(mu, d) == pytest.approx(eps, rel=1e-9), (eps, d)
    assert gdp.mu_for(0.0, 0.2) == pytest.approx(
        float(2 * mpmath.sqrt(2) * mpmath.erfinv(mpmath.mpf(0.2))), rel=1e-14
    )
    # continuity at epsilon -> 0 (the round trip is ill-conditioned there, the residual is not)
    assert gdp.mu_for(1e-300, 1e-5) == pytest.approx(gdp.mu_for(0.0, 1e-5), rel=1e-14)
    assert rel_err(0.5, mp_delta(gdp.mu_for(1e-12, 0.5), 1e-12)) <= 1e-14
    assert gdp.mu_for(1.0, 1.0) == math.inf
    assert gdp.mu_for(math.inf, 1e-5) == math.inf


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "call, name",
    [
        (lambda: gdp.epsilon(float("nan"), 1e-5), "mu"),
        (lambda: gdp.epsilon(-1.0, 1e-5), "mu"),
        (lambda: gdp.epsilon(1.0, 0.0), "delta"),
        (lambda: gdp.epsilon(1.0, 1.5), "delta"),
        (lambda: gdp.epsilon(1.0, float("nan")), "delta"),
        (lambda: gdp.epsilon("one", 1e-5), "mu"),
        (lambda: gdp.delta(1.0, -0.1), "epsilon"),
        (lambda: gdp.delta(-2.0, 1.0), "mu"),
        (lambda: gdp.delta(1.0, float("nan")), "epsilon"),
        (lambda: gdp.mu_for(-1.0, 1e-5), "epsilon"),
        (lambda: gdp.mu_for(1.0, 0.0), "delta"),
        (lambda: gdp.rdp(1.0, 1.0), "order"),
        (lambda: gdp.rdp(1.0, 0.5), "order"),
        (lambda: gdp.rdp(float("nan"), 2.0), "mu"),
        (lambda: gdp.rdp_epsilon(1.0, 1e-5, orders=[2.0, 1.0]), r"orders\[1\]"),
        (lambda: gdp.rdp_epsilon(1.0, 1e-5, orders=[]), "orders"),
        (lambda: gdp.rdp_epsilon(1.0, -1e-5), "delta"),
        (lambda: gdp.compose([1.0, -1.0]), r"mus\[1\]"),
        (lambda: gdp.compose([float("nan")]), r"mus\[0\]"),
        (lambda: gdp.tradeoff(1.0, [0.5, 1.2]), "alpha"),
        (lambda: gdp.tradeoff(-1.0, 0.5), "mu"),
    ],
)
def test_invalid_input_names_argument_and_range(call, name):
    with pytest.raises(ValueError, match=name) as info:
        call()
    assert any(s in str(info.value) for s in ("[0, inf]", "(0, 1]", "(1, inf)", "[0, 1]", "at least one"))

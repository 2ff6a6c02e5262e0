"""Tests of fl_dp_flower.privacy.terms against independent references (mpmath, direct
products, simulations of local runs) and the numbers tabulated in docs/MATH.md §4 and §13."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest

from fl_dp_flower.privacy.records import AccountantConfig, RoundRecord
from fl_dp_flower.privacy.schedules import step_sizes
from fl_dp_flower.privacy.terms import (
    RoundTerms,
    default_cyclic_c,
    default_iterative_z,
    drift_kappa,
    harmonic,
    per_sample_theta,
    round_terms,
)
from fl_dp_flower.privacy.planned_terms import planned_terms, planned_theta

BASE = dict(lr=0.1, smoothness=1.0, local_steps=5, clients=20, sigma=1.0, clip_norm=1.0)


def rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


# ---------------------------------------------------------------- harmonic numbers, c_K, z_K


@pytest.mark.parametrize("n", [1, 2, 5, 63, 64, 65, 100, 1000, 12345, 10**6, 10**9, 10**15])
def test_harmonic_vs_mpmath(n):
    with mpmath.workdps(40):
        ref = float(mpmath.harmonic(n))
    assert rel(harmonic(n), ref) < 4e-16


def test_harmonic_zero_and_bad_input():
    assert harmonic(0) == 0.0
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="n must be"):
            harmonic(bad)


def test_c_and_z_tabulated_values():
    # docs/MATH.md §4: c_1 = 1/ln 2 = 1.4427, 1.274 (K=5), 1.144 (50), 1.083 (1000), 1.042 (1e6)
    got_c = [default_cyclic_c(k) for k in (1, 5, 50, 1000, 10**6)]
    assert got_c[0] == pytest.approx(1 / math.log(2), rel=1e-15)
    assert [round(x, 3) for x in got_c[1:]] == [1.274, 1.144, 1.083, 1.042]
    # z: 1.443 (K=1), 2.164 (K=2), 3.294 (K=5), 6.49 (50), 10.80 (1000), 20.76 (1e6)
    got_z = [default_iterative_z(k) for k in (1, 2, 5, 50, 1000, 10**6)]
    assert [round(x, 3) for x in got_z[:3]] == [1.443, 2.164, 3.294]
    assert [round(x, 2) for x in got_z[3:]] == [6.49, 10.80, 20.76]
    with pytest.raises(ValueError, match="local_steps"):
        default_cyclic_c(0)
    with pytest.raises(ValueError, match="local_steps"):
        default_iterative_z(0)


@pytest.mark.parametrize("K", [1, 2, 5, 50, 1000])
def test_c_K_gives_exact_gamma_and_valid_rho(K):
    lr, L = 0.1, 1.0
    c = default_cyclic_c(K)
    cfg = AccountantConfig(**{**BASE, "local_steps": K, "schedule": "cyclic", "clients": 1})
    log_rho, gamma = planned_terms(cfg, 1)
    steps = [lr / (k + 1) for k in range(K)]
    assert rel(gamma[0], 2 * math.fsum(steps)) < 1e-13  # exact sensitivity, m = 1, V = 1
    exact_log_rho = math.fsum(math.log1p(e * L) for e in steps)
    assert log_rho[0] >= exact_log_rho
    assert rel(log_rho[0], c * lr * L * math.log1p(K)) < 1e-15


@pytest.mark.parametrize("K", [1, 5, 50])
def test_z_K_is_the_smallest_valid_iterative_constant(K):
    lr, L, m = 0.1, 1.0, 1
    cfg = AccountantConfig(**{**BASE, "local_steps": K, "schedule": "iterative", "clients": m})
    T = 300
    log_rho, gamma = planned_terms(cfg, T)
    for t in range(T):
        steps = step_sizes("iterative", lr, t, K)
        assert gamma[t] >= 2 * math.fsum(steps) * (1 - 1e-13)
        assert log_rho[t] >= math.fsum(math.log1p(e * L) for e in steps) * (1 - 1e-13)
    # already 0.999 z_K underestimates gamma_0
    low = AccountantConfig(**{**BASE, "local_steps": K, "schedule": "iterative", "clients": m,
                              "iterative_z": 0.999 * default_iterative_z(K)})
    with pytest.raises(ValueError, match="iterative_z"):
        planned_terms(low, 3)


def test_user_supplied_c_and_z():
    ok = AccountantConfig(**{**BASE, "schedule": "cyclic", "cyclic_c": 1.5})
    _, g = planned_terms(ok, 2)
    assert rel(g[0], 2 * 1.5 * 0.1 * math.log(6) / 20) < 1e-15
    bad_c = AccountantConfig(**{**BASE, "schedule": "cyclic", "cyclic_c": 1.2})
    with pytest.raises(ValueError, match=r"cyclic_c.*minimum"):
        planned_terms(bad_c, 2)
    bad_z = AccountantConfig(**{**BASE, "schedule": "iterative", "iterative_z": 2.0})
    with pytest.raises(ValueError, match=r"iterative_z.*minimum"):
        planned_terms(bad_z, 2)
    # an unused constant is not checked
    planned_terms(AccountantConfig(**{**BASE, "schedule": "constant", "cyclic_c": 1.0}), 2)


# ---------------------------------------------------------------- kappa and theta (§13)


def _kappa_mp(steps, L):
    with mpmath.workdps(50):
        prod = mpmath.mpf(1)
        for e in steps:
            prod *= 1 + mpmath.mpf(e) * L
        return float((prod - 1) / (L * mpmath.fsum(steps)))


def test_drift_kappa_vs_mpmath():
    rng = np.random.default_rng(1)
    worst = 0.0
    for _ in range(200):
        K = int(rng.integers(1, 60))
        L = float(10 ** rng.uniform(-9, 1))
        steps = (10 ** rng.uniform(-4, 0, K)).tolist()
        worst = max(worst, rel(drift_kappa(steps, L), _kappa_mp(steps, L)))
    assert worst < 1e-12


def test_drift_kappa_edges():
    assert drift_kappa([0.1, 0.2], 0.0) == 1.0
    assert drift_kappa([0.3], 2.0) == pytest.approx(1.0, abs=1e-15)
    assert drift_kappa([0.1] * 10**6, 1.0) == math.inf  # rho = e^{95310}
    big = drift_kappa([0.1] * 7400, 1.0)  # exponent ~705: log-space branch, still finite
    assert math.isfinite(big) and big > 1e300
    assert per_sample_theta(math.inf, 8) == 1.0
    with pytest.raises(ValueError, match="step_sizes"):
        drift_kappa([], 1.0)
    with pytest.raises(ValueError, match="step_sizes"):
        drift_kappa([0.1, -0.1], 1.0)
    with pytest.raises(ValueError, match="smoothness"):
        drift_kappa([0.1], -1.0)
    with pytest.raises(ValueError, match="batch_size"):
        per_sample_theta(1.2, 0)
    with pytest.raises(ValueError, match="kappa"):
        per_sample_theta(float("nan"), 4)


def test_spec13_theta_table():
    # theta < 1 needs the operator's L-smoothness assertion (issue 16 item 2; K = 1 needs none)
    unasserted = AccountantConfig(**{**BASE, "clipping": "per-sample", "batch_size": 32})
    assert planned_theta(unasserted) == 1.0
    assert planned_theta(AccountantConfig(**{**BASE, "clipping": "per-sample", "batch_size": 32,
                                             "local_steps": 1})) == 1 / 32
    ps = dict(clipping="per-sample", assume_smooth_losses=True)
    c1 = AccountantConfig(**{**BASE, **ps, "batch_size": 32})
    assert rel(drift_kappa([0.1] * 5, 1.0), 1.22102) < 1e-6
    assert rel(planned_theta(c1), 0.0381569) < 1e-6
    c2 = AccountantConfig(**{**BASE, **ps, "batch_size": 64, "local_steps": 1000})
    assert planned_theta(c2) == 1.0
    c3 = AccountantConfig(**{**BASE, **ps, "batch_size": 50, "lr": 0.05, "smoothness": 1e-12,
                             "local_steps": 20})
    assert rel(planned_theta(c3), 0.02) < 1e-9
    for sched in ("cyclic", "iterative"):
        c4 = AccountantConfig(**{**BASE, **ps, "batch_size": 8, "local_steps": 1000, "schedule": sched})
        assert rel(planned_theta(c4), 0.18326) < 3e-5
        assert rel(planned_theta(c4) * 8, _kappa_mp([0.1 / (k + 1) for k in range(1000)], 1.0)) < 1e-12
    c5 = AccountantConfig(**{**BASE, **ps, "batch_size": 8, "algorithm": "fedprox", "prox_alpha": 2.0})
    assert planned_theta(c5) == 0.25
    c6 = AccountantConfig(**{**BASE, **ps, "batch_size": 8, "algorithm": "fedprox",
                             "prox_alpha": 1.000001, "lr": 0.5})
    assert planned_theta(c6) == 1.0
    assert planned_theta(AccountantConfig(**BASE)) == 1.0


def test_spec13_counterexample_naive_rule_fails_sound_rule_holds():
    B, K, lr, L, V = 32, 5, 0.1, 1.0, 1.0

    def run(sign):
        w = 0.0
        for _ in range(K):
            # B - 1 samples of loss -(L/2) w^2 (gradient -L w, |.| < V: no clipping),
            # the differing sample has loss +-V w (gradient +-V, norm V: no clipping)
            g = ((B - 1) * (-L * w) + sign * V) / B
            w -= lr * g
        return w

    gap = abs(run(+1) - run(-1))
    assert round(gap, 6) == 0.037920
    naive = (2 * V / B) * K * lr
    assert gap > naive and round(naive, 5) == 0.03125
    rec = RoundRecord(round=1, algorithm="fedavg", step_sizes=[lr] * K, clip_norm=V, sigma=1.0,
                      weights=[1.0], clipping="per-sample", batch_size=B)
    sound = round_terms(rec, L, assume_smooth_losses=True).client_sensitivity
    assert round(sound, 6) == 0.038157
    assert gap <= sound


def _clip(g, V):
    n = np.linalg.norm(g)
    return g if n <= V else g * (V / n)


def _random_quadratic(rng, d, L):
    q, _ = np.linalg.qr(rng.normal(size=(d, d)))
    eig = np.where(rng.random(d) < 0.5, -L, rng.uniform(-L, L, d))
    return q @ np.diag(eig) @ q.T, rng.normal(size=d) * 3


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox"])
def test_per_sample_sensitivity_never_exceeded_by_simulation(algorithm):
    """Random 3-D instances: per-sample clipped local runs on neighbouring datasets never end
    farther apart than Gamma^ps of round_terms (and Gamma^ps <= theta * per-batch Gamma)."""
    rng = np.random.default_rng(7)
    d, V = 3, 1.0
    worst = 0.0
    for _ in range(150):
        K = int(rng.integers(1, 8))
        B = int(rng.integers(1, 12))
        L = float(rng.uniform(0.2, 3.0))
        alpha = None
        if algorithm == "fedprox":
            alpha = L * float(rng.uniform(1.02, 4.0))
            etas = rng.uniform(0.05, 1.0, K) / alpha
        else:
            etas = rng.uniform(0.02, 1.0, K) / L
        common = [_random_quadratic(rng, d, L) for _ in range(B - 1)]
        diff = [rng.normal(size=d) * 10 for _ in range(2)]  # linear losses, clipped to V
        w0 = rng.normal(size=d) * 0.1

        def run(v):
            w = w0.copy()
            for eta in etas:
                grads = [_clip(A @ (w - c), V) for A, c in common] + [_clip(v, V)]
                g = np.mean(grads, axis=0)
                step = g + (alpha * (w - w0) if alpha else 0.0)
                w = w - eta * step
            return w

        gap = float(np.linalg.norm(run(diff[0]) - run(diff[1])))
        removed = float(np.linalg.norm(run(diff[0]) - run(np.zeros(d))))  # add/remove: zero gradient
        rec = RoundRecord(round=1, algorithm=algorithm, step_sizes=etas.tolist(), clip_norm=V,
                          sigma=1.0, weights=[1.0], clipping="per-sample", batch_size=B,
                          prox_alpha=alpha)
        terms = round_terms(rec, L, assume_smooth_losses=True)
        bound = terms.client_sensitivity
        assert removed <= terms.client_sensitivity_add_remove * (1 + 1e-9)
        assert terms.client_sensitivity_add_remove <= bound
        batch = round_terms(RoundRecord(round=1, algorithm=algorithm, step_sizes=etas.tolist(),
                                        clip_norm=V, sigma=1.0, weights=[1.0], prox_alpha=alpha),
                            L).client_sensitivity
        kappa = alpha / (alpha - L) if alpha else drift_kappa(etas, L)
        assert bound <= per_sample_theta(kappa, B) * batch * (1 + 1e-12)
        assert gap <= bound * (1 + 1e-9)
        worst = max(worst, gap / bound)
    assert worst > 0.3  # the instances are not trivially loose


# ---------------------------------------------------------------- record-based terms (§14.1)


def test_round_terms_fedavg_weights_and_noise():
    steps = [0.3, 0.2, 0.05]
    rec = RoundRecord(round=4, algorithm="fedavg", step_sizes=steps, clip_norm=2.0, sigma=1.5,
                      weights=[0.5, 0.3, 0.2])
    t = round_terms(rec, 0.7)
    assert isinstance(t, RoundTerms)
    assert rel(t.client_sensitivity, 2 * 2.0 * 0.55) < 1e-15
    assert rel(t.gamma, 0.5 * 2 * 2.0 * 0.55) < 1e-15
    assert rel(t.log_rho, math.log(1.21 * 1.14 * 1.035)) < 1e-14
    assert rel(t.noise_std, 1.5 * math.sqrt(0.25 + 0.09 + 0.04)) < 1e-15
    assert t.sigma == 1.5
    assert round_terms(rec, 0.0).log_rho == 0.0


def test_round_terms_fedprox_matches_linear_loss_simulation():
    """Lemma 9 is tight for linear losses: the telescoped Gamma is the exact gap."""
    alpha, L, V = 2.0, 1.0, 1.0
    etas = [0.5, 0.3, 0.45, 0.1]
    w0 = np.zeros(2)
    v = np.array([V, 0.0])

    def run(sign):
        w = w0.copy()
        for eta in etas:
            w = w - eta * (sign * v + alpha * (w - w0))
        return w

    gap = float(np.linalg.norm(run(1) - run(-1)))
    rec = RoundRecord(round=1, algorithm="fedprox", step_sizes=etas, clip_norm=V, sigma=1.0,
                      weights=[0.25] * 4, prox_alpha=alpha)
    t = round_terms(rec, L)
    assert rel(t.client_sensitivity, gap) < 1e-14
    assert t.client_sensitivity <= 2 * V / alpha
    assert rel(t.gamma, gap / 4) < 1e-14
    assert rel(t.log_rho, math.log(alpha / (alpha - L))) < 1e-15
    # eta = 1/alpha exactly: Gamma = 2V/alpha
    full = RoundRecord(round=1, algorithm="fedprox", step_sizes=[0.5], clip_norm=V, sigma=1.0,
                       weights=[1.0], prox_alpha=alpha)
    assert round_terms(full, L).client_sensitivity == pytest.approx(1.0, rel=1e-15)


def test_round_terms_bad_inputs():
    rec = RoundRecord(round=1, algorithm="fedprox", step_sizes=[0.4], clip_norm=1.0, sigma=1.0,
                      weights=[1.0], prox_alpha=2.0)
    at_L = round_terms(rec, 2.0)  # alpha <= L (issue 30): no rho (inf), the clipping-only sensitivity stays
    assert at_L.log_rho == math.inf and at_L.client_sensitivity == pytest.approx(0.4 * 2.0, rel=1e-15)
    big = RoundRecord(round=1, algorithm="fedprox", step_sizes=[0.4, 0.6], clip_norm=1.0,
                      sigma=1.0, weights=[1.0], prox_alpha=2.0)
    with pytest.raises(ValueError, match="step_sizes"):
        round_terms(big, 1.0)
    with pytest.raises(ValueError, match="smoothness"):
        round_terms(rec, float("nan"))
    with pytest.raises(ValueError, match="record"):
        round_terms({"round": 1}, 1.0)


# ---------------------------------------------------------------- planned (Table 2) terms


@pytest.mark.parametrize("schedule", ["constant", "cyclic", "stage", "iterative"])
@pytest.mark.parametrize("clipping", ["per-batch", "per-sample"])
def test_planned_terms_dominate_record_terms(schedule, clipping):
    cfg = AccountantConfig(**{**BASE, "schedule": schedule, "clipping": clipping, "batch_size": 16})
    T = 40
    log_rho, gamma = planned_terms(cfg, T)
    for t in range(T):
        exact = round_terms(cfg.planned_round(t + 1), cfg.smoothness)
        assert gamma[t] >= exact.gamma * (1 - 1e-13)
        assert log_rho[t] >= exact.log_rho * (1 - 1e-13)
        assert exact.noise_std == pytest.approx(1 / math.sqrt(20), rel=1e-14)
        # Table 2 is exact for C, SD (and CD at t = 0); per sample only the t = 0 round
        # attains the schedule-level theta (kappa_t decreases with the steps)
        exact_gamma = schedule in ("constant", "stage") or (schedule == "cyclic" and t == 0)
        if exact_gamma and (clipping == "per-batch" or t == 0 or schedule == "constant"):
            assert rel(gamma[t], exact.gamma) < 1e-13
        if schedule in ("constant", "stage"):
            assert rel(log_rho[t], exact.log_rho) < 1e-13


def test_planned_terms_fedprox():
    cfg = AccountantConfig(**{**BASE, "algorithm": "fedprox", "prox_alpha": 2.0, "lr": 0.4,
                              "local_steps": 20})
    log_rho, gamma = planned_terms(cfg, 3)
    assert np.allclose(gamma, 2 / (20 * 2.0), rtol=1e-15)
    assert np.allclose(log_rho, math.log(2.0), rtol=1e-15)
    exact = round_terms(cfg.planned_round(1), 1.0)
    assert exact.gamma <= gamma[0] and rel(exact.gamma, gamma[0]) < 1e-5  # (1 - 0.2)^20 = 0.0115


def test_planned_terms_long_and_validated():
    cfg = AccountantConfig(**{**BASE, "schedule": "iterative", "clipping": "per-sample", "batch_size": 8})
    log_rho, gamma = planned_terms(cfg, 10**6)  # speed: bench/accountant.py
    assert log_rho.shape == gamma.shape == (10**6,)
    assert np.all(np.diff(gamma) < 0) and np.all(np.isfinite(log_rho))
    for bad in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="rounds"):
            planned_terms(cfg, bad)

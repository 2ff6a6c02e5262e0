"""The secure-aggregation threat model (docs/MATH.md §20) against an independent closed form.

The server sees only the secure sum of the m_t uploads that entered it; c colluding participants
subtract their own. In sum units one client's upload moves the sum by Gamma_t and the honest noise
has std sigma * sqrt(m_t - c), so mu = sqrt(sum_t (Gamma_t / (sigma sqrt(m_t - c)))^2), with
Gamma_t = 2 V sum_k eta_k (FedAvg, per-batch clipping) computed here by hand, and epsilon(delta)
solved from the Gaussian-DP curve delta(eps) = Phi(-eps/mu + mu/2) - e^eps Phi(-eps/mu - mu/2) in
mpmath (50 digits), not with the package's gdp module.
"""

from __future__ import annotations

import dataclasses
import json
import math

import mpmath
import pytest

from fl_dp_flower.app.config import AppConfig, ConfigError
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.planning import calibrate, plan, planned_run
from fl_dp_flower.privacy.records import AccountantConfig, RoundRecord
from fl_dp_flower.privacy.secure_aggregation import SECURE_AGGREGATION_BOUND, secure_aggregation_assumption
from fl_dp_flower.privacy.skellam import skellam_assumption

DELTA = 1e-5
V, LR, K, SIGMA = 1.5, 0.05, 4, 0.8


def _gdp_epsilon(mu: float, delta: float) -> float:
    """epsilon with delta_mu(epsilon) = delta, from the GDP curve in mpmath (bisection on epsilon)."""
    mpmath.mp.dps = 50
    m = mpmath.mpf(mu)

    def curve(eps: mpmath.mpf) -> mpmath.mpf:
        return mpmath.ncdf(-eps / m + m / 2) - mpmath.exp(eps) * mpmath.ncdf(-eps / m - m / 2)

    if curve(mpmath.mpf(0)) <= delta:
        return 0.0
    lo, hi = mpmath.mpf(0), mpmath.mpf(1)
    while curve(hi) > delta:
        hi *= 2
    for _ in range(200):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if curve(mid) > delta else (lo, mid)
    return float(hi)


def _config(colluders: int, clients: int = 10, **kw) -> AccountantConfig:
    return AccountantConfig(lr=LR, local_steps=K, clip_norm=V, clients=clients, sigma=SIGMA, delta=DELTA,
                            threat_model="secure-aggregation", colluders=colluders, smoothness=1.0, **kw)


def _record(t: int, m: int) -> RoundRecord:
    return RoundRecord(round=t, algorithm="fedavg", step_sizes=(LR,) * K, clip_norm=V, sigma=SIGMA,
                       weights=(1.0 / m,) * m)


def _closed_form_mu(counts: list[int], colluders: int) -> float:
    gamma = 2.0 * V * LR * K  # one client's upload, sum units
    return math.sqrt(math.fsum((gamma / (SIGMA * math.sqrt(m - colluders))) ** 2 for m in counts))


@pytest.mark.parametrize(("colluders", "counts"), [
    (0, [10] * 6),
    (1, [10] * 6),
    (3, [10, 9, 7, 10, 5, 8]),  # dropouts: m_t = the clients whose masked inputs entered the sum
    (0, [3, 12, 1, 7]),
])
def test_accountant_matches_the_closed_form(colluders, counts):
    accountant = PrivacyAccountant(_config(colluders))
    for t, m in enumerate(counts, start=1):
        accountant.step(_record(t, m))
    report = accountant.report()
    mu = _closed_form_mu(counts, colluders)
    assert report.certified_bound == SECURE_AGGREGATION_BOUND
    assert report.certified.mu == pytest.approx(mu, rel=1e-12)
    assert report.certified.epsilon == pytest.approx(_gdp_epsilon(mu, DELTA), rel=1e-7)
    assert secure_aggregation_assumption(colluders) in report.certified.assumes
    assert report.to_dict()["certified"]["assumes"] == list(report.certified.assumes)
    # the server sees far less than every upload: below local DP whenever m_t - c > 1 somewhere
    assert report.certified.mu < report.bounds["local_dp"].mu


def test_more_colluders_cost_more_and_c_zero_is_the_outside_observers_composition():
    counts = [10, 8, 10]
    mus = []
    for c in (0, 1, 4):
        acc = PrivacyAccountant(_config(c))
        acc.extend(_record(t, m) for t, m in enumerate(counts, start=1))
        mus.append(acc.report().certified.mu)
    assert mus[0] < mus[1] < mus[2]
    outside = PrivacyAccountant(dataclasses.replace(_config(0), threat_model="all-rounds"))
    outside.extend(_record(t, m) for t, m in enumerate(counts, start=1))
    assert mus[0] == pytest.approx(outside.report().certified.mu, rel=1e-12)


def test_a_round_with_no_more_contributors_than_colluders_costs_local_dp_not_less():
    """m_t <= c: the coalition is at most the m_t - 1 others; the target's own noise is all that is left,
    so the round costs Gamma/sigma (the local-DP term), never a smaller (or undefined) amount."""
    acc = PrivacyAccountant(_config(5))
    acc.step(_record(1, 3))
    gamma = 2.0 * V * LR * K
    assert acc.report().certified.mu == pytest.approx(gamma / SIGMA, rel=1e-12)
    assert acc.report().certified.mu == pytest.approx(acc.report().bounds["local_dp"].mu, rel=1e-12)
    acc.step(_record(2, 10))
    expected = math.hypot(gamma / SIGMA, gamma / (SIGMA * math.sqrt(5)))
    assert acc.report().certified.mu == pytest.approx(expected, rel=1e-12)


def test_final_model_is_never_combined_with_it():
    """A stage schedule with L-smooth losses has final_model < composition; secure-aggregation ignores it."""
    config = _config(0, schedule="stage", assume_smooth_losses=True)
    run = planned_run(config, 30)
    last = run.reports[-1]
    assert last.bounds["final_model"].mu < last.bounds["composition"].mu
    assert last.certified_bound == SECURE_AGGREGATION_BOUND
    assert last.certified.mu == pytest.approx(last.bounds["composition"].mu, rel=1e-12)
    assert last.add_remove["bound"] == SECURE_AGGREGATION_BOUND
    assert 0 < last.add_remove["mu"] <= last.certified.mu  # add/remove-one: composition's, not final_model's


@pytest.mark.parametrize("colluders", [0, 2])
def test_plan_calibration_and_the_accountant_agree(colluders):
    config = _config(colluders, clients=20)
    rounds = 25
    planned = plan(config, rounds)
    acc = PrivacyAccountant(config)
    acc.extend(config.planned_round(t) for t in range(1, rounds + 1))
    report = acc.report()
    assert planned.certified_bound == report.certified_bound == SECURE_AGGREGATION_BOUND
    assert planned.bounds[SECURE_AGGREGATION_BOUND].mu == pytest.approx(report.certified.mu, rel=1e-9)
    assert planned.bounds[SECURE_AGGREGATION_BOUND].assumes == report.certified.assumes
    assert planned.add_remove["mu"] == pytest.approx(report.add_remove["mu"], rel=1e-9)
    assert report.certified.mu == pytest.approx(_closed_form_mu([20] * rounds, colluders), rel=1e-12)
    cal = calibrate(config, rounds, 2.0)
    assert cal.bound == SECURE_AGGREGATION_BOUND
    acc2 = PrivacyAccountant(dataclasses.replace(config, sigma=cal.sigma))
    acc2.extend(dataclasses.replace(config, sigma=cal.sigma).planned_round(t) for t in range(1, rounds + 1))
    assert acc2.report().certified.epsilon == pytest.approx(2.0, rel=1e-6)


def test_poisson_client_sampling_is_refused():
    with pytest.raises(ValueError, match="secure-aggregation.*Poisson.*bias"):
        _config(1, sampling_rate=0.2)
    with pytest.raises(ConfigError, match="secure-aggregation.*client-sampling"):
        AppConfig.from_run_config({"threat-model": "secure-aggregation", "client-sampling": "poisson",
                                   "sampling-rate": 0.2, "clients-per-round": 5, "min-replies": 5})


def test_the_run_config_accepts_it_for_planning_with_its_colluders():
    config = AppConfig.from_run_config({"threat-model": "secure-aggregation", "colluding-clients": 2,
                                        "clients-per-round": 6, "min-replies": 6})
    acc_config = config.accountant_config()
    assert acc_config.threat_model == "secure-aggregation" and acc_config.colluders == 2
    assert plan(acc_config, 3).certified_bound == SECURE_AGGREGATION_BOUND


def test_weighted_rounds_use_the_hidden_noise_of_the_largest_weight():
    """Weighted sum sum_i p_i u_i: the target k moves it by p_k Gamma, honest noise sigma sqrt(sum p_j^2)."""
    weights = (0.4, 0.3, 0.2, 0.1)
    record = dataclasses.replace(_record(1, 4), weights=weights)
    acc = PrivacyAccountant(_config(1))
    acc.step(record)
    gamma = 2.0 * V * LR * K
    worst = 0.4 * gamma / (SIGMA * math.sqrt(0.4**2 + 0.2**2 + 0.1**2))  # coalition: the 0.3 client
    assert acc.report().certified.mu == pytest.approx(worst, rel=1e-12)


def test_the_command_line_prints_the_assumption_next_to_the_certified_number(capsys):
    from fl_dp_flower.app.cli import main

    argv = ["privacy", "--sigma", "1", "--clients-per-round", "50", "--threat-model", "secure-aggregation",
            "--colluding-clients", "3", "--min-replies", "7"]
    assert main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["certified"]["bound"] == SECURE_AGGREGATION_BOUND
    # the run's integer sum (the app's model and grid): the Skellam bound, a little above the real-valued sum's
    assert math.isinf(float(out["certified"]["mu"]))
    assert out["bounds"]["composition"]["epsilon"] < out["certified"]["epsilon"]
    assert out["certified"]["epsilon"] < 1.1 * out["bounds"]["composition"]["epsilon"]
    assert out["certified"]["assumes"][-1] == skellam_assumption(3)
    assert main(argv) == 0
    text = " ".join(capsys.readouterr().out.split())  # the table wraps long lines
    assert "certified (secure_aggregation, chosen by threat model secure-aggregation" in text
    assert "Skellam secure sum" in text and "honest-but-curious server" in text
    assert "at most c = 3 colluding participants" in text


# ----------------------------------------------------------------------------- issue 28 item 5: no grid, no certificate
def test_without_the_integer_grid_the_number_is_marked_planning_only_where_it_is_read_and_printed():
    """The main job with one client per SuperNode, c 1, no sum_grid_step: 3.831 is the real-valued sum's bound, which a
    run never certifies (it certifies the integer sum's Skellam bound). Before the fix get_privacy_spent() returned it
    with no mark and the round line called it certified."""
    from fl_dp_flower.reporting.console import format_round_line

    config = AccountantConfig(clients=4000, sigma=0.55, lr=2.0, local_steps=1, clip_norm=1.0, batch_size=1,
                              threat_model="secure-aggregation", colluders=1)
    with pytest.warns(UserWarning, match="planning only"):
        accountant = PrivacyAccountant(config)
    for t in range(1, 61):
        accountant.step(config.planned_round(t))
    spent = accountant.get_privacy_spent()
    assert spent.planning_only and spent.epsilon == pytest.approx(3.831, abs=1e-3)
    report = accountant.report().to_dict()
    assert report["certified"]["planning_only"] is True
    line = format_round_line(report, accuracy=None, clients=4000)
    assert "PLANNING ONLY (not a certificate) mu=" in line and "certified mu" not in line
    with_grid = dataclasses.replace(config, sum_grid_step=2.0**-16, sum_dimension=61706)
    graded = PrivacyAccountant(with_grid)
    graded.step(with_grid.planned_round(1))
    assert not graded.get_privacy_spent().planning_only and "planning_only" not in graded.report().to_dict()["certified"]


def test_the_integer_sum_s_delta_at_its_epsilon_is_dp_accounting_s_rdp_conversion():
    """Review R1, independent of the package's conversion: dp-accounting's RDP accountant converts the report's
    curve to the same epsilon and, back, to the same delta (the clamp's share aside, 1e-6 of delta); a round of
    fewer contributors costs more (the sum the budget check charges at min-replies)."""
    from dp_accounting.rdp.rdp_privacy_accountant import compute_delta, compute_epsilon

    config = AccountantConfig(clients=4000, sigma=0.55, lr=2.0, local_steps=1, clip_norm=1.0, batch_size=1, delta=1e-5,
                              threat_model="secure-aggregation", colluders=1, sum_grid_step=2.0**-16,
                              sum_dimension=61706)
    accountant = PrivacyAccountant.from_records(config, [config.planned_round(t) for t in range(1, 61)])
    report = accountant.report()
    orders, rdp = report.rdp_curve
    eps = report.certified.epsilon
    assert eps == pytest.approx(compute_epsilon(orders, rdp, 1e-5 * (1 - 1e-6))[0], rel=1e-12)
    assert accountant.get_delta(eps) == pytest.approx(compute_delta(orders, rdp, eps)[0], rel=1e-9)
    assert accountant.get_delta(eps) <= 1e-5
    costs = [PrivacyAccountant.from_records(config, [config.planned_round(1, m)]).report().certified.epsilon
             for m in (5, 10, 100)]
    assert costs == sorted(costs, reverse=True) and costs[0] == pytest.approx(23.37, abs=5e-3)

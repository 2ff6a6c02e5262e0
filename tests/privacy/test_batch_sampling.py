"""The batch_sampled bound of Poisson batch sampling on the nodes (docs/MATH.md §23), pinned to independent
references: numerical integrals of the per-round pair (scipy, one and two rounds), dp-accounting's own
accountants driven through their DpEvent API (PLD, and RDP as an upper bound), and the sound rule for
K >= 2 and for rounds that are not Poisson-sampled (never charged less than without amplification)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, stats

from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.records import AccountantConfig, RoundRecord
from fl_dp_flower.privacy.sample_sampling import (BATCH_SAMPLED_BOUND, BatchSampledComposition, composed_epsilon,
                                                  inclusion_rate, round_pair)
from fl_dp_flower.privacy.terms import round_terms

DELTA = 1e-5


def _cfg(**kw):
    base = dict(algorithm="fedavg", schedule="constant", lr=0.5, local_steps=1, clip_norm=1.0, clients=10, sigma=0.05,
                clipping="per-sample", batch_size=40, batch_rate=0.1, colluders=1, threat_model="all-rounds")
    base.update(kw)
    return AccountantConfig(**base)


def _pld_accountant_epsilon(relation, q, z, rounds):
    """dp-accounting's PLD accountant on PoissonSampledDpEvent(q, GaussianDpEvent(z)) composed ``rounds`` times."""
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    rel = dp_accounting.NeighboringRelation
    acc = pld_privacy_accountant.PLDAccountant(rel.REPLACE_ONE if relation == "replace-one" else rel.ADD_OR_REMOVE_ONE,
                                               value_discretization_interval=1e-4)
    acc.compose(dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds))
    return acc.get_epsilon(DELTA)


def _hockey_stick_1d(p_pdf, q_pdf, eps, lo=-40.0, hi=40.0):
    value, _ = integrate.quad(lambda x: max(p_pdf(x) - math.exp(eps) * q_pdf(x), 0.0), lo, hi, limit=400, epsabs=1e-14,
                              points=[0.0])
    return value


def _mixture(q, shift, r):
    return lambda x: (1 - q) * stats.norm.pdf(x) + q * stats.norm.pdf(x - shift * r)


def test_inclusion_rate_is_one_minus_the_chance_of_missing_every_batch():
    assert inclusion_rate(0.1, 1) == pytest.approx(0.1, rel=1e-15)
    assert inclusion_rate(0.1, 5) == pytest.approx(1 - 0.9 ** 5, rel=1e-14)
    assert inclusion_rate(1e-9, 3) == pytest.approx(3e-9, rel=1e-8)
    assert inclusion_rate(1.0, 7) == 1.0
    with pytest.raises(ValueError, match="rate"):
        inclusion_rate(1.5, 1)


@pytest.mark.parametrize("relation", ["replace-one", "add/remove-one"])
def test_one_round_matches_the_integral_of_the_subsampled_gaussian_pair(relation):
    """One round: the PLD's delta at its own epsilon equals the exact hockey-stick divergence of the pair,
    integrated numerically (add/remove: both directions; replace-one: the pair is symmetric)."""
    q, r = 0.1, 1.5
    comp = BatchSampledComposition(relation)
    comp.push((q, r))
    eps = comp.epsilon(DELTA)
    if relation == "add/remove-one":
        p, base = _mixture(q, 1, r), stats.norm.pdf
        exact = max(_hockey_stick_1d(p, base, eps), _hockey_stick_1d(base, p, eps))
    else:
        exact = _hockey_stick_1d(_mixture(q, 1, r), _mixture(q, -1, r), eps)
    # the PLD is pessimistic: its epsilon is where its (larger) delta reaches DELTA, so the exact delta there
    # is at most DELTA and close to it
    assert exact <= DELTA * (1 + 1e-4)  # quadrature error only
    assert exact >= 0.9 * DELTA


def _grid_integral(f, lo=-12.0, hi=16.0, n=1401):
    """Trapezoid rule on an n x n grid (the integrands are smooth but for one kink: error O(h^2))."""
    x = np.linspace(lo, hi, n)
    xx, yy = np.meshgrid(x, x, indexing="ij")
    return float(np.trapezoid(np.trapezoid(f(xx, yy), x, axis=1), x))


def test_two_rounds_match_the_two_dimensional_integral():
    """Two rounds of the add/remove (remove) pair with different r: the exact delta of the product pair."""
    q, r1, r2 = 0.2, 1.0, 2.0
    comp = BatchSampledComposition("add/remove-one")
    comp.push((q, r1))
    comp.push((q, r2))
    eps = comp.epsilon(1e-3)
    p1, p2 = _mixture(q, 1, r1), _mixture(q, 1, r2)
    e = math.exp(eps)
    exact = _grid_integral(lambda x, y: np.maximum(p1(x) * p2(y) - e * stats.norm.pdf(x) * stats.norm.pdf(y), 0.0))
    assert 0.9e-3 <= exact <= 1e-3 * (1 + 1e-3)


@pytest.mark.parametrize("angle_deg", [60, 90, 135])
def test_replace_one_in_two_dimensions_is_dominated_by_the_antipodal_pair(angle_deg):
    """The shifts v, v' of the two worlds are vectors of norm <= r, not necessarily opposite: the pair
    (1-q)N(0,I) + qN(v,I) against (1-q)N(0,I) + qN(v',I), integrated in 2-D, is never more distinguishable than
    the 1-D antipodal pair dp-accounting's REPLACE_ONE uses (a numerical check of the reduction, docs/MATH.md §23.1)."""
    q, r, eps = 0.2, 1.5, 0.5
    a = math.radians(angle_deg)
    v, w = np.array([r, 0.0]), np.array([r * math.cos(a), r * math.sin(a)])

    def pdf(x, y, m):
        return (1 - q) * stats.norm.pdf(x) * stats.norm.pdf(y) + q * stats.norm.pdf(x - m[0]) * stats.norm.pdf(y - m[1])

    two_d = _grid_integral(lambda x, y: np.maximum(pdf(x, y, v) - math.exp(eps) * pdf(x, y, w), 0.0), -10, 10)
    antipodal = _hockey_stick_1d(_mixture(q, 1, r), _mixture(q, -1, r), eps)
    assert two_d <= antipodal * (1 + 1e-4)


@pytest.mark.parametrize("colluders", [0, 1])
def test_k1_accountant_equals_dp_accountings_poisson_sampled_gaussian(colluders):
    """K = 1, per-sample clipping, 10 sites, T rounds: the certified epsilon is dp-accounting's PLD accountant on
    T PoissonSampledDpEvent(q, GaussianDpEvent(z)) with z = (noise hiding the target) / (its per-sample shift)
    = sigma sqrt(m - c) / m / (eta V / (B m)) = sigma sqrt(m - c) B / (eta V), built here by hand."""
    cfg = _cfg(colluders=colluders)
    acc = PrivacyAccountant(cfg)
    acc.extend(cfg.planned_round(t) for t in range(1, 41))
    report = acc.report()
    z = cfg.sigma * math.sqrt(cfg.clients - colluders) * cfg.batch_size / (cfg.lr * cfg.clip_norm)
    assert report.certified_bound == BATCH_SAMPLED_BOUND
    assert report.certified.epsilon == pytest.approx(_pld_accountant_epsilon("replace-one", 0.1, z, 40), rel=2e-3)
    assert report.add_remove["bound"] == BATCH_SAMPLED_BOUND
    assert report.add_remove["epsilon"] == pytest.approx(_pld_accountant_epsilon("add/remove-one", 0.1, z, 40),
                                                         rel=2e-3)
    # the unamplified composition is what the same rounds cost without the batch sampling
    assert report.bounds["composition"].epsilon > 5 * report.certified.epsilon
    assert report.batch_sampling["epsilon_without_amplification"] == report.bounds["composition"].epsilon


def test_rdp_of_the_same_events_is_an_upper_bound():
    """dp-accounting's RDP accountant (add/remove) on the same events: an upper bound the PLD stays under."""
    import dp_accounting
    from dp_accounting.rdp import rdp_privacy_accountant

    q, z, rounds = 0.1, 1.2, 200
    pld_eps = composed_epsilon("add/remove-one", [(q, 1 / z)] * rounds, DELTA)
    rdp = rdp_privacy_accountant.RdpAccountant()
    rdp.compose(dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(z)), rounds)
    assert pld_eps <= rdp.get_epsilon(DELTA)
    assert pld_eps >= 0.7 * rdp.get_epsilon(DELTA)


def test_k_at_least_2_is_charged_the_inclusion_rate_and_the_clip_only_sensitivity():
    """K = 3: rate 1 - (1-q)^3 and the clip-only add/remove shift eta V/B + 2V (K-1) eta over the noise,
    even when the operator asserts L-smooth losses (the drift bound needs B samples per batch)."""
    cfg = _cfg(local_steps=3, lr=0.05, sigma=0.2, assume_smooth_losses=True, smoothness=1.0)
    record = cfg.planned_round(1)
    terms = round_terms(record, cfg.smoothness, cfg.colluders, assume_smooth_losses=False)
    p, r = round_pair(record, terms, "all-rounds")
    assert p == pytest.approx(1 - 0.9 ** 3)
    target_noise = cfg.sigma * math.sqrt(cfg.clients - 1) / cfg.clients
    assert r == pytest.approx((0.05 / 40 + 2 * 2 * 0.05) / cfg.clients / target_noise)
    acc = PrivacyAccountant(cfg)
    report = acc.step(record)
    assert not acc.report().bounds["composition"].assumes  # no theta < 1 from L with Poisson batches
    assert report.bounds["composition"].mu == pytest.approx(2 * 3 * 0.05 / cfg.clients / target_noise)
    assert report.bounds[BATCH_SAMPLED_BOUND].epsilon == pytest.approx(
        composed_epsilon("replace-one", [(p, r)], DELTA), rel=1e-9)


def test_a_round_that_is_not_poisson_sampled_is_never_charged_less_than_composition():
    """A record without batch_rate (a node that did not echo Poisson sampling) costs the unamplified Gaussian."""
    cfg = _cfg()
    plain = RoundRecord(round=1, algorithm="fedavg", step_sizes=(0.5,), clip_norm=1.0, sigma=0.05,
                        weights=(0.1,) * 10, clipping="per-sample", batch_size=40)
    acc = PrivacyAccountant(cfg)
    report = acc.step(plain)
    assert report.bounds[BATCH_SAMPLED_BOUND].epsilon >= report.bounds["composition"].epsilon - 2e-3
    assert report.certified.epsilon >= report.bounds["composition"].epsilon - 2e-3
    sampled = PrivacyAccountant(cfg).step(cfg.planned_round(1))
    assert sampled.certified.epsilon < report.certified.epsilon


def test_per_batch_clipping_or_final_model_is_refused_with_batch_rate_and_client_sampling_is_not():
    with pytest.raises(ValueError, match="per-sample"):
        _cfg(clipping="per-batch")
    with pytest.raises(ValueError, match="per-sample"):
        _cfg(clipping="per-batch", sampling_rate=0.5)
    # Poisson client sampling composes (docs/MATH.md §23.4, tests/privacy/test_batch_with_client_sampling.py)
    both = _cfg(sampling_rate=0.5, population=20)
    assert PrivacyAccountant(both).step(both.planned_round(1)).certified_bound == BATCH_SAMPLED_BOUND
    with pytest.raises(ValueError, match="all-rounds"):
        _cfg(threat_model="final-model", colluders=0)
    with pytest.raises(ValueError, match="batch_rate"):
        RoundRecord(round=1, algorithm="fedavg", step_sizes=(0.5,), clip_norm=1.0, sigma=0.05, weights=(1.0,),
                    clipping="per-sample", batch_size=4, batch_rate=1.5)


def test_per_batch_round_with_a_rate_is_not_amplified():
    """round_pair itself never amplifies a per-batch clipped round, whatever rate it carries."""
    record = RoundRecord(round=1, algorithm="fedavg", step_sizes=(0.5,), clip_norm=1.0, sigma=0.05,
                         weights=(0.5, 0.5), clipping="per-batch", batch_size=4, batch_rate=0.1)
    terms = round_terms(record, 1.0, 1)
    p, r = round_pair(record, terms, "all-rounds")
    assert p == 1.0 and 2 * r >= terms.gamma / terms.target_noise_std


def test_curious_server_amplifies_local_dp_with_the_sites_own_noise():
    cfg = _cfg(threat_model="curious-server")
    acc = PrivacyAccountant(cfg)
    acc.extend(cfg.planned_round(t) for t in range(1, 11))
    report = acc.report()
    z = cfg.sigma * cfg.batch_size / (cfg.lr * cfg.clip_norm)  # the upload's noise over one sample's shift
    assert report.certified_bound == BATCH_SAMPLED_BOUND
    assert report.certified.epsilon == pytest.approx(_pld_accountant_epsilon("replace-one", 0.1, z, 10), rel=2e-3)
    assert report.certified.epsilon < report.bounds["local_dp"].epsilon


def test_peek_and_replay_agree_with_step():
    cfg = _cfg()
    acc = PrivacyAccountant(cfg)
    for t in range(1, 4):
        peeked = acc.peek(cfg.planned_round(t))
        stepped = acc.step(cfg.planned_round(t))
        assert peeked.certified.epsilon == stepped.certified.epsilon
    replayed = PrivacyAccountant.from_records(cfg, acc.records)
    assert replayed.report().to_dict() == acc.report().to_dict()
    assert acc.get_delta(acc.report().certified.epsilon) == pytest.approx(DELTA, rel=0.05)
    assert RoundRecord.from_dict(acc.records[0].to_dict()).batch_rate == 0.1


def test_planning_replays_and_calibrates_the_amplified_bound():
    from fl_dp_flower.privacy.planning import calibrate, plan

    cfg = _cfg()
    planned = plan(cfg, 5)
    acc = PrivacyAccountant(cfg)
    acc.extend(cfg.planned_round(t) for t in range(1, 6))
    assert planned.certified_bound == BATCH_SAMPLED_BOUND
    assert planned.certified.epsilon == acc.report().certified.epsilon
    cal = calibrate(cfg, 5, 1.0)
    assert cal.bound == BATCH_SAMPLED_BOUND and 0.99 <= cal.epsilon <= 1.0


def test_the_real_one_dimensional_mechanism_never_exceeds_the_bound():
    """A site of n = 4 samples with 1-D gradients, B = 2 (q = 1/2), K = 1, alone (m = 1, curious server):
    the upload eta-step plus N(0, sigma^2) is an exact mixture over the 2^4 Poisson draws. Its hockey-stick
    divergence between neighbours (the differing gradient +V against -V, and against a removed sample) at
    the accountant's epsilon never exceeds the accountant's delta."""
    from itertools import product

    n, B, V, eta, sigma = 4, 2, 1.0, 1.0, 1.2
    q = B / n
    others = [0.7, -0.4, 1.0]

    def upload_pdf(target_grad):
        comps = []
        for draw in product((0, 1), repeat=n):
            grads = [g for g, d in zip([*others, target_grad], draw) if d and g is not None]
            step = max(-V, min(V, sum(grads) / B))  # the outer clip
            weight = math.prod(q if d else 1 - q for d in draw)
            comps.append((weight, -eta * step))
        w, mu = np.array(comps).T
        return np.exp(-0.5 * ((grid[:, None] - mu) / sigma) ** 2) @ w / (sigma * math.sqrt(2 * math.pi))

    grid = np.linspace(-9.0, 9.0, 180_001)

    def hockey(p, r, eps):  # both directions, trapezoid on a fine grid (smooth integrands but for one kink)
        return max(float(np.trapezoid(np.maximum(a - math.exp(eps) * b, 0.0), grid)) for a, b in ((p, r), (r, p)))

    cfg = AccountantConfig(algorithm="fedavg", schedule="constant", lr=eta, local_steps=1, clip_norm=V, clients=1,
                           sigma=sigma, clipping="per-sample", batch_size=B, batch_rate=q, colluders=0,
                           threat_model="curious-server")
    report = PrivacyAccountant(cfg).step(cfg.planned_round(1))
    plus, minus, removed = upload_pdf(V), upload_pdf(-V), upload_pdf(None)
    eps = report.certified.epsilon
    assert hockey(plus, minus, eps) <= DELTA
    assert hockey(plus, removed, report.add_remove["epsilon"]) <= DELTA
    assert hockey(plus, minus, 0.5 * eps) > DELTA  # the bound is not vacuous: half its epsilon fails


def test_the_steps_of_the_antipodal_proof_numerically():
    """docs/MATH.md §23.1a: for shifts of norm r the 2-D replace-one divergence is non-increasing in the
    correlation cos(angle) (step 2), and shifts shorter than r are dominated by the antipodal pair (step 1)."""
    q, r, eps = 0.2, 1.5, 0.5

    def divergence(v, w):
        def pdf(x, y, m):
            return (1 - q) * stats.norm.pdf(x) * stats.norm.pdf(y) + q * stats.norm.pdf(x - m[0]) * stats.norm.pdf(y - m[1])
        return _grid_integral(lambda x, y: np.maximum(pdf(x, y, v) - math.exp(eps) * pdf(x, y, w), 0.0), -10, 10, 801)

    def at(angle_deg, s=r, t=r):
        a = math.radians(angle_deg)
        return divergence(np.array([s, 0.0]), np.array([t * math.cos(a), t * math.sin(a)]))

    by_angle = [at(a) for a in (30, 90, 150, 180)]  # correlation 0.87, 0, -0.87, -1
    assert all(x <= y * (1 + 1e-6) for x, y in zip(by_angle, by_angle[1:]))
    antipodal = _hockey_stick_1d(_mixture(q, 1, r), _mixture(q, -1, r), eps)
    assert by_angle[-1] == pytest.approx(antipodal, rel=1e-3)
    assert max(at(180, 0.7 * r, r), at(180, r, 0.4 * r), at(120, 0.5 * r, 0.9 * r)) <= antipodal

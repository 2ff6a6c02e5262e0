"""Poisson batches on the nodes together with Poisson client sampling (docs/MATH.md §23.4): every round is
charged the batch-sampled pair at its own contributor count k_t, nothing claimed for the client sampling.
Pinned to dp-accounting's PLD accountant driven through its DpEvent API with each round's z_t built by hand,
to the fixed-denominator aggregate itself (the denominator q N cancels in the pair), and to the sound rule
(fewer contributors cost more; k_t <= c is the target's own noise)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, MetricRecord

from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.planning import calibrate_sigma, plan
from fl_dp_flower.privacy.records import AccountantConfig, RoundRecord
from fl_dp_flower.privacy.sample_sampling import BATCH_SAMPLED_BOUND, NO_CLIENT_CREDIT, round_pair
from fl_dp_flower.privacy.terms import round_terms

DELTA = 1e-5
SIGMA, LR, V, B, Q_B = 0.05, 0.5, 1.0, 40, 0.1
KS = (10, 6, 13, 1, 0, 8, 2, 11, 9, 10, 7, 12)  # realized contributions per round (0: nobody entered)


def _cfg(**kw):
    base = dict(algorithm="fedavg", schedule="constant", lr=LR, local_steps=1, clip_norm=V, clients=10, sigma=SIGMA,
                clipping="per-sample", batch_size=B, batch_rate=Q_B, colluders=1, threat_model="all-rounds",
                sampling_rate=0.5, population=20)
    base.update(kw)
    return AccountantConfig(**base)


def _record(t, k, population=20, rate=Q_B):
    return RoundRecord(round=t, algorithm="fedavg", step_sizes=(LR,), clip_norm=V, sigma=SIGMA,
                       weights=(1.0 / k,) * k if k else (), clipping="per-sample", batch_size=B,
                       population=population, sampled=max(k, 0), batch_rate=rate)


def _z(k, colluders):
    """The round's noise multiplier by hand: sigma sqrt(max(k - c, 1)) B / (eta V)."""
    return SIGMA * math.sqrt(max(k - colluders, 1)) * B / (LR * V)


def _pld_accountant_epsilon(relation, ks, colluders):
    import dp_accounting
    from dp_accounting.pld import pld_privacy_accountant

    rel = dp_accounting.NeighboringRelation
    acc = pld_privacy_accountant.PLDAccountant(rel.REPLACE_ONE if relation == "replace-one" else rel.ADD_OR_REMOVE_ONE,
                                               value_discretization_interval=1e-4)
    for k in ks:
        if k:  # a round nothing entered releases the old model: no event
            acc.compose(dp_accounting.PoissonSampledDpEvent(Q_B, dp_accounting.GaussianDpEvent(_z(k, colluders))))
    return acc.get_epsilon(DELTA)


@pytest.mark.parametrize("colluders", [0, 1])
def test_each_round_is_dp_accountings_poisson_sampled_gaussian_at_its_own_count(colluders):
    cfg = _cfg(colluders=colluders)
    acc = PrivacyAccountant(cfg)
    acc.extend(_record(t, k) for t, k in enumerate(KS, start=1))
    report = acc.report()
    assert report.certified_bound == BATCH_SAMPLED_BOUND
    assert report.certified.epsilon == pytest.approx(_pld_accountant_epsilon("replace-one", KS, colluders), rel=2e-3)
    assert report.add_remove["bound"] == BATCH_SAMPLED_BOUND
    assert report.add_remove["epsilon"] == pytest.approx(_pld_accountant_epsilon("add/remove-one", KS, colluders),
                                                         rel=2e-3)
    # the client-level bounds are there and sound too; the certified one is the smallest of them
    for name in ("composition", "sampled"):
        assert report.bounds[name].sound and report.bounds[name].epsilon > report.certified.epsilon
    # charged at the realized counts, not the planned q N = 10 in every round (round 4 has k = 1)
    planned = PrivacyAccountant(cfg)
    planned.extend(cfg.planned_round(t) for t in range(1, len(KS) + 1))
    assert report.certified.epsilon > planned.report().certified.epsilon
    assumes = report.certified.assumes[-1]
    assert "honest node" in assumes and NO_CLIENT_CREDIT in assumes
    assert report.batch_sampling["assumes"] == assumes


def test_fewer_contributors_cost_more_and_k_at_most_c_is_the_targets_own_noise():
    cfg = _cfg(colluders=2)
    shifts = []
    for k in range(1, 12):
        record = _record(1, k)
        p, r = round_pair(record, round_terms(record, cfg.smoothness, cfg.colluders), "all-rounds")
        assert p == Q_B
        assert r == pytest.approx(1.0 / _z(k, cfg.colluders), rel=1e-12)
        shifts.append(r)
    own = LR * V / B / SIGMA  # k <= c: only the target's own noise hides its shift
    assert shifts[0] == pytest.approx(own) and shifts[1] == pytest.approx(own) and shifts[2] == pytest.approx(own)
    assert all(a > b for a, b in zip(shifts[2:], shifts[3:]))
    eps = [PrivacyAccountant(cfg).step(_record(1, k)).bounds[BATCH_SAMPLED_BOUND].epsilon for k in (2, 4, 8)]
    assert eps[0] > eps[1] > eps[2]
    # curious server: the server knows the sample, sees each upload; the count does not enter
    cs = _cfg(threat_model="curious-server", colluders=1)
    for k in (1, 5, 9):
        p, r = round_pair(_record(1, k), round_terms(_record(1, k), 1.0, 1), "curious-server")
        assert p == Q_B and r == pytest.approx(own, rel=1e-12)
    assert PrivacyAccountant(cs).step(_record(1, 5)).certified_bound in ("local_dp", BATCH_SAMPLED_BOUND)


def test_the_fixed_denominator_cancels_in_the_pair():
    """The strategy's aggregate w + sum(u_i - w)/(q N): one sample moves it by at most (eta V/B)/(q N), its noise std
    is sigma sqrt(k - c)/(q N) once c uploads are subtracted; their ratio is round_pair's r_t whatever q N is."""
    from fl_dp_flower.strategies.replies import Usable
    from fl_dp_flower.strategies.sampling import fixed_denominator_sum

    k, c = 5, 1
    w = np.zeros(3, dtype=np.float64)
    rng = np.random.default_rng(0)
    uploads = [w + rng.normal(size=3) for _ in range(k)]
    step = np.array([LR * V / B, 0.0, 0.0])  # the target sample's largest add/remove move of its client's upload

    def aggregate(ups, denominator):
        usable = [Usable(node_id=i, arrays=ArrayRecord({"w": Array(u)}), metrics=MetricRecord({}), applied=None,  # type: ignore[arg-type]
                         num_examples=1, members=(i,)) for i, u in enumerate(ups)]
        return fixed_denominator_sum(usable, ArrayRecord({"w": Array(w)}), denominator)["w"].numpy()

    record = _record(1, k)
    _, r = round_pair(record, round_terms(record, 1.0, c), "all-rounds")
    for denominator in (0.3 * 20, 0.5 * 20, 7.0):
        moved = aggregate([uploads[0] + step, *uploads[1:]], denominator) - aggregate(uploads, denominator)
        noise_std = SIGMA * math.sqrt(k - c) / denominator  # k - c independent N(0, sigma^2) uploads, summed, scaled
        assert np.linalg.norm(moved) / noise_std == pytest.approx(r, rel=1e-9)


def test_the_refused_combination_now_plans_and_calibrates():
    cfg = _cfg()
    p = plan(cfg, 30)
    assert p.certified_bound == BATCH_SAMPLED_BOUND
    assert p.bounds[BATCH_SAMPLED_BOUND].epsilon < p.bounds["sampled"].epsilon
    cal = calibrate_sigma(cfg, 30, 1.0)
    assert cal.report.certified.epsilon <= 1.0
    assert cal.report.certified_bound == BATCH_SAMPLED_BOUND
    # the client-level bounds alone would be far above the target at that sigma
    assert cal.report.bounds["sampled"].epsilon > 3.0
    for bad, text in (({"clipping": "per-batch"}, "per-sample"),
                      ({"threat_model": "final-model", "colluders": 0}, "client sampling|all-rounds"),
                      ({"threat_model": "secure-aggregation"}, "secure-aggregation")):
        with pytest.raises(ValueError, match=text):
            _cfg(**bad)

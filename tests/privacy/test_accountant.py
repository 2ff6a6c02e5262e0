"""The stateful accountant against closed forms, docs/MATH.md §14.3's worked examples and dp-accounting."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from fl_dp_flower.privacy import AccountantConfig, Budget, PrivacyAccountant, RoundRecord
from fl_dp_flower.privacy.schedules import step_sizes


def _record(t: int, *, m: int, schedule="stage", lr=0.1, K=5, sigma=1.0, V=1.0, weights=None,
            algorithm="fedavg", prox_alpha=None) -> RoundRecord:
    """Round t (0-based) as it ran: m replies, uniform weights unless given."""
    return RoundRecord(
        round=t + 1, algorithm=algorithm, step_sizes=step_sizes(schedule, lr, t, K), clip_norm=V,
        sigma=sigma, weights=tuple(weights) if weights else tuple([1.0 / m] * m), prox_alpha=prox_alpha,
    )


def _config(**kw) -> AccountantConfig:
    # colluders=0: the reference numbers are for an outside observer (docs/MATH.md §14 tables); the
    # participant's view (c >= 1, docs/MATH.md §14.2a) has its own tests
    base = dict(schedule="stage", lr=0.1, local_steps=5, clip_norm=1.0, clients=20, sigma=1.0, smoothness=1.0,
                colluders=0)
    base.update(kw)
    return AccountantConfig(**base)


def test_homogeneous_constant_composition_matches_closed_form():
    cfg = _config(schedule="constant", clients=20)
    acct = PrivacyAccountant.from_records(cfg, (_record(t, m=20, schedule="constant") for t in range(1000)))
    gamma = 2 * 0.1 * 1.0 * 5 / 20
    expected = math.sqrt(1000) * math.sqrt(20) * gamma / 1.0
    report = acct.report()
    assert report.bounds["composition"].mu == pytest.approx(expected, rel=1e-12)
    # Constant schedule: the feasible final-model optimum is exactly composition (docs/MATH.md §7.2).
    assert report.bounds["final_model"].mu == pytest.approx(expected, rel=1e-9)
    # docs/MATH.md §8.2 example: mu_comp 7.07 -> epsilon 54.4 at delta 1e-5; paper 0.462 (unsound).
    assert report.bounds["composition"].epsilon == pytest.approx(54.4, rel=2e-3)
    assert report.bounds["paper"].mu == pytest.approx(0.4624, abs=1e-4)
    assert report.bounds["paper"].sound is False
    # Local DP = sqrt(m) * composition for homogeneous rounds.
    assert report.bounds["local_dp"].mu == pytest.approx(math.sqrt(20) * expected, rel=1e-12)


def test_dropouts_spec_example():
    # docs/MATH.md §14.3: constant lr=0.1, K=5, V=L=sigma=1, m_t = 20,15,20,8,20,20,12.
    cfg = _config(schedule="constant")
    ms = [20, 15, 20, 8, 20, 20, 12]
    acct = PrivacyAccountant.from_records(cfg, (_record(t, m=m, schedule="constant") for t, m in enumerate(ms)))
    report = acct.report()
    assert report.bounds["composition"].mu == pytest.approx(0.68920, abs=5e-6)
    assert report.bounds["final_model"].mu == pytest.approx(0.68920, abs=5e-6)
    assert report.clients == 12


def test_changing_sigma_spec_example():
    # docs/MATH.md §14.3: stage-wise lr=0.02, K=5, m=10, T=8, sigma=0.5 for t<3 then 4.
    cfg = _config(lr=0.02, clients=10, sigma=0.5, threat_model="final-model", assume_smooth_losses=True)
    records = [_record(t, m=10, lr=0.02, sigma=0.5 if t < 3 else 4.0) for t in range(8)]
    acct = PrivacyAccountant.from_records(cfg, records)
    report = acct.report()
    assert report.bounds["composition"].mu == pytest.approx(0.14771, abs=5e-6)
    assert report.bounds["final_model"].mu == pytest.approx(0.020691, abs=5e-7)
    assert report.certified_bound == "final_model"
    # sigma differs from the plan, so the paper's closed form is not a guarantee here.
    assert report.bounds["paper"].sound is False


def test_replay_of_many_heterogeneous_rounds_equals_the_array_bounds():
    """docs/MATH.md §14.3's dropout example, replayed record by record through the accountant,
    equals the array computation whose reference values tests/privacy/test_bounds.py pins."""
    import numpy as np

    from fl_dp_flower.privacy.bounds import composition_mu
    from fl_dp_flower.privacy.final_model import final_model_mu

    T = 20_000
    cfg = _config()
    acct = PrivacyAccountant.from_records(cfg, (_record(t, m=20 - (t % 7)) for t in range(T)))
    t = np.arange(T)
    m = 20 - (t % 7)
    gamma, s, log_rho = 1.0 / ((t + 1) * m), 1 / np.sqrt(m), 5 * np.log1p(0.1 / (t + 1))
    mus = acct.report().bounds
    assert mus["composition"].mu == pytest.approx(composition_mu(gamma, s), rel=1e-12)
    assert mus["final_model"].mu == pytest.approx(final_model_mu(log_rho, gamma, s), rel=1e-12)


def test_iterative_record_based_terms_spec_example():
    """docs/MATH.md §14.3's iterative example through the accountant equals the record-term bounds
    (whose reference values tests/privacy/test_bounds.py pins)."""
    from fl_dp_flower.privacy.bounds import composition_mu
    from fl_dp_flower.privacy.final_model import final_model_mu
    from fl_dp_flower.privacy.terms import round_terms

    cfg = _config(schedule="iterative", threat_model="final-model", assume_smooth_losses=True)
    records = [_record(t, m=20, schedule="iterative") for t in range(1000)]
    acct = PrivacyAccountant.from_records(cfg, records)
    terms = [round_terms(r, 1.0) for r in records]
    g, s = [x.gamma for x in terms], [x.noise_std for x in terms]
    report = acct.report()
    assert report.bounds["composition"].mu == pytest.approx(composition_mu(g, s), rel=1e-12)
    assert report.bounds["final_model"].mu == pytest.approx(final_model_mu([x.log_rho for x in terms], g, s), rel=1e-12)
    # Homogeneous rounds as planned: the paper's ID bound is sound, but larger (Table 2 terms).
    assert report.bounds["paper"].sound is True
    assert report.bounds["paper"].mu > report.bounds["composition"].mu
    assert report.certified.mu == report.bounds["final_model"].mu


def test_threat_models_pick_their_bound():
    records = [_record(t, m=20) for t in range(50)]
    reports = {
        tm: PrivacyAccountant.from_records(_config(threat_model=tm, assume_smooth_losses=True), records).report()
        for tm in ("all-rounds", "final-model", "curious-server")
    }
    # Without the operator's L-smoothness assertion the final-model bound (it rests on L) does not
    # certify: the clipping-only composition does, though final_model is smaller (issue 16 item 4).
    unasserted = PrivacyAccountant.from_records(_config(threat_model="final-model"), records).report()
    assert unasserted.bounds["final_model"].mu < unasserted.bounds["composition"].mu
    assert unasserted.certified_bound == "composition"
    assert unasserted.bounds["final_model"].assumes == ("L-smooth losses (L = 1)",)
    assert unasserted.bounds["composition"].assumes == ()
    assert reports["all-rounds"].certified_bound == "composition"
    assert reports["curious-server"].certified_bound == "local_dp"
    # outside the final-model threat model (which refuses server post-processing) the final-model bounds say they
    # describe the last noisy-GD iterate: a run may release an EMA or take server-optimizer steps (review P31A)
    from fl_dp_flower.privacy.bounds import FINAL_ITERATE_ASSUMPTION
    for tm in ("all-rounds", "curious-server"):
        for name in ("final_model", "paper"):
            assert reports[tm].bounds[name].assumes == ("L-smooth losses (L = 1)", FINAL_ITERATE_ASSUMPTION)
        assert FINAL_ITERATE_ASSUMPTION not in reports[tm].bounds["composition"].assumes
    assert FINAL_ITERATE_ASSUMPTION not in reports["final-model"].bounds["final_model"].assumes
    final = reports["final-model"]
    assert final.certified.mu == min(final.bounds[n].mu for n in ("composition", "final_model"))
    # docs/MATH.md §14.3 homogeneous stage-wise T=50: composition 0.28506, final model 0.23346.
    assert final.bounds["composition"].mu == pytest.approx(0.28506, abs=5e-6)
    assert final.bounds["final_model"].mu == pytest.approx(0.23346, abs=5e-6)


def test_composition_epsilon_matches_dp_accounting_pld():
    """Heterogeneous rounds: our certified epsilon vs dp-accounting's PLD of Gaussian rounds."""
    dp_accounting = pytest.importorskip("dp_accounting")
    from dp_accounting.pld import pld_privacy_accountant

    cfg = _config(schedule="constant", clients=20, sigma=2.0)
    ms = [20, 15, 20, 8, 20]
    records = [_record(t, m=m, schedule="constant", sigma=2.0) for t, m in enumerate(ms)]
    acct = PrivacyAccountant.from_records(cfg, records)
    pld = pld_privacy_accountant.PLDAccountant(value_discretization_interval=1e-4)
    for m in ms:
        gamma = 2 * 0.1 * 5 / m                     # sensitivity of the aggregate
        s = 2.0 / math.sqrt(m)                        # std of the aggregate noise
        pld.compose(dp_accounting.GaussianDpEvent(noise_multiplier=s / gamma))
    ours = acct.get_epsilon(1e-5)
    assert ours == pytest.approx(pld.get_epsilon(1e-5), rel=1e-3)


def test_would_exceed_is_a_dry_run():
    cfg = _config(schedule="constant")
    acct = PrivacyAccountant.from_records(cfg, [_record(t, m=20, schedule="constant") for t in range(3)])
    before = (acct.records, acct.report().to_dict())
    nxt = _record(3, m=20, schedule="constant")
    eps_after = PrivacyAccountant.from_records(cfg, [*acct.records, nxt]).get_epsilon(1e-5)
    assert acct.would_exceed(nxt, Budget(epsilon=eps_after * 0.99, delta=1e-5)) is True
    assert acct.would_exceed(nxt, Budget(epsilon=eps_after * 1.01, delta=1e-5)) is False
    assert (acct.records, acct.report().to_dict()) == before


def test_persisted_records_round_trip_and_typed_rejections():
    """The ledger's form (config + records as JSON) rebuilds the same accountant; bad fields are named."""
    cfg = _config(schedule="cyclic")
    acct = PrivacyAccountant.from_records(cfg, [_record(t, m=m, schedule="cyclic") for t, m in enumerate([20, 9, 14])])
    stored = json.loads(json.dumps({"config": cfg.to_dict(), "records": [r.to_dict() for r in acct.records]}))
    rebuilt = PrivacyAccountant.from_records(AccountantConfig.from_dict(stored["config"]),
                                             [RoundRecord.from_dict(r) for r in stored["records"]])
    assert rebuilt.records == acct.records and rebuilt.report().to_dict() == acct.report().to_dict()

    rec = stored["records"][0]
    with pytest.raises(ValueError, match=r"round record has unknown field\(s\) \['sgima'\]"):
        RoundRecord.from_dict({**rec, "sgima": 1.0})
    with pytest.raises(ValueError, match=r"round record lacks required field\(s\) \['sigma'\]"):
        RoundRecord.from_dict({k: v for k, v in rec.items() if k != "sigma"})
    with pytest.raises(ValueError, match="sigma must be a number > 0, got .1.0."):
        RoundRecord.from_dict({**rec, "sigma": "1.0"})
    with pytest.raises(ValueError, match="field 'weights' must be a list"):
        RoundRecord.from_dict({**rec, "weights": 1.0})
    with pytest.raises(ValueError, match="must be a JSON object"):
        RoundRecord.from_dict([rec])
    with pytest.raises(ValueError, match=r"accountant config has unknown field\(s\) \['epsilon'\]"):
        AccountantConfig.from_dict({**stored["config"], "epsilon": 1.0})


def test_rounds_must_arrive_in_order_and_match_algorithm():
    cfg = _config(schedule="constant")
    acct = PrivacyAccountant(cfg)
    acct.step(_record(0, m=20, schedule="constant"))
    with pytest.raises(ValueError, match="record.round must be 2"):
        acct.step(_record(2, m=20, schedule="constant"))
    with pytest.raises(ValueError, match="algorithm"):
        acct.step(_record(1, m=20, schedule="constant", algorithm="fedprox", prox_alpha=2.0))
    assert acct.num_releases == 1


def test_report_dict_shape_and_rdp():
    acct = PrivacyAccountant.from_records(_config(), [_record(t, m=20) for t in range(5)])
    d = acct.report().to_dict()
    assert set(d["bounds"]) == {"paper", "composition", "final_model", "local_dp"}
    assert d["certified"]["bound"] == "composition"
    mu = d["certified"]["mu"]
    assert d["rdp"]["values"] == [pytest.approx(a * mu * mu / 2) for a in d["rdp"]["orders"]]
    # RDP-derived epsilon is looser than the exact GDP epsilon (docs/MATH.md §9.4).
    assert d["rdp"]["epsilon"] >= d["certified"]["epsilon"]
    spent = acct.get_privacy_spent()
    assert spent.num_releases == 5 and spent.epsilon == pytest.approx(d["certified"]["epsilon"])


@pytest.mark.parametrize("schedule,threat", [("stage", "final-model"), ("iterative", "final-model"),
                                             ("constant", "all-rounds"), ("cyclic", "curious-server")])
def test_peek_is_exactly_the_next_step_and_changes_nothing(schedule, threat):
    """The O(1) dry run (no copy of the accountant) equals a real step bit for bit, on rounds that
    drop clients, change sigma and merge PAVA blocks."""
    import copy
    import random

    rng = random.Random(7)
    cfg = _config(schedule=schedule, threat_model=threat)
    acct = PrivacyAccountant(cfg)
    for t in range(60):
        m = rng.choice([20, 20, 20, 7, 13])
        rec = _record(t, m=m, schedule=schedule, sigma=rng.choice([1.0, 1.0, 0.5, 3.0]))
        reference = copy.deepcopy(acct).step(rec).to_dict()
        before = (acct.records, acct.report().to_dict())
        assert acct.peek(rec).to_dict() == reference
        assert (acct.records, acct.report().to_dict()) == before
        eps = reference["certified"]["epsilon"]
        assert acct.would_exceed(rec, Budget(epsilon=eps * (1 - 1e-9), delta=1e-5))
        assert not acct.would_exceed(rec, Budget(epsilon=eps * (1 + 1e-9), delta=1e-5))
        assert acct.step(rec).to_dict() == reference


# ---------------------------------------------------------------- rounds never applied (docs/MATH.md §14.3a)


def _linear_canary_mu(gammas: list[float], noise_stds: list[float]) -> float:
    """Exact GDP of the linear canary's released model (docs/MATH.md §7.3): rho = 1, the two runs
    differ by exactly gamma_t per applied round, so w_T - w'_T ~ N(sum gamma_t, sum s_t^2)."""
    return math.fsum(gammas) / math.sqrt(math.fsum(s * s for s in noise_stds))


def test_rounds_never_applied_do_not_lower_the_final_model_bound():
    """Issue 16 item 1: 10 applied + 990 under-quorum rounds (19 of 20 replies, model kept).
    The old rule put them in the PAVA: certified eps 0.364 for a model whose exact eps is 0.754."""
    from fl_dp_flower.privacy import gdp

    cfg = _config(lr=0.05, sigma=0.5, threat_model="final-model", assume_smooth_losses=True)  # m 20, K 5, stage, L 1
    released = PrivacyAccountant(cfg)
    for t in range(1, 11):
        released.step(cfg.planned_round(t))
    acct = PrivacyAccountant.from_records(cfg, released.records)
    for t in range(11, 1001):
        report = acct.step(dataclasses.replace(_record(t - 1, m=19, lr=0.05, sigma=0.5), applied=False))
    m, sigma = 20, 0.5
    gammas = [2 * 0.05 * 1.0 * 5 / m / (t + 1) for t in range(10)]  # Table 2 SD, t = 0..9
    exact = gdp.epsilon(_linear_canary_mu(gammas, [sigma / math.sqrt(m)] * 10), 1e-5)
    assert exact == pytest.approx(0.7538, abs=1e-4)
    assert report.certified.epsilon >= exact
    assert report.rounds == 1000 and report.to_dict()["rounds_applied"] == 10
    assert report.bounds["final_model"].mu == released.report().bounds["final_model"].mu  # rounds 11.. left out
    assert report.bounds["composition"].mu > released.report().bounds["composition"].mu  # charged there
    # the old rule (every accounted round in the PAVA) certifies below the exact value
    old = PrivacyAccountant.from_records(cfg, [*released.records, *(_record(t - 1, m=19, lr=0.05, sigma=0.5)
                                                                   for t in range(11, 1001))])
    assert old.report().certified.epsilon == pytest.approx(0.3635, abs=1e-3)
    assert old.report().certified.epsilon < exact


def test_peek_and_budget_honour_applied():
    cfg = _config(threat_model="final-model")
    acct = PrivacyAccountant(cfg)
    for t in range(1, 4):
        acct.step(cfg.planned_round(t))
    unapplied = cfg.planned_round(4, applied=False)
    peeked = acct.peek(unapplied)
    assert peeked.to_dict() == acct.step(unapplied).to_dict()
    assert peeked.bounds["final_model"].mu == PrivacyAccountant.from_records(cfg, acct.records[:3]).report(
    ).bounds["final_model"].mu


# ---------------------------------------------------------------- colluding participants (docs/MATH.md §14.2a)


@pytest.mark.parametrize("m,c", [(20, 0), (20, 1), (20, 5), (3, 2), (3, 3), (3, 7), (1, 1)])
def test_colluders_noise_is_that_of_the_clients_outside_the_coalition(m, c):
    """Uniform weights: round t is a Gaussian mechanism with sensitivity Gamma_t/m against
    sigma*sqrt(m - c)/m, i.e. mu_t = Gamma_t/(sigma*sqrt(m - c)); m <= c is local DP."""
    sigma, T = 0.7, 6
    cfg = _config(clients=m, sigma=sigma, colluders=c)
    acct = PrivacyAccountant(cfg)
    for t in range(1, T + 1):
        acct.step(cfg.planned_round(t))
    client = [2 * 0.1 * 1.0 * 5 / (t + 1) for t in range(T)]  # Gamma_t, stage, lr 0.1, K 5, V 1
    hidden = max(m - c, 1)  # with m <= c only the target's own noise is left
    expected = math.sqrt(math.fsum((g / (sigma * math.sqrt(hidden))) ** 2 for g in client))
    report = acct.report()
    assert report.bounds["composition"].mu == pytest.approx(expected, rel=1e-12)
    local = math.sqrt(math.fsum((g / sigma) ** 2 for g in client))
    assert report.bounds["local_dp"].mu == pytest.approx(local, rel=1e-12)
    if m <= c + 1:  # nobody outside the coalition but the target: local DP for every round
        assert report.bounds["composition"].mu == pytest.approx(local, rel=1e-12)
        assert report.bounds["final_model"].mu <= report.bounds["local_dp"].mu * (1 + 1e-12)


def test_two_client_federation_is_local_dp_against_the_other_participant():
    """2 clients, c = 1 (default): the other site subtracts its own upload and sees the target's
    with its own noise only (the deployment §2.6 case): every bound is at least local DP's round value."""
    cfg = AccountantConfig(schedule="constant", lr=0.1, local_steps=5, clients=2, sigma=1.0)
    assert cfg.colluders == 1
    acct = PrivacyAccountant(cfg)
    for t in range(1, 11):
        acct.step(cfg.planned_round(t))
    r = acct.report()
    assert r.bounds["composition"].mu == pytest.approx(r.bounds["local_dp"].mu, rel=1e-12)
    assert r.bounds["composition"].mu == pytest.approx(math.sqrt(10) * 2 * 0.1 * 5 / 1.0, rel=1e-12)
    outside = PrivacyAccountant.from_records(AccountantConfig(**{**cfg.to_dict(), "colluders": 0}), acct.records)
    assert outside.report().bounds["composition"].mu == pytest.approx(r.bounds["composition"].mu / math.sqrt(2))


@pytest.mark.parametrize("weights,c", [((0.5, 0.3, 0.1, 0.1), 1), ((0.6, 0.2, 0.2), 1), ((0.4, 0.3, 0.2, 0.1), 2),
                                       ((0.9, 0.05, 0.05), 1), ((0.25, 0.25, 0.25, 0.25), 3)])
def test_colluders_with_weights_against_every_coalition_and_target(weights, c):
    """Brute force over every target k and coalition C (|C| = min(c, m - 1), k not in C): the
    round's composition term is the worst ratio p_k Gamma / (sigma sqrt(sum_{j not in C} p_j^2)),
    and the final-model pair (gamma, s) dominates every (target, coalition)."""
    import itertools

    from fl_dp_flower.privacy.terms import round_terms

    sigma = 0.8
    rec = _record(0, m=len(weights), weights=weights, sigma=sigma)
    terms = round_terms(rec, 1.0, c)
    Gamma = terms.client_sensitivity
    worst, least_noise = 0.0, math.inf
    idx = range(len(weights))
    for k in idx:
        others = [j for j in idx if j != k]
        for C in itertools.combinations(others, min(c, len(weights) - 1)):
            noise = sigma * math.sqrt(sum(weights[j] ** 2 for j in idx if j not in C))
            worst = max(worst, weights[k] * Gamma / noise)
            least_noise = min(least_noise, noise)
    assert terms.gamma / terms.target_noise_std == pytest.approx(worst, rel=1e-12)
    assert terms.gamma / terms.target_noise_std <= Gamma / sigma * (1 + 1e-12)  # never worse than local DP
    assert terms.noise_std == pytest.approx(least_noise, rel=1e-12)
    assert terms.gamma == pytest.approx(max(weights) * Gamma, rel=1e-12)


@pytest.mark.parametrize("schedule", ["constant", "stage"])  # (ID: Table 2 terms differ from the exact ones)
@pytest.mark.parametrize("c", [0, 1, 4])
def test_planned_bounds_equal_the_accountant_with_colluders(schedule, c):
    from fl_dp_flower.privacy.planned_bounds import planned_bounds

    cfg = _config(schedule=schedule, clients=5, colluders=c)  # every bound is computed whatever certifies
    acct = PrivacyAccountant(cfg)
    for t in range(1, 31):
        acct.step(cfg.planned_round(t))
    planned = planned_bounds(cfg, 30)
    for name in ("composition", "final_model", "local_dp"):
        assert planned[name] == pytest.approx(acct.report().bounds[name].mu, rel=1e-9), name
    if schedule != "constant":
        assert acct.report().bounds["paper"].sound
        assert acct.report().bounds["paper"].mu >= acct.report().bounds["composition"].mu


def test_legacy_header_without_colluders_reads_as_an_outside_observer():
    d = _config().to_dict()
    del d["colluders"]
    assert AccountantConfig.from_dict(d).colluders == 0
    assert AccountantConfig().colluders == 1
    with pytest.raises(ValueError, match="colluders"):
        AccountantConfig(colluders=-1)


def test_zero_weight_clients_do_not_make_the_coalition_noise_zero():
    """Review of issue 16: weights (0, 1) with c = 1 gave s_min = 0 and the final-model push raised
    after composition had been added. A zero-weight client is no target: the least noise of the real
    target (weight 1) is its own sigma, and the round is local DP."""
    cfg = _config(clients=2, colluders=1)
    record = dataclasses.replace(cfg.planned_round(1), weights=(0.0, 1.0))
    assert record.hidden_noise_stds(1) == (cfg.sigma, cfg.sigma)
    report = PrivacyAccountant(cfg).step(record)
    terms = report.bounds["composition"].mu
    assert terms == pytest.approx(report.bounds["local_dp"].mu, rel=1e-12)

"""fl-dp-flower audit: the canary run, the attack's statistics, and the verdicts the issue pins.

References are independent of the code under test: the canary's final models are checked against
the closed-form Gaussian of docs/MATH.md §7.3 (mean gap 2 sum_t gamma_t, per-world variance
T sigma^2 / m), Clopper-Pearson against scipy's binomtest, and the lower bound on mu against
samples of known mu.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from scipy import stats

from fl_dp_flower.audit.attack import audit_attack, clopper_pearson
from fl_dp_flower.audit.canary import run_canary
from fl_dp_flower.audit.run import run_audit
from fl_dp_flower.app.cli import main
from fl_dp_flower.privacy.records import AccountantConfig


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    """The canary's tensors are small: on a loaded 2-core machine two intra-op threads contend and
    run about 6 times slower than one (the results do not depend on it)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# The configuration: m = 20, K = 5, lr = 0.05, sigma = 0.5, V = 1, L = 1, T = 100.
# colluders=0: the final-model canary attack is an outside observer's (noise sigma/sqrt(m)); the
# participant's view (c >= 1, docs/MATH.md §14.2a) only makes the printed bounds larger.
BASE = {"algorithm": "fedavg", "lr": 0.05, "local_steps": 5, "clip_norm": 1.0, "clients": 20, "sigma": 0.5,
        "smoothness": 1.0, "delta": 1e-5, "colluders": 0}
TRIALS = 20_000  # per world; 100,000 takes ~20 s (bench/audit.py)


#: an outside observer's bounds (colluders = 0), where the config has the field: the final-model and
#: all-rounds adversaries are outsiders, and the closed forms below count all m clients' noise
OUTSIDE = {"colluders": 0}


def _config(**kw) -> AccountantConfig:
    return AccountantConfig(**{**BASE, "schedule": "constant", **kw})


@pytest.mark.parametrize("overrides, step_sum", [
    ({"schedule": "constant"}, 0.05 * 5 * 100),
    ({"schedule": "stage"}, sum(0.05 * 5 / (t + 1) for t in range(100))),
    ({"schedule": "iterative"}, sum(0.05 / j for j in range(1, 501))),
    ({"schedule": "cyclic"}, 100 * sum(0.05 / (k + 1) for k in range(5))),
    ({"batch_size": 4, "clipping": "per-sample"}, 0.05 * 5 * 100 / 4),
])
def test_canary_final_models_follow_the_closed_form(overrides, step_sum):
    """w_T of world 1 minus world 0 has mean 2 V sum(eta)/m (per-sample: / B) and each world has
    variance T sigma^2 / m: the canary moves by exactly the largest per-round change."""
    run = run_canary(_config(**overrides), 100, 4000, 10, seed=3)
    e0, e1 = (w[:, 0] for w in run.evaluation)
    gap = 2 * 1.0 * step_sum / 20
    sd = math.sqrt(100 * 0.25 / 20)
    assert e1.mean() - e0.mean() == pytest.approx(gap, abs=5 * sd * math.sqrt(2 / 4000))
    for e in (e0, e1):
        assert e.std(ddof=1) == pytest.approx(sd, rel=0.05)


def test_fedprox_canary_gap_is_the_exact_fedprox_sensitivity():
    alpha, lr, k = 2.0, 0.05, 5
    run = run_canary(_config(algorithm="fedprox", prox_alpha=alpha), 50, 4000, 10, seed=4)
    e0, e1 = (w[:, 0] for w in run.evaluation)
    per_round = 2 * (1 - (1 - lr * alpha) ** k) / (20 * alpha)
    sd = math.sqrt(50 * 0.25 / 20)
    assert e1.mean() - e0.mean() == pytest.approx(50 * per_round, abs=5 * sd * math.sqrt(2 / 4000))


@pytest.mark.parametrize("k, n", [(0, 50), (3, 50), (50, 50), (417, 1000)])
def test_clopper_pearson_matches_scipy_exact_interval(k, n):
    ref = stats.binomtest(k, n).proportion_ci(confidence_level=0.95, method="exact")
    assert clopper_pearson(k, n, 0.95) == pytest.approx((ref.low, ref.high), abs=1e-12)


def test_mu_lower_bound_is_below_the_truth_and_close_to_it():
    rng = np.random.default_rng(11)
    mu, n = 1.5, 50_000

    def draw(shift: float) -> np.ndarray:
        return rng.normal(shift, 1.0, size=(n, 1))

    result = audit_attack((draw(0.0), draw(mu)), (draw(0.0), draw(mu)), delta=1e-5)
    assert 1.35 < result.mu_lower < mu
    assert result.mu_estimate == pytest.approx(mu, abs=0.05)
    # No difference at all: nothing is detected beyond the sampling error.
    null = audit_attack((draw(0.0), draw(0.05)), (draw(0.0), draw(0.0)), delta=1e-5)
    assert null.mu_lower < 0.05 and null.epsilon_lower < 0.1


def test_constant_schedule_violates_the_paper_bound_and_not_the_sound_ones():
    report = run_audit(_config(schedule="constant", **OUTSIDE), 100, trials=TRIALS, seed=0)
    verdict = {v.bound: v for v in report.verdicts}
    assert verdict["paper"].violated and not verdict["paper"].sound
    for name in ("composition", "final_model", "local_dp", "certified"):
        assert not verdict[name].violated, name
    # The canary is tight for composition: the attack comes within 5 % of it.
    assert report.attack.mu_lower > 0.95 * verdict["composition"].mu > verdict["paper"].mu
    at_1pct = next(o for o in report.attack.operating if o.target_fpr == 0.01)
    assert at_1pct.tpr_interval[0] <= at_1pct.tpr <= at_1pct.tpr_interval[1]


def test_stage_schedule_violates_nothing():
    report = run_audit(_config(schedule="stage"), 100, trials=TRIALS, seed=0)
    assert not any(v.violated for v in report.verdicts)
    assert report.attack.mu_lower < min(v.mu for v in report.verdicts)


def test_cli_audit_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "audit.png"
    code = main(["audit", "--schedule", "constant", "--clients", "20", "--local-steps", "5", "--lr", "0.05",
                 "--sigma", "0.5", "--rounds", "20", "--trials", "2000", "--json", "--plot", str(plot)])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert {v["bound"] for v in out["verdicts"]} == {"paper", "composition", "final_model", "local_dp", "certified"}
    assert out["trials_per_world"] == 2000 and len(out["operating_points"]) == 6
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("argv, named", [
    (["--trials", "5"], "--trials"),
    (["--confidence", "1.5"], "--confidence"),
    (["--algorithm", "fedprox", "--prox-alpha", "0"], "--prox-alpha"),  # alpha <= L alone is allowed (issue 30)
])
def test_cli_audit_rejects_bad_input_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["audit", "--sigma", "0.5", *argv])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


# ------------------------------------------------------------------ all-rounds, participant, kink (issue 16 item 8)


from fl_dp_flower.privacy import bounds as privacy_bounds  # noqa: E402 (the section's own imports)
from fl_dp_flower.privacy import terms  # noqa: E402 (the section's own imports)
from fl_dp_flower.privacy.schedules import step_sizes  # noqa: E402 (the section's own imports)

SMALL_TRIALS = 5000


def _exact_linear_all_rounds_mu(config: AccountantConfig, rounds: int, noise_std: float) -> float:
    """The linear canary's exact all-rounds mu, from its definition: round t moves the mean of the
    aggregate by 2 V sum_k eta_{k,t} / m (per-sample: / B) against noise of std ``noise_std``, and the
    rounds are independent Gaussian mechanisms given the past, so mu = sqrt(sum_t (gap_t / s)^2)."""
    scale = 1.0 / config.batch_size if config.clipping == "per-sample" else 1.0
    gaps = [2 * config.clip_norm * scale * sum(step_sizes(config.schedule, config.lr, t, config.local_steps))
            / config.clients for t in range(rounds)]
    return math.sqrt(sum((g / noise_std) ** 2 for g in gaps))


@pytest.mark.parametrize("schedule, sigma", [("constant", 1.0), ("stage", 0.25)])
def test_all_rounds_attack_on_the_linear_canary_reaches_composition(schedule, sigma):
    """The exact likelihood-ratio test of every round's model reaches composition for every schedule
    (the final-model attack reaches it only where final model = composition): the linear canary is
    tight for composition, against this adversary."""
    config = _config(schedule=schedule, clients=5, sigma=sigma, **OUTSIDE)
    rounds = 40
    report = run_audit(config, rounds, adversary="all-rounds", trials=SMALL_TRIALS, seed=1)
    exact = _exact_linear_all_rounds_mu(config, rounds, config.sigma / math.sqrt(config.clients))
    composition = report.verdict("composition")
    assert exact == pytest.approx(composition.mu, rel=1e-9)  # composition is exactly tight here
    assert report.attack.mu_estimate == pytest.approx(exact, abs=0.08)
    assert exact - 0.25 < report.attack.mu_lower <= exact
    assert composition.outcome == "holds" and not report.package_bug
    assert {v.bound for v in report.verdicts if not v.applies} == {"paper", "final_model"}
    if schedule == "stage":  # below composition: only the final model is hidden that well
        final = run_audit(config, rounds, adversary="final-model", trials=SMALL_TRIALS, seed=1)
        assert final.attack.mu_lower < report.verdict("final_model").mu < report.attack.mu_lower


def test_all_rounds_statistic_of_the_linear_canary_is_the_sum_of_standardised_increments():
    """Linear canary, constant schedule: every round's mean gap is the same, so the log likelihood
    ratio of (w_1..w_T) is an affine function of w_T = sum of the increments (correlation 1)."""
    run = run_canary(_config(), 10, 500, 500, seed=5)
    assert np.corrcoef(run.all_rounds, run.final[:, 0])[0, 1] > 1 - 1e-9  # world 1 moves w up
    stage = run_canary(_config(schedule="stage"), 10, 500, 500, seed=5)
    assert np.corrcoef(stage.all_rounds, stage.final[:, 0])[0, 1] < 0.999  # weighted: not w_T alone


def _two_clients(**kw) -> AccountantConfig:
    # m = 2, T = 4: the other client's upload hides the canary's with sigma / 2, not sigma / sqrt(2)
    return _config(clients=2, sigma=1 / 3, **kw)


def _old_rule_composition(config: AccountantConfig, rounds: int) -> float:
    """Composition with the aggregate noise of all m clients, sigma sqrt(m)/m (the rule before issue 16 item 3)."""
    gammas = [terms.round_terms(config.planned_round(t + 1), 0.0).gamma for t in range(rounds)]
    return privacy_bounds.composition_mu(gammas, [config.sigma / math.sqrt(config.clients)] * rounds)


def test_participant_attack_flags_the_old_noise_rule_on_two_clients():
    """docs/audit.md §2: a participating client subtracts its own upload, so against it the canary's upload
    is hidden by sigma sqrt(m - 1)/m = sigma/2 of noise; the old rule counted sigma sqrt(m)/m."""
    config = _two_clients()
    rounds = 4
    report = run_audit(config, rounds, adversary="participant", trials=SMALL_TRIALS, seed=2)
    exact = _exact_linear_all_rounds_mu(config, rounds, config.sigma * math.sqrt(1) / 2)
    old = _old_rule_composition(config, rounds)
    assert exact == pytest.approx(math.sqrt(2) * old)
    assert report.attack.mu_estimate == pytest.approx(exact, abs=0.12)
    assert old < report.attack.mu_lower <= exact  # the old rule is flagged
    # the outside observer sees only sigma/sqrt(2): the old rule is tight for it and holds
    outside = run_audit(config, rounds, adversary="all-rounds", trials=SMALL_TRIALS, seed=2)
    assert outside.attack.mu_lower <= old
    assert outside.attack.mu_estimate == pytest.approx(old, abs=0.12)


def test_participant_attack_new_rule_holds_and_colluders_zero_is_flagged():
    rounds = 4
    report = run_audit(_two_clients(colluders=1), rounds, adversary="participant", trials=SMALL_TRIALS, seed=2)
    assert report.verdict("composition").mu == pytest.approx(
        _exact_linear_all_rounds_mu(_two_clients(), rounds, (1 / 3) / 2))
    assert report.verdict("composition").outcome == "holds" and not report.package_bug
    zero = run_audit(_two_clients(colluders=0), rounds, adversary="participant", trials=SMALL_TRIALS, seed=2)
    composition = zero.verdict("composition")
    assert composition.mu == pytest.approx(_old_rule_composition(_two_clients(), rounds))
    assert composition.violated and composition.outcome == "assumption violated"
    assert any("colluders = 0" in b for b in composition.broken)


# The kink instance of issue 16 item 2: per-sample clipping, K = 5, B = 32, lr = 0.1, V = 1, L = 1.
KINK = {"algorithm": "fedavg", "schedule": "constant", "lr": 0.1, "local_steps": 5, "clip_norm": 1.0,
        "smoothness": 1.0, "delta": 1e-5, "clipping": "per-sample", "batch_size": 32}


def test_kink_sensitivity_through_local_update_is_the_clipping_only_one():
    """One round from w = 0: the canary client's runs end 2 eta V (1/B + K - 1) = 0.80625 apart
    (by hand: the first step moves -+eta V/B, then every kink sample pushes on), 21 times the
    theta-scaled 0.0382 of the old rule; the clipping-only bound is 2 eta V K = 1."""
    config = AccountantConfig(**KINK, clients=1, sigma=1e-9)
    run = run_canary(config, 1, 4, 4, canary="kink", seed=0)
    e0, e1 = (w[:, 0] for w in run.evaluation)
    assert (e1 - e0) == pytest.approx(np.full(4, 0.1 * 2 * (1 / 32 + 4)), abs=1e-6)
    theta = terms.per_sample_theta(terms.drift_kappa([0.1] * 5, 1.0), 32)
    assert theta * 1.0 == pytest.approx(0.0381569, abs=1e-6)
    linear = run_canary(config, 1, 4, 4, canary="linear", seed=0)
    assert (linear.evaluation[1] - linear.evaluation[0])[:, 0] == pytest.approx(np.full(4, 0.1 * 2 * 5 / 32), abs=1e-6)


def _old_theta_composition(config: AccountantConfig, rounds: int) -> float:
    """Composition with theta = min(1, kappa/B) at the configured L (the rule before issue 16 item 2),
    from privacy/terms.py's own functions."""
    etas = step_sizes(config.schedule, config.lr, 0, config.local_steps)
    theta = terms.per_sample_theta(terms.drift_kappa(etas, config.smoothness), config.batch_size)
    gamma = theta * 2 * config.clip_norm * sum(etas) / config.clients
    return privacy_bounds.composition_mu([gamma] * rounds, [config.sigma / math.sqrt(config.clients)] * rounds)


def test_kink_canary_flags_the_theta_rule_with_configured_l():
    config = AccountantConfig(**KINK, **OUTSIDE, clients=10, sigma=0.1)
    report = run_audit(config, 1, canary="kink", adversary="all-rounds", trials=SMALL_TRIALS, seed=3)
    exact = 0.1 * 2 * (1 / 32 + 4) / (0.1 * math.sqrt(10))  # one Gaussian round: gap / (sigma/sqrt(m))
    old = _old_theta_composition(config, 1)
    assert old == pytest.approx(0.12066, abs=1e-4)
    assert report.attack.mu_estimate == pytest.approx(exact, abs=0.1)
    assert report.attack.mu_lower > 15 * old  # flagged by a factor of 15 and more
    clipping_only = 2 * 0.1 * 5 / (0.1 * math.sqrt(10))  # theta = 1
    assert report.attack.mu_lower < clipping_only


def test_kink_canary_new_theta_rule_holds_and_asserted_smoothness_is_an_assumption_violation():
    config = AccountantConfig(**KINK, **OUTSIDE, clients=10, sigma=0.1)
    report = run_audit(config, 1, canary="kink", adversary="all-rounds", trials=SMALL_TRIALS, seed=3)
    assert report.verdict("composition").mu == pytest.approx(2 * 0.1 * 5 / (0.1 * math.sqrt(10)))
    assert report.verdict("composition").outcome == "holds" and not report.package_bug
    asserted = AccountantConfig(**KINK, **OUTSIDE, clients=10, sigma=0.1, assume_smooth_losses=True)
    flagged = run_audit(asserted, 1, canary="kink", adversary="all-rounds", trials=SMALL_TRIALS, seed=3)
    composition = flagged.verdict("composition")
    assert composition.mu == pytest.approx(_old_theta_composition(asserted, 1))
    assert composition.violated and composition.outcome == "assumption violated" and not flagged.package_bug


# Issue 16 item 4: the final-model bound at L = 0.1 on the kink instance (per-batch clipping, stage).
SMOOTH_FINAL = {"algorithm": "fedavg", "schedule": "stage", "lr": 0.1, "local_steps": 5, "clip_norm": 1.0,
                "clients": 10, "sigma": 0.5, "smoothness": 0.1, "delta": 1e-5, "threat_model": "final-model"}


def _final_model_config(**kw) -> AccountantConfig:
    # the final-model threat model needs the operator's assertion of L-smooth losses
    return AccountantConfig(**SMOOTH_FINAL, **OUTSIDE, assume_smooth_losses=True, **kw)


def test_kink_canary_flags_the_final_model_bound_at_small_l():
    """The kink's trajectories part like no L-smooth loss's: the final model keeps round 1's
    difference, which the final-model bound (rho from L = 0.1) assumes later noise hides."""
    rounds = 30
    config = _final_model_config()
    kink = run_audit(config, rounds, canary="kink", trials=SMALL_TRIALS, seed=4)
    final = kink.verdict("final_model")
    assert final.mu == pytest.approx(0.4831, abs=1e-3) and kink.plan.certified_bound == "final_model"
    assert final.violated and kink.verdict("certified").violated
    assert kink.verdict("composition").outcome == "holds"  # clipping-only: sound for any loss
    # control: the linear canary (L-smooth for every L) does not exceed it
    linear = run_audit(config, rounds, canary="linear", trials=SMALL_TRIALS, seed=4)
    assert not linear.verdict("final_model").violated and not linear.package_bug


def test_kink_final_model_violation_is_an_assumption_violation_once_labelled():
    kink = run_audit(_final_model_config(), 30, canary="kink", trials=SMALL_TRIALS, seed=4)
    final = kink.verdict("final_model")
    assert final.assumes and final.outcome == "assumption violated" and not kink.package_bug
    assert any("smooth" in b for b in final.broken)


def test_cli_audit_adversary_and_canary_flags(capsys):
    code = main(["audit", "--schedule", "stage", "--clients", "20", "--local-steps", "5", "--lr", "0.05",
                 "--sigma", "0.5", "--rounds", "20", "--trials", "2000", "--adversary", "all-rounds", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0 and out["adversary"] == "all-rounds" and out["canary"] == "linear"
    assert {v["bound"]: v["outcome"] for v in out["verdicts"]}["final_model"] == "not applicable"
    code = main(["audit", "--per-sample-clipping", "--batch-size", "32", "--lr", "0.1", "--clients", "10",
                 "--sigma", "0.1", "--rounds", "1", "--trials", "2000", "--canary", "kink",
                 "--adversary", "all-rounds", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert out["package_bug"] is False and code == 0  # clipping-only composition (theta = 1) holds
    code = main(["audit", "--per-sample-clipping", "--batch-size", "32", "--lr", "0.1", "--clients", "10",
                 "--sigma", "0.1", "--rounds", "1", "--trials", "2000", "--canary", "kink",
                 "--adversary", "all-rounds", "--assume-smooth-losses", "--json"])
    out = json.loads(capsys.readouterr().out)
    composition = {v["bound"]: v for v in out["verdicts"]}["composition"]
    assert code == 0 and composition["outcome"] == "assumption violated" and composition["broken"]
    with pytest.raises(SystemExit) as exc:
        main(["audit", "--sigma", "0.5", "--clients", "1", "--adversary", "participant"])
    assert exc.value.code == 2 and "--clients" in capsys.readouterr().err


# ------------------------------------------------------------------ fl-dp-flower sensitivity

from fl_dp_flower.audit.sensitivity import SensitivitySetup, run_sensitivity  # noqa: E402 (the section's own imports)

# Full-batch local steps (16 images per client, B = 16), so the differing image is in every batch.
SMALL = {"clients": 10, "local_steps": 2, "batch_size": 16, "samples_per_client": 16, "rounds": 4, "lr": 0.1,
         "clip_norm": 1.0, "sigma": 0.01, "smoothness": 1.0, "seed": 1}


@pytest.mark.parametrize("overrides", [
    {"schedule": "constant"}, {"schedule": "cyclic"}, {"schedule": "stage"}, {"schedule": "iterative"},
    {"algorithm": "fedprox", "schedule": "constant", "prox_alpha": 0.01},
    {"algorithm": "fedprox", "schedule": "constant", "prox_alpha": 0.1},
    {"algorithm": "fedprox", "schedule": "constant", "prox_alpha": 1.0},
])
def test_measured_sensitivity_never_exceeds_its_bounds(overrides):
    curve = run_sensitivity(SensitivitySetup(**{**SMALL, **overrides}))
    assert len(curve.measured) == SMALL["rounds"]
    assert all(m > 0 for m in curve.measured)  # the differing image moves the model every round
    for t, (m, b) in enumerate(zip(curve.measured, curve.clipping_bound)):
        assert m <= b, f"round {t + 1}: measured {m} > clipping-only bound {b}"
    if curve.smooth_bound is not None:
        for t, (m, b) in enumerate(zip(curve.measured, curve.smooth_bound)):
            assert m <= b, f"round {t + 1}: measured {m} > smooth bound {b}"
    else:
        assert overrides.get("prox_alpha", 2.0) <= SMALL["smoothness"]


def test_clipping_only_bound_follows_its_recursion():
    """D_1 = gamma_0 = 2V sum(eta)/m, then D_{t+1} = D_t + 2V sum(eta) (constant schedule)."""
    curve = run_sensitivity(SensitivitySetup(**{**SMALL, "rounds": 3, "schedule": "constant"}))
    per_client = 2 * 1.0 * 0.1 * 2
    assert curve.clipping_bound == pytest.approx((per_client / 10, per_client / 10 + per_client,
                                                  per_client / 10 + 2 * per_client))
    # smooth: D_{t+1} = (1 + lr L)^K D_t + gamma
    rho, gamma = 1.1 ** 2, per_client / 10
    assert curve.smooth_bound == pytest.approx((gamma, rho * gamma + gamma, rho * (rho * gamma + gamma) + gamma))


def test_fedprox_shrinks_sensitivity_and_its_bound():
    loose = run_sensitivity(SensitivitySetup(**{**SMALL, "algorithm": "fedprox", "prox_alpha": 0.01}))
    tight = run_sensitivity(SensitivitySetup(**{**SMALL, "algorithm": "fedprox", "prox_alpha": 5.0}))
    assert tight.clipping_bound[-1] < loose.clipping_bound[-1]
    assert tight.measured[-1] < loose.measured[-1]


def test_sensitivity_setup_rejects_bad_input():
    with pytest.raises(ValueError, match=r"lr \(largest step size 0.1\) must be <= 1/prox_alpha"):
        SensitivitySetup(algorithm="fedprox", prox_alpha=20.0, lr=0.1)
    with pytest.raises(ValueError, match="clients"):
        SensitivitySetup(clients=0)


def test_cli_sensitivity_json(capsys):
    code = main(["sensitivity", "--schedules", "stage", "--prox-alphas", "1", "--rounds", "2", "--clients", "10",
                 "--local-steps", "2", "--batch-size", "16", "--samples-per-client", "16", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    assert [c["label"] for c in out["curves"]] == ["fedavg stage", "fedprox alpha=1 (constant)"]
    assert all(0 < m <= b for c in out["curves"] for m, b in zip(c["measured"], c["clipping_bound"]))


def test_cli_sensitivity_names_bad_flags(capsys):
    with pytest.raises(SystemExit) as exc:
        main(["sensitivity", "--schedules", "weekly"])
    assert exc.value.code == 2 and "--schedules" in capsys.readouterr().err

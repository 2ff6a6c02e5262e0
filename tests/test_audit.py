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
from fl_dp_flower.cli import main
from fl_dp_flower.privacy.records import AccountantConfig

# The configuration: m = 20, K = 5, lr = 0.05, sigma = 0.5, V = 1, L = 1, T = 100.
# colluders=0: the final-model canary attack is an outside observer's (noise sigma/sqrt(m)); the
# participant's view (c >= 1, docs/MATH.md §14.2a) only makes the printed bounds larger.
BASE = dict(algorithm="fedavg", lr=0.05, local_steps=5, clip_norm=1.0, clients=20, sigma=0.5,
            smoothness=1.0, delta=1e-5, colluders=0)
TRIALS = 20_000  # per world; 100,000 takes ~20 s (bench/audit.py)


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
    draw = lambda shift: rng.normal(shift, 1.0, size=(n, 1))  # noqa: E731
    result = audit_attack((draw(0.0), draw(mu)), (draw(0.0), draw(mu)), delta=1e-5)
    assert 1.35 < result.mu_lower < mu
    assert result.mu_estimate == pytest.approx(mu, abs=0.05)
    # No difference at all: nothing is detected beyond the sampling error.
    null = audit_attack((draw(0.0), draw(0.05)), (draw(0.0), draw(0.0)), delta=1e-5)
    assert null.mu_lower < 0.05 and null.epsilon_lower < 0.1


def test_constant_schedule_violates_the_paper_bound_and_not_the_sound_ones():
    report = run_audit(_config(schedule="constant"), 100, trials=TRIALS, seed=0)
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
    (["--algorithm", "fedprox", "--prox-alpha", "0.5"], "--prox-alpha"),
])
def test_cli_audit_rejects_bad_input_naming_the_flag(argv, named, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["audit", "--sigma", "0.5", *argv])
    assert exc.value.code == 2
    assert named in capsys.readouterr().err


# ------------------------------------------------------------------ fl-dp-flower sensitivity

from fl_dp_flower.audit.sensitivity import SensitivitySetup, run_sensitivity  # noqa: E402

# Full-batch local steps (16 images per client, B = 16), so the differing image is in every batch.
SMALL = dict(clients=10, local_steps=2, batch_size=16, samples_per_client=16, rounds=4, lr=0.1, clip_norm=1.0,
             sigma=0.01, smoothness=1.0, seed=1)


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

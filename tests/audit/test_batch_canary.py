"""The audit of a batch-sampled run (issue 32): a canary SAMPLE in one site, its batches Poisson-sampled on
the site by the node's own update, attacked by the all-rounds adversary.

References independent of the code under test: the per-trial inclusions against Bernoulli(q) and their
independence across groups (binomial counts), the attack's scores against a numpy simulation of the exact
one-dimensional pair (two-sample Kolmogorov-Smirnov), the certified bound against dp-accounting's own
PLDAccountant on PoissonSampledDpEvent(q, GaussianDpEvent), and an attack that can fail: the same attack
exceeds the bound a too-small rate q/4 would certify.
"""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest
from scipy import stats

from fl_dp_flower.app.cli import main
from fl_dp_flower.audit.batch_canary import group_layout, inclusion_patterns, run_batch_canary
from fl_dp_flower.audit.run import run_audit
from fl_dp_flower.privacy.sample_sampling import composed_epsilon
from fl_dp_flower.privacy.records import AccountantConfig


@pytest.fixture(autouse=True, scope="module")
def _one_torch_thread():
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


# Two sites, an outside observer (colluders 0), K 1, lr 1, V 1, B 10: one sample moves the average by
# eta V / (B m) = 0.05 against noise sigma / sqrt(m), i.e. r = 0.1 / (sigma sqrt 2) = 0.8 per round at sigma
# 0.0884 (the accountant's r_t, docs/MATH.md §23.1), q 0.5, 10 rounds.
SIGMA = 0.1 / (0.8 * math.sqrt(2))
CONFIG = AccountantConfig(algorithm="fedavg", schedule="constant", lr=1.0, local_steps=1, clip_norm=1.0, clients=2,
                          sigma=SIGMA, delta=1e-5, colluders=0, clipping="per-sample", batch_size=10, batch_rate=0.5)
ROUNDS, TRIALS = 10, 3000


def test_group_layout_keeps_the_rate_and_never_clips_a_step():
    for rate in (0.5, 0.065, 26 / 360, 0.01, 1.0):
        n, batch = group_layout(rate)
        assert batch / n == rate and n <= batch ** 2  # |S| <= n <= B'^2: the outer clip never acts
    n, batch = group_layout(1 / math.pi)  # not a fraction of small denominator: a hair above
    assert 0 <= batch / n - 1 / math.pi < 1 / n
    with pytest.raises(ValueError, match="batch_rate .* too small"):
        group_layout(0.001)


def test_inclusion_patterns_are_the_binomial_mixture_and_fedprox_pulls_back():
    logs, moves = inclusion_patterns([0.5, 0.5], 0.25, 2.0, 0.0)
    assert np.allclose(np.exp(logs), [0.5625, 0.1875, 0.1875, 0.0625]) and np.allclose(moves, [0, 1, 1, 2])
    _, prox = inclusion_patterns([0.5, 0.5], 0.25, 2.0, 1.0)  # step 2 pulls back by eta alpha (w_1 - w_0)
    assert np.allclose(prox, [0, 1, 0.5, 1.5])


def test_each_trial_draws_its_own_inclusion_at_rate_q():
    """One round at noise 1e-9 of the step: a row moved iff the site's draw took its canary. The fraction
    is Binomial(rows, q) and rows j and j + n (same sample index, different groups) are independent: a
    draw shared by the groups would make them equal."""
    config = dataclasses.replace(CONFIG, sigma=1e-12, batch_rate=0.25)
    run = run_batch_canary(config, 1, 2000, 2000, statistics=False)
    moved = np.abs(run.final[:, 0]) > 0.5 * 0.05
    assert np.all(np.isclose(np.abs(run.final[moved, 0]), 0.05, rtol=1e-6))
    rows, q = len(moved), 0.25
    assert abs(moved.mean() - q) < 5 * math.sqrt(q * (1 - q) / rows)
    n, _ = group_layout(q)
    a, b = moved[:n * (rows // n - 1)], moved[n:n * (rows // n)]
    both = (a & b).mean()
    assert abs(both - q * q) < 5 * math.sqrt(q * q * (1 - q * q) / len(a))


def _exact_pair_scores(rng: np.random.Generator, world: int, q: float, r: float, rounds: int, trials: int) -> np.ndarray:
    """The all-rounds log likelihood ratio of the exact 1-D pair, in noise units: world 0 mean -r, world 1 +r
    with probability q, else 0."""
    taken = rng.random((trials, rounds)) < q
    y = np.where(taken, (1 if world else -1) * r, 0.0) + rng.normal(size=(trials, rounds))
    one = np.logaddexp(math.log(q) - (y - r) ** 2 / 2, math.log1p(-q) - y * y / 2)
    zero = np.logaddexp(math.log(q) - (y + r) ** 2 / 2, math.log1p(-q) - y * y / 2)
    return (one - zero).sum(axis=1)


def test_the_all_rounds_scores_follow_the_exact_subsampled_gaussian_pair():
    run = run_batch_canary(CONFIG, ROUNDS, 2000, 10)
    (_, _), (e0, e1) = run.split(run.all_rounds)
    rng = np.random.default_rng(7)
    for world, scores in ((0, e0), (1, e1)):
        reference = _exact_pair_scores(rng, world, 0.5, 0.8, ROUNDS, 20_000)
        assert stats.ks_2samp(scores, reference).pvalue > 1e-3


def test_the_attack_stays_below_batch_sampled_and_beats_a_bound_at_a_quarter_of_q():
    """The certified batch_sampled epsilon (checked against dp-accounting's PLDAccountant) holds against the
    exact likelihood-ratio attack; the same attack exceeds what the bound would certify at rate q/4, so it
    is strong enough to fail a wrong amplification."""
    from dp_accounting import NeighboringRelation, PoissonSampledDpEvent, GaussianDpEvent, SelfComposedDpEvent
    from dp_accounting.pld import PLDAccountant

    report = run_audit(CONFIG, ROUNDS, adversary="all-rounds", trials=TRIALS, seed=0)
    certified = report.plan.bounds["batch_sampled"].epsilon
    assert report.plan.certified_bound == "batch_sampled"
    reference = PLDAccountant(NeighboringRelation.REPLACE_ONE, value_discretization_interval=1e-4).compose(
        SelfComposedDpEvent(PoissonSampledDpEvent(0.5, GaussianDpEvent(1 / 0.8)), ROUNDS)).get_epsilon(1e-5)
    assert certified == pytest.approx(reference, rel=2e-3)
    too_strong = composed_epsilon("replace-one", [(0.125, 0.8)] * ROUNDS, 1e-5)  # the accountant's PLD at q/4
    lower = report.attack.epsilon_lower
    assert too_strong < lower <= certified, (too_strong, lower, certified)
    assert report.verdict("batch_sampled").outcome == "holds" and report.verdict("certified").outcome == "holds"
    assert not report.package_bug


def test_cli_audits_the_cross_silo_preset_and_refuses_the_kink_canary(capsys):
    code = main(["audit", "--preset", "cross-silo", "--num-server-rounds", "2", "--adversary", "all-rounds",
                 "--trials", "200", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert code == 0
    verdicts = {v["bound"]: v["outcome"] for v in out["verdicts"]}
    assert verdicts["batch_sampled"] == "holds" and out["certified_bound"] == "batch_sampled"
    with pytest.raises(SystemExit) as exc:
        main(["audit", "--preset", "cross-silo", "--num-server-rounds", "2", "--canary", "kink", "--trials", "200"])
    assert exc.value.code == 2 and "linear canary only" in capsys.readouterr().err


@pytest.mark.parametrize("overrides", [{"local_steps": 3, "lr": 0.5},
                                       {"local_steps": 3, "lr": 0.5, "algorithm": "fedprox", "prox_alpha": 1.0},
                                       {"local_steps": 2, "schedule": "stage"}])
def test_k_steps_move_every_trial_by_an_inclusion_pattern(overrides):
    """K >= 2 (and FedProx's pull, and a schedule whose steps change by round): the run asserts that every
    row moved by one of the 2^K amounts of inclusion_patterns, so the node's real update and the
    statistic's model agree (a wrong pattern model raises); both worlds' scores separate."""
    run = run_batch_canary(dataclasses.replace(CONFIG, **overrides), 3, 500, 500, seed=1)
    (_, _), (e0, e1) = run.split(run.all_rounds)
    assert e1.mean() > e0.mean()

"""The bound conditioned on the round's count for a secret sample (privacy/client_sampling.py,
docs/MATH.md §22), checked against independent computations: the trade-off curve C_p(G_mu) by
mpmath (Neyman-Pearson suprema of both directions, at 30 digits), two composed rounds by mpmath
quadrature, a Monte-Carlo estimate of the composed privacy loss, and the real mechanism with
per-client noise on a small population, integrated numerically."""

from __future__ import annotations

import itertools
import math

import mpmath
import numpy as np
import pytest
from scipy import integrate, stats

from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.client_sampling import (CONDITIONED_BOUND, client_level_sensitivity, conditioned_epsilon,
                                                  conditioned_pld, inclusion_probability, privacy_profile)
from fl_dp_flower.privacy.records import AccountantConfig, RoundRecord
from fl_dp_flower.privacy.sampled import composed_epsilon
from fl_dp_flower.privacy.terms import round_terms

mpmath.mp.dps = 30


def _bisect(sign_fn, lo=-60, hi=60) -> mpmath.mpf | None:
    """The root of a monotone ``sign_fn`` on [lo, hi] by bisection (None: no sign change)."""
    lo, hi = mpmath.mpf(lo), mpmath.mpf(hi)
    f_lo, f_hi = sign_fn(lo), sign_fn(hi)
    if f_lo * f_hi > 0:
        return None
    for _ in range(200):
        mid = (lo + hi) / 2
        if sign_fn(mid) * f_lo > 0:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def reference_profile(p: float, mu: float, eps: float) -> mpmath.mpf:
    """delta(eps) of C_p(G_mu) = min(f_p, f_p^-1)**: its conjugate is the max of the two directions'
    hockey-stick divergences, each the supremum over Neyman-Pearson thresholds t (the root of the
    likelihood ratio against e^eps, by bisection, or an end of the line), in mpmath."""
    p, mu, g = mpmath.mpf(p), mpmath.mpf(mu), mpmath.e ** mpmath.mpf(eps)
    cdf = mpmath.ncdf
    ratio = lambda t: (1 - p) + p * mpmath.e ** (mu * t - mu * mu / 2)  # noqa: E731  (dP/dQ at t)
    # remove: P = (1-p) N(0,1) + p N(mu,1) against Q = N(0,1), reject {Y > t}
    rem_obj = lambda t: (1 - p) * (1 - cdf(t)) + p * (1 - cdf(t - mu)) - g * (1 - cdf(t))  # noqa: E731
    t_rem = _bisect(lambda t: ratio(t) - g)
    rem = max(1 - g, mpmath.mpf(0), *([rem_obj(t_rem)] if t_rem is not None else []))
    # add: Q against P, reject {Y < t}
    add_obj = lambda t: cdf(t) - g * ((1 - p) * cdf(t) + p * cdf(t - mu))  # noqa: E731
    t_add = _bisect(lambda t: 1 - g * ratio(t))
    add = max(1 - g, mpmath.mpf(0), *([add_obj(t_add)] if t_add is not None else []))
    return max(rem, add)


@pytest.mark.parametrize(("p", "mu"), [(0.25, 0.5), (0.05, 1.5), (0.01, 0.2), (0.6, 3.0)])
def test_profile_is_the_trade_off_curve_of_C_p_by_mpmath(p, mu):
    eps = np.array([-2.0, -0.7, -0.1, 0.0, 0.05, 0.3, 1.0, 2.5])
    ours = privacy_profile(p, mu, eps)
    for e, value in zip(eps, ours):
        assert value == pytest.approx(float(reference_profile(p, mu, e)), abs=1e-12)


def _mp_profile(p, mu, eps):
    """The closed-form profile in mpmath (positive part; negative eps by symmetry)."""
    p, mu, a = mpmath.mpf(p), mpmath.mpf(mu), abs(mpmath.mpf(eps))
    y = (mpmath.log(1 + mpmath.expm1(a) / p) + mu * mu / 2) / mu
    upper = max(p * mpmath.ncdf(mu - y) - (mpmath.expm1(a) + p) * mpmath.ncdf(-y), 0)
    return upper if eps >= 0 else 1 - mpmath.e ** eps + mpmath.e ** eps * upper


def test_two_composed_rounds_match_mpmath_quadrature():
    """delta_2(eps) = E_{P_1}[delta_2nd(eps - L_1)] over the first round's pair (positive part, mirror, atom),
    by mpmath quadrature; the PLD of the two rounds is pessimistic and tight to 1e-3."""
    (p1, mu1), (p2, mu2) = (0.3, 0.8), (0.1, 1.2)
    pp, mm = mpmath.mpf(p1), mpmath.mpf(mu1)
    loss = lambda y: mpmath.log(1 - pp + pp * mpmath.e ** (mm * y - mm * mm / 2))  # noqa: E731
    dens_p = lambda y: (1 - pp) * mpmath.npdf(y) + pp * mpmath.npdf(y - mm)  # noqa: E731
    a = (2 - pp) * mpmath.ncdf(-mm / 2) + pp * mpmath.ncdf(mm / 2)
    pld = conditioned_pld(p1, mu1).compose(conditioned_pld(p2, mu2))
    for eps in (0.2, 0.8, 1.6):
        second = lambda s: _mp_profile(p2, mu2, s)  # noqa: E731
        exact = (mpmath.quad(lambda y: dens_p(y) * second(eps - loss(y)), [mm / 2, mm / 2 + 3, mpmath.inf])
                 + mpmath.quad(lambda y: mpmath.npdf(y) * second(eps + loss(y)), [mm / 2, mm / 2 + 3, mpmath.inf])
                 + (1 - a) * second(eps))
        ours = float(pld.get_delta_for_epsilon(eps))
        assert ours >= float(exact) - 1e-12
        assert ours <= float(exact) * (1 + 1e-3) + 1e-9


def _sample_losses(p: float, mu: float, size: int, rng: np.random.Generator) -> np.ndarray:
    """Privacy losses of the symmetric pair under P: L(y) for y ~ P on {y >= mu/2}, the mirror -L(y) for
    y ~ N(0,1) on {y >= mu/2}, 0 on the common atom."""
    y = np.where(rng.random(size) < p, rng.normal(mu, 1.0, size), rng.normal(0.0, 1.0, size))
    loss = np.log1p(p * np.expm1(mu * y - mu * mu / 2.0))
    below = y < mu / 2.0
    q_upper = stats.norm.sf(mu / 2.0)
    p_lower = (1 - p) * stats.norm.cdf(mu / 2.0) + p * stats.norm.cdf(-mu / 2.0)
    mirror = below & (rng.random(size) < q_upper / p_lower)
    u = rng.random(size)
    y_mirror = stats.norm.isf(q_upper * u)  # N(0,1) conditioned on y >= mu/2
    mirror_loss = -np.log1p(p * np.expm1(mu * y_mirror - mu * mu / 2.0))
    return np.where(below, np.where(mirror, mirror_loss, 0.0), loss)


def test_monte_carlo_privacy_loss_agrees_with_the_pld():
    rng = np.random.default_rng(7)
    p, mu, rounds, n = 0.1, 0.6, 20, 400_000
    total = sum(_sample_losses(p, mu, n, rng) for _ in range(rounds))
    assert np.mean(np.exp(-_sample_losses(p, mu, n, rng))) == pytest.approx(1.0, abs=5e-3)  # a pair: E_P[dQ/dP] = 1
    pld = conditioned_pld(p, mu).self_compose(rounds)
    for eps in (0.1, 0.3, 0.6):
        samples = -np.expm1(np.minimum(eps - total, 0.0))  # (1 - e^{eps - L})_+
        estimate, se = samples.mean(), samples.std() / math.sqrt(n)
        bound = float(pld.get_delta_for_epsilon(eps))
        assert estimate - 4 * se <= bound <= estimate + 4 * se + 2e-4


def _mechanism_delta(deltas_other, target, target_prime, sigma, n, eps):
    """H_{e^eps} between the outputs of the real mechanism (a secret uniform n-subset of the population,
    the sum of its members' updates, each member's own N(0, sigma^2) noise) on the two data sets:
    the mixtures' densities on a fine grid (Simpson's rule, 400,001 points over +-12 sd)."""
    population = [target, *deltas_other]
    prime = [target_prime, *deltas_other]
    subsets = list(itertools.combinations(range(len(population)), n))
    sd = sigma * math.sqrt(n)
    means = [sum(v[i] for i in s) for v in (population, prime) for s in subsets]
    y = np.linspace(min(means) - 12 * sd, max(means) + 12 * sd, 400_001)

    def density(values):
        return np.mean([stats.norm.pdf(y, sum(values[i] for i in s), sd) for s in subsets], axis=0)

    return float(integrate.simpson(np.maximum(density(population) - math.exp(eps) * density(prime), 0.0), x=y))


def test_the_real_mechanism_with_per_client_noise_stays_below_the_bound_and_needs_client_level_sensitivity():
    """Four clients, two drawn in secret, one dimension: the target's update 1 against 1.1 (one sample changed).
    The bound with the client-level sensitivity (any two updates) holds for others near and far; with the
    sample-level 0.1 (what the public-sample pair uses) it fails once the others' updates are far from the
    target's (the output then shows whether the target was drawn): the coupling of the theorem puts another
    client in the target's seat."""
    sigma, n = 0.5, 2
    p = inclusion_probability(n, 4)
    for others in ([0.0, 0.0, 0.0], [-3.0, -3.0, 0.5]):
        gamma = max(abs(a - b) for a in (1.0, 1.1, *others) for b in (1.0, 1.1, *others))
        for eps in (0.0, 0.2, 1.0):
            real = max(_mechanism_delta(others, 1.0, 1.1, sigma, n, eps),
                       _mechanism_delta(others, 1.1, 1.0, sigma, n, eps))
            assert real <= privacy_profile(p, gamma / (sigma * math.sqrt(n)), np.array([eps]))[0] + 1e-7
    far = _mechanism_delta([-3.0, -3.0, -3.0], 1.0, 1.1, sigma, n, 0.2)
    assert far > 5 * privacy_profile(p, 0.1 / (sigma * math.sqrt(n)), np.array([0.2]))[0]


def test_the_issue_table_is_reproduced():
    """issue 31's table: (q, rounds, mu_t) -> epsilon of the public-sample pair and of the conditioned bound."""
    mu = 2 * 2.0 * 1.0 / (1.52 * math.sqrt(900))  # lr 2, V 1, sigma 1.52, 900 of 3,600 clients per round
    assert composed_epsilon(0.25, [mu] * 120, 1e-5) == pytest.approx(1.995, abs=2e-3)
    assert conditioned_epsilon([(0.25, mu)] * 120, 1e-5) == pytest.approx(0.915, abs=2e-3)
    assert conditioned_epsilon([(0.01, 0.2135034)] * 500, 1e-5) == pytest.approx(0.168, abs=1e-3)
    assert conditioned_epsilon([(0.01, 0.1265393)] * 1000, 1e-5) == pytest.approx(0.133, abs=1e-3)


def test_full_participation_is_the_gaussian_and_an_empty_round_is_free():
    from fl_dp_flower.privacy import gdp

    assert conditioned_epsilon([(1.0, 0.7)] * 9, 1e-5) == pytest.approx(gdp.epsilon(2.1, 1e-5), abs=2e-3)
    assert conditioned_epsilon([(0.0, 5.0), (0.3, 0.0)], 1e-5) == 0.0
    assert inclusion_probability(10, 10, colluders=3) == 1.0 and inclusion_probability(3, 13, colluders=3) == 0.3


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox"])
@pytest.mark.parametrize(("clipping", "batch", "steps"), [("per-sample", 8, 1), ("per-sample", 1, 3), ("per-batch", 4, 2)])
def test_client_level_sensitivity_bounds_every_relation(algorithm, clipping, batch, steps):
    extra = {"prox_alpha": 2.0} if algorithm == "fedprox" else {}
    record = RoundRecord(round=1, algorithm=algorithm, step_sizes=(0.3,) * steps, clip_norm=1.5, sigma=1.0,
                         weights=(0.5, 0.5), clipping=clipping, batch_size=batch, **extra)
    terms = round_terms(record, 1.0, 0)
    gamma = client_level_sensitivity(record)
    assert gamma >= terms.client_sensitivity >= terms.client_sensitivity_add_remove
    if algorithm == "fedavg":
        assert gamma == pytest.approx(2 * 1.5 * 0.3 * steps)


def _poisson_records(rounds: int, drawn: int, population: int, entered: int, lr: float = 2.0, sigma: float = 1.52):
    return [RoundRecord(round=t, algorithm="fedavg", step_sizes=(lr,), clip_norm=1.0, sigma=sigma,
                        weights=(1.0 / entered,) * entered, clipping="per-sample", batch_size=1,
                        population=population, sampled=drawn) for t in range(1, rounds + 1)]


def _config(**extra) -> AccountantConfig:
    base = {"lr": 2.0, "local_steps": 1, "clip_norm": 1.0, "clients": 900, "sigma": 1.52, "clipping": "per-sample",
            "batch_size": 1, "colluders": 0}
    return AccountantConfig(**{**base, **extra})


def test_a_secret_sample_certifies_the_conditioned_bound_a_public_one_the_public_pair():
    records = _poisson_records(30, 900, 3600, 900)
    public = PrivacyAccountant.from_records(_config(sampling_rate=0.25), records).report()
    secret = PrivacyAccountant.from_records(_config(sampling_rate=0.25, sample_secrecy="secret"), records).report()
    assert CONDITIONED_BOUND not in public.bounds and public.certified_bound == "sampled"
    assert public.sampling["secrecy"] == "public"
    mu = 4.0 / (1.52 * 30.0)
    assert public.certified.epsilon == pytest.approx(composed_epsilon(0.25, [mu] * 30, 1e-5), rel=1e-9)
    assert secret.certified_bound == CONDITIONED_BOUND
    assert secret.certified.epsilon == pytest.approx(conditioned_epsilon([(0.25, mu)] * 30, 1e-5), abs=1e-6)
    assert secret.certified.epsilon < 0.6 * public.certified.epsilon
    assert any(a.startswith("secret sample") for a in secret.certified.assumes)
    assert secret.add_remove["bound"] == CONDITIONED_BOUND and secret.sampling["secrecy"] == "secret"


def test_the_public_pair_weighs_the_target_by_the_published_count_not_q():
    """issue 28 item 4: a round that drew 1,800 of 3,600 clients at q 0.25 held the target with chance 1/2."""
    records = _poisson_records(10, 1800, 3600, 1800)
    report = PrivacyAccountant.from_records(_config(sampling_rate=0.25), records).report()
    mu = 4.0 / (1.52 * math.sqrt(1800))
    assert report.bounds["sampled"].epsilon == pytest.approx(composed_epsilon(0.5, [mu] * 10, 1e-5), rel=1e-9)
    assert report.bounds["sampled"].epsilon > composed_epsilon(0.25, [mu] * 10, 1e-5) * 1.2


def test_fixed_size_sampling_of_a_secret_sample_is_amplified():
    """200 of 4,000 clients per round (what a plain clients-per-round does), sigma 0.711, lr 2: the target in every
    round gives composition; the secret sample the conditioned bound."""
    records = [RoundRecord(round=t, algorithm="fedavg", step_sizes=(2.0,), clip_norm=1.0, sigma=0.711,
                           weights=(1 / 200,) * 200, clipping="per-sample", batch_size=1, population=4000, sampled=200)
               for t in range(1, 21)]
    config = _config(clients=200, sigma=0.711, population=4000)
    plain = PrivacyAccountant.from_records(config, records).report()
    secret = PrivacyAccountant.from_records(_config(clients=200, sigma=0.711, population=4000,
                                                    sample_secrecy="secret"), records).report()
    assert plain.certified_bound == "composition"
    assert secret.certified_bound == CONDITIONED_BOUND
    mu = 4.0 / (0.711 * math.sqrt(200))
    assert secret.certified.epsilon == pytest.approx(conditioned_epsilon([(0.05, mu)] * 20, 1e-5), abs=1e-6)
    assert secret.certified.epsilon < 0.5 * plain.certified.epsilon


def test_secrecy_settings_are_checked_and_old_headers_read_as_public():
    with pytest.raises(ValueError, match="sample_secrecy 'secret' needs threat_model 'all-rounds'"):
        _config(sample_secrecy="secret", threat_model="final-model")
    with pytest.raises(ValueError, match="sample_secrecy"):
        _config(sample_secrecy="hidden")
    with pytest.raises(ValueError, match="population must be an integer >= clients"):
        _config(population=100)
    header = _config().to_dict()
    del header["sample_secrecy"], header["population"]
    assert AccountantConfig.from_dict(header).sample_secrecy == "public"


def test_accountant_config_names_the_population():
    """issue 31: DPSettings.accountant_config(clients=...) meant floor(q N) with sampling and N without (a run
    certified 19.6 where 8 was planned); with sampling the population is named and clients= is refused."""
    from fl_dp_flower import DPSettings

    settings = DPSettings(sigma=1.0, clip_norm=1.0, local_steps=1, batch_size=1, lr=2.0)
    poisson = settings.accountant_config(population=3600, sampling_rate=0.25)
    assert poisson.clients == 900 and poisson.sampling_rate == 0.25 and poisson.population is None
    with pytest.raises(ValueError, match="name the population"):
        settings.accountant_config(clients=900, sampling_rate=0.25)
    with pytest.raises(ValueError, match="name the population"):
        settings.accountant_config(sampling_rate=0.25)
    secret = settings.accountant_config(clients=200, population=4000, sample_secrecy="secret")
    assert (secret.clients, secret.population, secret.sample_secrecy) == (200, 4000, "secret")
    assert settings.accountant_config(clients=5).clients == 5
    with pytest.raises(ValueError, match="population is used with sampling_rate or sample_secrecy"):
        settings.accountant_config(clients=5, population=50)
    with pytest.raises(ValueError, match="clients .* is required"):
        settings.accountant_config()


def test_the_audit_attack_stays_below_a_secret_sample_and_beats_it_when_members_are_public():
    """The audit's threshold attack (audit.attack, Clopper-Pearson lower bounds) on the real mechanism: each of
    10 rounds draws the target with chance p 0.25 in secret, the aggregate is the sum of the drawn updates plus
    each member's own noise (client-level mu 1), the target's update 0 (as the others') or 1 away. The exact
    likelihood-ratio test stays below the certified sampled_secret epsilon; an adversary who knows the members
    (a public ledger) exceeds it, and stays below the public-sample pair: why a secret sample's ledger holds
    counts only."""
    from fl_dp_flower.audit.attack import threshold_attack

    rng = np.random.default_rng(1)
    p, mu, rounds, delta, trials = 0.25, 1.0, 10, 1e-2, 100_000
    sd = 1.0 / mu

    def world(shift):
        member = rng.random((trials, rounds)) < p
        return np.where(member, shift, 0.0) + rng.normal(0.0, sd, (trials, rounds)), member

    def secret_llr(y):
        present = np.logaddexp(np.log(p) - (y - 1.0) ** 2 / (2 * sd * sd), np.log1p(-p) - y * y / (2 * sd * sd))
        return (present + y * y / (2 * sd * sd)).sum(axis=1)

    def public_llr(y, member):
        return (member * y / (sd * sd)).sum(axis=1)

    (s0, m_s0), (e0, m_e0), (e1, m_e1) = world(0.0), world(0.0), world(1.0)
    fprs = (0.2, 0.1, 0.05, 0.02, 0.01, 0.005, 0.002)
    secret = threshold_attack(secret_llr(s0), secret_llr(e0), secret_llr(e1), delta=delta, fprs=fprs)
    public = threshold_attack(public_llr(s0, m_s0), public_llr(e0, m_e0), public_llr(e1, m_e1), delta=delta, fprs=fprs)
    certified_secret = conditioned_epsilon([(p, mu)] * rounds, delta)
    certified_public = composed_epsilon(p, [mu] * rounds, delta)
    assert 0.7 * certified_secret < secret.epsilon_lower <= certified_secret
    assert certified_secret + 0.5 < public.epsilon_lower <= certified_public


@pytest.mark.parametrize("secrecy", ["public", "secret"])
def test_a_round_too_wide_for_the_pld_gives_the_amplified_bound_up_never_an_undercount(secrecy):
    """A round whose mu_t exceeds MU_PLD_LIMIT (here the coalition leaves the target's own noise only, mu_t 4)
    would take seconds to minutes a round to compose: the amplified bound is given up (epsilon inf) from that
    round on, and the run is certified by its other sound bounds, which are never below the amplified value."""
    name = CONDITIONED_BOUND if secrecy == "secret" else "sampled"
    wide = _config(sampling_rate=0.25, sample_secrecy=secrecy, colluders=899, sigma=1.0)  # mu_t = 4 / 1.0
    accountant = PrivacyAccountant(wide)
    narrow = _poisson_records(2, 900, 3600, 900, sigma=4.0)  # mu_t = 4 / 4 = 1: composed
    accountant.extend(narrow)
    before = accountant.report()
    assert math.isfinite(before.bounds[name].epsilon) and before.certified_bound == name
    accountant.extend(_poisson_records(3, 900, 3600, 900, sigma=1.0)[2:])  # round 3 at mu_t 4: too wide
    after = accountant.report()
    assert after.bounds[name].epsilon == math.inf and after.certified_bound != name
    assert math.isfinite(after.certified.epsilon) and after.certified.epsilon >= before.certified.epsilon
    others = [b.epsilon for n, b in after.bounds.items() if b.sound and n != name]
    assert after.certified.epsilon == pytest.approx(min(others))  # the smallest of the other sound bounds

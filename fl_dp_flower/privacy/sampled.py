"""Amplification by Poisson client sampling: the ``sampled`` bound (docs/MATH.md §19).

It uses dp-accounting's privacy-loss-distribution (PLD) accountant, imported lazily (a run without client
sampling never loads it); :func:`gaussian_pld` builds the library's Gaussian PLD, bit for bit, faster.

Round t, with sampling rate q: every client of the population is in the round independently
with probability q, drawn by an honest server and unknown to the adversary in advance; the
aggregate is w_t + sum over the contributions that entered of (upload_i - w_t) / (q N_t).
Each client adds its own noise, so whether the target took part changes the aggregate's noise
variance; the textbook subsampled-Gaussian pair (equal variances) does not apply. The pair used
here never compares "target absent" with "target present" (docs/MATH.md §19.1):

    P_t = (1 - p_t) * bottom + p_t * N(mu_t, 1),   Q_t = (1 - p_t) * bottom + p_t * N(0, 1),
    mu_t = Gamma_t / (sigma * sqrt(max(1, n_t - c))),   p_t = min(1, k_t / (N_t - c)),

with n_t the contributions that entered the sum (dropouts independent of the data), c the
colluding clients and Gamma_t one client's sensitivity (parameter units, as sigma). p_t is the
target's chance of being in the round given the published counts (k_t drawn of N_t; issue 28 item 4;
q for a record without them). Its hockey-stick divergence is p_t times the Gaussian's at every gamma >= 1; composed over the rounds by
dp-accounting's PLD (pessimistic discretisation, interval :data:`DISCRETIZATION` in nats). A
round in which nothing entered the sum costs the pair with n_t = 0 (mu_t = Gamma_t/sigma).

The bound certifies only the all-rounds threat model (never local DP: the server knows the
sample) and rests on :func:`sampler_assumption`, stated wherever it is printed.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np

from .bounds import BoundValue
from .client_sampling import inclusion_probability
from .pld_rounds import RoundByRoundPLD, compose_runs, epsilon_at, too_wide
from .records import RoundRecord
from .terms import RoundTerms
from .validate import int_at_least, positive

__all__ = ["DISCRETIZATION", "SAMPLED_BOUND", "SampledAccount", "SampledComposition", "composed_epsilon",
           "composed_pairs_epsilon", "gaussian_pld", "round_mu", "sampler_assumption"]

#: the name of the amplified bound in a report's ``bounds``
SAMPLED_BOUND = "sampled"
#: PLD value discretisation interval (nats): the pessimistic rounding adds at most this per round to epsilon
DISCRETIZATION = 1e-4


def sampler_assumption(sampling_rate: float) -> str:
    """The trust assumption of the ``sampled`` bound, printed next to it (``BoundValue.assumes``)."""
    return (f"honest server-side Poisson sampler (q = {sampling_rate:g}): each client in a round independently "
            "with probability q, the sample unknown to the adversary in advance (a fixed seed makes it "
            "predictable: experiments only); dropouts independent of the data")


def round_mu(client_sensitivity: float, sigma: float, contributions: int, colluders: int) -> float:
    """mu_t = Gamma_t / (sigma * sqrt(max(1, n_t - c))) of one sampled round (dimensionless).

    ``client_sensitivity`` Gamma_t and ``sigma`` in parameter units; ``contributions`` n_t >= 0
    (0: nothing entered the sum, the target alone could have); ``colluders`` c >= 0."""
    int_at_least("contributions", contributions, 0)
    int_at_least("colluders", colluders, 0)
    positive("sigma", sigma)
    return float(client_sensitivity) / (float(sigma) * math.sqrt(max(1, contributions - colluders)))


@functools.lru_cache(maxsize=1)
def _array_gaussian_loss() -> Any:
    """dp-accounting's ``GaussianPrivacyLoss`` with its grid's cutoffs found as one array (see :func:`gaussian_pld`)."""
    from dp_accounting.pld import privacy_loss_mechanism as plm

    class ArrayGaussianLoss(plm.GaussianPrivacyLoss):  # type: ignore[misc]
        def get_delta_for_epsilon(self, epsilon: Any) -> Any:
            if self.sampling_prob != 1.0 or self.adjacency_type != plm.AdjacencyType.REMOVE or np.ndim(epsilon) != 1:
                return super().get_delta_for_epsilon(epsilon)
            # the library's own lines for sampling probability 1 and REMOVE, its cutoff formula applied elementwise
            epsilons = np.asarray(epsilon)
            x_cutoffs = np.asarray(self._inverse_privacy_loss_without_subsampling_remove(epsilons), dtype=float)
            deltas = np.zeros_like(epsilons, dtype=float)
            deltas[:] = self.mu_upper_cdf(x_cutoffs) - np.exp(epsilons + self.mu_lower_log_cdf(x_cutoffs))
            return np.clip(deltas, 0, 1)

    return ArrayGaussianLoss


def _builder(pld: Any) -> Any:
    """dp-accounting's construction of a PLD from a monotone privacy loss (None where this version lacks it)."""
    return getattr(pld, "_create_pld_pmf_from_monotone_privacy_loss", None)


def gaussian_pld(mu: float, interval: float = DISCRETIZATION) -> Any:
    """dp-accounting's ``from_gaussian_mechanism(1.0, sensitivity=mu, value_discretization_interval=interval)``
    (pessimistic connect-the-dots, log mass truncation -50, no subsampling), bit for bit, built faster.

    It runs the library's own construction on the library's own ``GaussianPrivacyLoss``; the one difference is
    that the library's ``get_delta_for_epsilon`` finds each grid point's cutoff x = -mu/2 - eps/mu in a Python
    loop (about 150,000 calls for mu near 1 at 1e-4 nats: most of a build's time), and here the same formula
    (a product, a quotient and a subtraction of IEEE doubles, each correctly rounded) is evaluated on the whole
    array at once, which rounds every element as the loop does. Nothing is approximated, no number changes
    (tests/privacy/test_accounting_cost.py compares the PMFs with the library's). Where the library lacks the
    construction (another dp-accounting layout) it is ``from_gaussian_mechanism`` itself: slower, never different.
    """
    from dp_accounting.pld import privacy_loss_distribution as pld
    from dp_accounting.pld import privacy_loss_mechanism as plm

    create = _builder(pld)
    if create is None:
        return pld.from_gaussian_mechanism(1.0, sensitivity=mu, value_discretization_interval=interval)
    loss = _array_gaussian_loss()(1.0, sensitivity=mu, pessimistic_estimate=True, log_mass_truncation_bound=-50,
                                  sampling_prob=1.0, adjacency_type=plm.AdjacencyType.REMOVE)
    return pld.PrivacyLossDistribution(create(loss, pessimistic_estimate=True, value_discretization_interval=interval,
                                              use_connect_dots=True))


def _round_pld(sampling_rate: float, mu: float) -> Any:
    """The PLD of one round's pair (q, mu): q * Gaussian(mu) + (1 - q) * no loss."""
    from dp_accounting.pld import privacy_loss_distribution as pld

    if mu == 0.0 or sampling_rate == 0.0:
        return pld.identity(DISCRETIZATION)
    gaussian = gaussian_pld(mu, DISCRETIZATION)  # dp-accounting's from_gaussian_mechanism, bit for bit
    if sampling_rate >= 1.0:
        return gaussian
    return gaussian.compute_mixture(pld.identity(DISCRETIZATION), sampling_rate)


def _pair_pld(key: tuple[float, float]) -> Any:
    return _round_pld(*key)


@dataclass
class SampledComposition:
    """The composed PLD of the rounds so far (amortised: one convolution per round).

    ``push(mu)`` accounts a round, ``peek(mu)`` the composition after one more without changing
    anything (the result is kept, so the ``push`` that usually follows reuses it).
    """

    sampling_rate: float
    mus: list[float] = field(default_factory=list)
    rates: list[float] = field(default_factory=list)
    _plds: RoundByRoundPLD[tuple[float, float]] = field(
        default_factory=lambda: RoundByRoundPLD(_pair_pld, too_wide=too_wide), init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        q = positive("sampling_rate", self.sampling_rate)
        if q > 1.0:
            raise ValueError(f"sampling_rate must be in (0, 1], got {q!r}")

    def _key(self, mu: float, rate: float | None) -> tuple[float, float]:
        p = self.sampling_rate if rate is None else float(rate)
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"rate must be in [0, 1], got {rate!r}")
        return p, float(positive("mu", mu) if mu != 0.0 else 0.0)

    def peek(self, mu: float, rate: float | None = None) -> Any:
        """The composed PLD after one more round with ``mu`` and the target's chance ``rate`` of being
        in it (default: the sampling rate q)."""
        return self._plds.peek(self._key(mu, rate))

    def push(self, mu: float, rate: float | None = None) -> None:
        p, m = self._key(mu, rate)
        self._plds.push((p, m))
        self.mus.append(m)
        self.rates.append(p)

    def epsilon(self, delta: float, pld: Any = None) -> float:
        """epsilon (nats) at ``delta`` of the rounds so far (or of ``pld``, e.g. a :meth:`peek`); 0 before any round."""
        return self._plds.epsilon(delta, pld)

    def delta(self, epsilon: float) -> float:
        """delta at ``epsilon`` (nats) of the rounds so far; 0 before any round."""
        return self._plds.delta(epsilon)

    def mu_clt(self, extra: tuple[float, float] | None = None) -> float:
        """sqrt(sum_t p_t mu_t^2): the central-limit approximation of the composed pairs (Dong, Roth
        and Su, Theorem 3.5); an approximation, NOT a bound (the exact tail is heavier)."""
        pairs = list(zip(self.rates, self.mus)) + ([] if extra is None else [extra])
        return math.sqrt(math.fsum(p * m * m for p, m in pairs))


@dataclass
class SampledAccount:
    """The ``sampled`` bound of a run under both relations (replace-one, add/remove-one), fed by the
    accountant with each round's terms and realized contributions n_t."""

    sampling_rate: float
    colluders: int
    replace_one: SampledComposition = field(init=False)
    add_remove: SampledComposition = field(init=False)

    def __post_init__(self) -> None:
        self.replace_one = SampledComposition(self.sampling_rate)
        self.add_remove = SampledComposition(self.sampling_rate)

    def rate(self, record: RoundRecord) -> float:
        """The target's chance of being in the round given what is published (issue 28 item 4): k_t / (N_t - c)
        for a round that drew k_t of N_t clients (the count is in the ledger), q for a record without them."""
        if record.population is None:
            return self.sampling_rate
        drawn = len(record.weights) if record.sampled is None else max(record.sampled, len(record.weights))
        return inclusion_probability(drawn, record.population, self.colluders)

    def _mus(self, contributions: int, terms: RoundTerms) -> tuple[float, float]:
        return (round_mu(terms.client_sensitivity, terms.sigma, contributions, self.colluders),
                round_mu(terms.client_sensitivity_add_remove, terms.sigma, contributions, self.colluders))

    def push(self, record: RoundRecord, terms: RoundTerms) -> None:
        mu, mu_ar = self._mus(record.clients, terms)
        p = self.rate(record)
        self.replace_one.push(mu, p)
        self.add_remove.push(mu_ar, p)

    def peek(self, record: RoundRecord, terms: RoundTerms,
             add_remove_too: bool = True) -> tuple[Any, Any, tuple[float, float]]:
        """(PLD, add/remove PLD, (p_t, mu_t)) after one more round, nothing changed; ``add_remove_too=False``:
        the add/remove PLD is not composed (None; only for :meth:`amend` with ``add_remove_too=False``)."""
        mu, mu_ar = self._mus(record.clients, terms)
        p = self.rate(record)
        return self.replace_one.peek(mu, p), self.add_remove.peek(mu_ar, p) if add_remove_too else None, (p, mu)

    def amend(self, bounds: dict[str, BoundValue], add_remove: dict[str, Any], threat_model: str, delta: float,
              trial: tuple[Any, Any, tuple[float, float]] | None = None, add_remove_too: bool = True) -> dict[str, Any]:
        """Add the ``sampled`` bound to a report's ``bounds`` (its mu: the composition mu, the Gaussian-DP
        parameter these rounds provably have; its epsilon: the PLD's), let it carry the add/remove-one
        guarantee where it certifies it (``add_remove_too=False``: ``add_remove`` is left as it is, for a
        caller that reads only the certified epsilon), and return the report's ``sampling`` section."""
        pld, pld_ar, extra = (None, None, None) if trial is None else trial
        composition = bounds["composition"]
        q = self.sampling_rate
        bounds[SAMPLED_BOUND] = BoundValue(mu=composition.mu, epsilon=self.replace_one.epsilon(delta, pld),
                                           sound=True, assumes=(*composition.assumes, sampler_assumption(q)))
        if add_remove_too and threat_model == "all-rounds" and add_remove.get("bound") == "composition":
            eps_ar = self.add_remove.epsilon(delta, pld_ar)
            if eps_ar < add_remove["epsilon"]:
                add_remove.update(bound=SAMPLED_BOUND, epsilon=eps_ar)
        return {"rate": q, "weight": "k_t / (N_t - c) per round (the published count)", "bound": SAMPLED_BOUND,
                "certified_for": "all-rounds",
                "epsilon_without_amplification": composition.epsilon,
                "mu_clt": self.replace_one.mu_clt(extra),
                "mu_clt_is": "central-limit approximation of the amplified rounds, not a bound",
                "assumes": sampler_assumption(q)}


def composed_epsilon(sampling_rate: float, mus: list[float], delta: float) -> float:
    """epsilon at ``delta`` of the pairs (q, mu_t) composed (runs of equal mu self-composed: fast for
    planned schedules; equal to round-by-round composition up to the discretisation)."""
    return epsilon_at(compose_runs(mus, lambda mu: _round_pld(sampling_rate, mu)), delta)


def composed_pairs_epsilon(pairs: Sequence[tuple[float, float]], delta: float) -> float:
    """epsilon (nats) at ``delta`` of the pairs (p_t, mu_t) composed (the target's chance p_t of being in round
    t, as :meth:`SampledAccount.rate` gives it); runs of equal pairs self-composed."""
    return epsilon_at(compose_runs(list(pairs), _pair_pld), delta)

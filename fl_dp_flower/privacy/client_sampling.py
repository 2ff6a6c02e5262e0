"""Client sampling with a secret sample: the bound conditioned on the round's count (docs/MATH.md §22).

Each client adds its own noise N(0, sigma^2 I) to its upload, so given the number n_t of uploads
that entered round t's sum the aggregate's noise variance is n_t sigma^2 whoever they were. If the
contributors are a uniformly random n_t-subset of the N_t clients of the population and the
adversary does not learn which (a *secret* sample), the round is sampling without replacement
with rate p_t = n_t / N_t applied to a Gaussian mechanism on the subset, and Dong, Roth and Su
(2022, Theorem 4.2) give the trade-off function

    C_p(G_mu) = min{f_p, f_p^{-1}}**,   f_p = p G_mu + (1 - p) Id,
    mu_t = Gamma^client_t / (sigma sqrt(max(1, n_t - c))).

Gamma^client_t is the **client-level** sensitivity (one client's whole update replaced by another
client's: the coupling of the theorem puts another client in the target's seat), the clip-only
2V sum_k eta_k (FedAvg; FedProx: 2V(1 - prod_k(1 - eta_k alpha))/alpha): it holds for replace-one
and add/remove-one alike. With c colluders the adversary knows which colluders were drawn; the
rest are a uniform subset of the N_t - c others, so p_t = min(1, k_t / (N_t - c)) with k_t the
count drawn (>= n_t) and the noise the colluders cannot subtract sigma^2 (n_t - c) at least; the
trade-off is monotone in p and mu, so both upper bounds give a valid round.

The per-round pair (P, Q) built here has trade-off exactly C_p(G_mu): on {y >= mu/2} it is the
pair ((1 - p) N(0, 1) + p N(mu, 1), N(0, 1)) (privacy loss >= 0), mirrored (P and Q swapped, loss
<= 0), and an atom common to both holding the remaining mass. It is symmetric, so it dominates
every ordered pair of neighbouring datasets at every hockey-stick order (the order < 1 by the
swap), and the rounds compose by dp-accounting's PLD (its pessimistic connect-the-dots discretisation of
the exact privacy profile, interval :data:`DISCRETIZATION` nats). tests/privacy/test_secret_sample.py checks it against an
mpmath trade-off curve and a Monte-Carlo estimate.

The textbook subsampled Gaussian with one shared noise draw is NOT used: per-client noise makes
presence change the noise variance, and that pair is unsound here (issue 31).

With a *public* sample (the ledger names each round's members) the conditioned analysis does not
apply; :mod:`sampled` certifies the public-sample pair with the same p_t (issue 28 item 4: the
count is published, so the target's chance is k_t / N_t, not q).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
from scipy import special

from .pld_rounds import RoundByRoundPLD, compose_runs, epsilon_at, too_wide
from .records import RoundRecord
from .terms import _fedprox_parts
from .validate import int_at_least, nonnegative

__all__ = ["CONDITIONED_BOUND", "DISCRETIZATION", "ConditionedComposition", "client_level_sensitivity",
           "SecretSampleAccount", "conditioned_epsilon", "conditioned_pld", "inclusion_probability", "privacy_profile",
           "secret_sample_assumption"]

#: the name of the conditioned (secret-sample) bound in a report's ``bounds``
CONDITIONED_BOUND = "sampled_secret"
#: PLD value discretisation interval (nats); every loss is rounded up to this grid
DISCRETIZATION = 1e-4
#: standard deviations beyond mu covered before the rest of P's mass is put at infinite loss
_TAIL_SD = 9.0


def secret_sample_assumption(population: int | None = None) -> str:
    """The trust assumption of the conditioned bound, printed wherever it is."""
    where = "" if population is None else f" of N = {population}"
    return ("secret sample: an honest server-side sampler draws each round's clients at random"
            f"{where} (Poisson or fixed-size), the adversary never learns which clients took part (the "
            "ledger and metrics publish counts only; the server's log and the app's members.jsonl and "
            "summary.json name clients and stay with the server's owner), and dropouts are independent of "
            "the data and of who was drawn; a fixed seed makes the sample predictable (experiments only)")


def inclusion_probability(drawn: int, population: int, colluders: int = 0) -> float:
    """p_t = min(1, k_t / (N_t - c)): the target's chance of being in a round that drew k_t of N_t
    clients, given the count and which of the c colluders were drawn."""
    k = int_at_least("drawn", drawn, 0)
    n = int_at_least("population", population, 1)
    c = int_at_least("colluders", colluders, 0)
    if k > n:
        raise ValueError(f"drawn must be an integer in [0, population = {n}], got {k!r}")
    return 1.0 if n - c <= 0 else min(1.0, k / (n - c))


def client_level_sensitivity(record: RoundRecord) -> float:
    """Gamma^client_t: how far one client's upload can move when its whole data set is replaced by
    another client's (parameter units): 2V sum_k eta_k for FedAvg (every step's clipped gradient,
    per-sample average or per-batch, has norm <= V), 2V(1 - prod_k(1 - eta_k alpha))/alpha for FedProx
    (the prox term contracts the difference; eta_k <= 1/alpha as :func:`terms.round_terms` checks)."""
    v = float(record.clip_norm)
    if record.algorithm == "fedprox" and record.prox_alpha is not None:
        alpha = float(record.prox_alpha)
        frac, _ = _fedprox_parts(np.asarray(record.step_sizes, dtype=float), alpha, 0.0)
        return 2.0 * v * frac / alpha
    return 2.0 * v * math.fsum(record.step_sizes)


def _survival(x: np.ndarray) -> np.ndarray:
    return np.asarray(special.ndtr(-x))


def privacy_profile(p: float, mu: float, epsilons: np.ndarray) -> np.ndarray:
    """delta(eps) of the symmetric pair with trade-off C_p(G_mu), at every ``epsilons`` (any sign).

    eps >= 0: H_{e^eps}(P || Q) = p Phi_bar(y - mu) - (e^eps - 1 + p) Phi_bar(y), y = L^{-1}(eps) =
    (log(1 + (e^eps - 1)/p) + mu^2/2)/mu (0 outside the loss's range); eps < 0 by the symmetry
    delta(eps) = 1 - e^eps + e^eps delta(-eps)."""
    eps = np.asarray(epsilons, dtype=float)
    a = np.abs(eps)
    y = (np.log1p(np.expm1(a) / p) + mu * mu / 2.0) / mu
    y = np.where(a == 0.0, mu / 2.0, y)
    upper = np.maximum(p * _survival(y - mu) - (np.expm1(a) + p) * _survival(y), 0.0)
    return np.asarray(np.where(eps >= 0.0, upper, np.clip(-np.expm1(eps) + np.exp(eps) * upper, 0.0, 1.0)))


def conditioned_pld(p: float, mu: float, interval: float = DISCRETIZATION) -> Any:
    """The PLD of one round's symmetric pair with trade-off C_p(G_mu): pessimistic connect-the-dots
    (Doroshenko et al. 2022) on the grid of ``interval`` nats from its exact privacy profile; the P-mass
    of losses beyond mu + 9 standard deviations is put at infinite loss (the top) or at the grid's
    lowest loss (the bottom, rounded up)."""
    from dp_accounting.pld import pld_pmf
    from dp_accounting.pld import privacy_loss_distribution as pld

    p, mu = float(p), float(nonnegative("mu", mu))
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"p must be in [0, 1], got {p!r}")
    if p == 0.0 or mu == 0.0:
        return pld.identity(interval)
    top = float(np.log1p(p * np.expm1(mu * (mu + _TAIL_SD) - mu * mu / 2.0)))
    k_max = max(1, math.ceil(top / interval))
    grid = np.arange(-k_max, k_max + 1)
    pmf = pld_pmf.create_pmf_pessimistic_connect_dots(interval, grid, privacy_profile(p, mu, grid * interval))
    return pld.PrivacyLossDistribution(pmf)


@dataclass
class ConditionedComposition:
    """The composed PLD of the rounds (p_t, mu_t) so far, one convolution per round (``push``), with a
    side-effect-free ``peek`` whose result the following ``push`` reuses (:class:`pld_rounds.RoundByRoundPLD`)."""

    rounds: list[tuple[float, float]] = field(default_factory=list)
    _plds: RoundByRoundPLD[tuple[float, float]] = field(
        default_factory=lambda: RoundByRoundPLD(_round_pld, too_wide=too_wide), init=False, repr=False, compare=False)

    def peek(self, p: float, mu: float) -> Any:
        """The composed PLD after one more round (p, mu), nothing changed."""
        return self._plds.peek((float(p), float(mu)))

    def push(self, p: float, mu: float) -> None:
        self._plds.push((float(p), float(mu)))
        self.rounds.append((float(p), float(mu)))

    def epsilon(self, delta: float, pld: Any = None) -> float:
        """epsilon (nats) at ``delta`` of the rounds so far (or of ``pld``, e.g. a :meth:`peek`); 0 before any."""
        return self._plds.epsilon(delta, pld)

    def delta(self, epsilon: float) -> float:
        """delta at ``epsilon`` (nats) of the rounds so far; 0 before any round."""
        return self._plds.delta(epsilon)


def _round_pld(key: tuple[float, float]) -> Any:
    return conditioned_pld(*key)


def conditioned_epsilon(rounds: Sequence[tuple[float, float]], delta: float) -> float:
    """epsilon at ``delta`` of the rounds (p_t, mu_t) composed; runs of equal rounds are self-composed
    (fast for planned runs; equal to round-by-round composition up to the discretisation)."""
    return epsilon_at(compose_runs(rounds, _round_pld), delta)


def _uniform(weights: Sequence[float]) -> bool:
    return all(math.isclose(w, weights[0], rel_tol=1e-9) for w in weights)


@dataclass
class SecretSampleAccount:
    """The ``sampled_secret`` bound of a run (sample_secrecy "secret", all-rounds threat model): each
    round's (p_t, mu_t) from its record and terms, composed; one value for replace-one and add/remove-one
    (the client-level sensitivity bounds both)."""

    colluders: int
    composition: ConditionedComposition = field(default_factory=ConditionedComposition)

    def round(self, record: RoundRecord, terms: Any) -> tuple[float, float]:
        """(p_t, mu_t) of a round. Nothing in the sum: (0, 0), free. No population on the record, a
        non-uniform average, or p_t = 1: the target counted in the round, composition's own round
        (p = 1, mu = gamma_t / s_t)."""
        n = len(record.weights)
        if n == 0:
            return 0.0, 0.0
        full = (1.0, float(terms.gamma) / float(terms.target_noise_std))
        if record.population is None or not _uniform(record.weights):
            return full
        drawn = n if record.sampled is None else max(record.sampled, n)
        p = inclusion_probability(drawn, record.population, self.colluders)
        if p >= 1.0:
            return full
        return p, client_level_sensitivity(record) / (float(record.sigma) * math.sqrt(max(1, n - self.colluders)))

    def push(self, record: RoundRecord, terms: Any) -> None:
        self.composition.push(*self.round(record, terms))

    def peek(self, record: RoundRecord, terms: Any) -> Any:
        return self.composition.peek(*self.round(record, terms))

    def amend(self, bounds: dict[str, Any], add_remove: dict[str, Any], sampling: dict[str, Any], delta: float,
              trial: Any = None) -> dict[str, Any]:
        """Add the ``sampled_secret`` bound to a report's ``bounds`` (its mu: composition's), let it carry the
        add/remove-one guarantee where smaller, and return the report's ``sampling`` section with the secrecy."""
        from .bounds import BoundValue

        composition = bounds["composition"]
        epsilon = self.composition.epsilon(delta, trial)
        assumption = secret_sample_assumption()
        bounds[CONDITIONED_BOUND] = BoundValue(mu=composition.mu, epsilon=epsilon, sound=True,
                                               assumes=(*composition.assumes, assumption))
        if epsilon < add_remove["epsilon"]:
            add_remove.update(bound=CONDITIONED_BOUND, epsilon=epsilon)
        return {**sampling, "secrecy": "secret", "conditioned_bound": CONDITIONED_BOUND,
                "epsilon_secret_sample": epsilon, "secret_sample_assumes": assumption}

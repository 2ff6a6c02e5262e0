"""Amplification by Poisson sampling of the local batches on the node: the ``batch_sampled`` bound
(docs/MATH.md §23).

With ``batch-sampling = "poisson"`` a node draws every local step's batch by including each of its n
samples independently with probability q = B/n (B: the instruction's batch size), from randomness
that never leaves the node, clips every per-sample gradient to V, divides their sum by the EXPECTED
batch size B (not the realized one) and clips that step gradient to V again (a projection, so the
per-sample bounds below are kept). Fix everything random except the target sample's memberships
(the other samples' draws, the other sites' batches and dropouts, independent of the data): then the
release with the target in no batch is the same in both neighbouring worlds, and with the target in
some batch it is a Gaussian whose mean moves by at most r_t (in units of the noise std) from that
common one. This is the textbook Poisson-subsampled Gaussian mechanism, per round:

- K = 1 (exact, no L): rate q, r_t = eta V / B times the target's weight over the noise that hides it,
  i.e. ``RoundTerms.gamma_add_remove / target_noise_std`` (all-rounds, c colluding sites) or
  ``client_sensitivity_add_remove / sigma`` (curious server). Replace-one and add/remove-one both
  use dp-accounting's pair of that relation with noise multiplier 1/r_t (its REPLACE_ONE pair
  moves each of the two worlds by r_t from the common component: the replace-one distance 2 eta V/B).
- K >= 2 (sound without L): the target enters some batch of the round with probability
  1 - (1 - q)^K, and then the run moves by at most the clip-only add/remove sensitivity
  eta_0 V/B + 2V sum_{k>=1} eta_k (FedProx: its telescoped clip-only value); the same pair with that
  rate and that r_t. Nothing here rests on L; anything tighter would, and is not offered.

Rounds compose by dp-accounting's PLD accountant (pessimistic discretisation of :data:`DISCRETIZATION`
nats, so the epsilon it returns is an upper bound). The bound is certified for ``all-rounds`` and
``curious-server`` only, needs per-sample clipping and rests on :func:`batch_assumption`, stated wherever
it is printed. With Poisson client sampling (docs/MATH.md §23.4) every round is charged this pair at the
round's own contributor count k_t (its record's uniform weights 1/k_t: r_t = eta V/B / (sigma
sqrt(max(k_t - c, 1))), the fixed denominator q N cancels); nothing is claimed for the client sampling.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

from .bounds import BoundValue
from .pld_rounds import RoundByRoundPLD, compose_runs, epsilon_at
from .records import AccountantConfig, RoundRecord
from .terms import RoundTerms, round_terms
from .validate import int_at_least, positive

__all__ = ["AMPLIFIED_THREAT_MODELS", "BATCH_SAMPLED_BOUND", "BatchSampledAccount", "BatchSampledComposition",
           "DISCRETIZATION", "NO_CLIENT_CREDIT", "batch_assumption", "batch_sampled_sigma", "composed_epsilon", "inclusion_rate",
           "round_pair", "unrecorded_round_rate"]

#: the name of the amplified bound in a report's ``bounds``
BATCH_SAMPLED_BOUND = "batch_sampled"
#: PLD value discretisation interval (nats); pessimistic rounding adds at most this per round to epsilon
DISCRETIZATION = 1e-4
#: the threat models whose bound the amplification applies to (their unamplified bound in brackets)
AMPLIFIED_THREAT_MODELS: dict[str, str] = {"all-rounds": "composition", "curious-server": "local_dp"}
_RELATIONS = ("replace-one", "add/remove-one")


#: what the ``batch_sampled`` bound says it does not claim when clients are Poisson-sampled too (docs/MATH.md §23.4)
NO_CLIENT_CREDIT = ("no credit for client sampling: every round is charged as if the target's client took part, "
                    "at the round's own contributor count")


def batch_assumption(rate: float, client_sampled: bool = False) -> str:
    """The trust assumption of the ``batch_sampled`` bound, printed next to it (``BoundValue.assumes``);
    ``client_sampled``: clients are Poisson-sampled too, and the bound says it claims nothing for that."""
    text = (f"honest node: each local step's batch Poisson-sampled on the node (each sample independently, "
            f"rate q = B/n <= {rate:g}), from randomness that never leaves the node and is unknown to the "
            "adversary (a fixed seed makes it predictable: experiments only); nothing else the node sends or does "
            "depends on the batches drawn (a realized batch's size shows in its training time: the reply's timing, "
            "and whether it arrives before round-timeout, must not reveal it)")
    return f"{text}; {NO_CLIENT_CREDIT}" if client_sampled else text


def inclusion_rate(rate: float, local_steps: int) -> float:
    """1 - (1 - q)^K: the chance that a sample enters at least one of the K Poisson batches of a round."""
    q = positive("rate", rate)
    if q > 1.0:
        raise ValueError(f"rate must be in (0, 1], got {q!r}")
    k = int_at_least("local_steps", local_steps, 1)
    return 1.0 if q == 1.0 else min(1.0, -math.expm1(k * math.log1p(-q)))


def unrecorded_round_rate(config: AccountantConfig) -> float | None:
    """The batch rate to charge a round whose replies were never recorded (an unfinished round a resume
    accounts, docs/MATH.md §20.5): the planned ``batch_rate`` is no bound on the rates B/n_i the sites drew at
    (a site with fewer samples than planned echoes a larger one, and is accounted at it), so where the adversary
    saw the uploads (``curious-server``) the round is charged without amplification (None: q = 1). Under
    ``all-rounds`` the round's aggregate was never broadcast (nothing was released), so the planned rate stays."""
    if config.batch_rate is None or config.threat_model != "curious-server":
        return config.batch_rate
    return None


def round_pair(record: RoundRecord, terms: RoundTerms, threat_model: str) -> tuple[float, float]:
    """(sampling probability p_t, per-sample shift r_t in noise stds) of one round's subsampled Gaussian.

    ``terms`` must be the record's clip-only terms (``assume_smooth_losses=False``). A round that is not
    Poisson-sampled with per-sample clipping (``record.batch_rate`` None, per-batch clipping) gets
    p_t = 1 and the replace-one / add/remove distances of the unamplified bound, so it never costs less
    than without sampling. A round nothing was uploaded in costs nothing (r_t = 0): its release does not
    depend on the data. With Poisson client sampling the record's weights are 1/k_t over the k_t
    contributions that entered the fixed-denominator sum, so the all-rounds r_t is the shift over the
    noise at the round's own k_t (the denominator q N cancels; k_t <= c: the target's own noise)."""
    if threat_model not in AMPLIFIED_THREAT_MODELS:
        raise ValueError(f"threat_model must be one of {tuple(AMPLIFIED_THREAT_MODELS)}, got {threat_model!r}")
    if not record.weights:
        return 1.0, 0.0
    local = threat_model == "curious-server"
    num = terms.client_sensitivity_add_remove if local else terms.gamma_add_remove
    ro = terms.client_sensitivity if local else terms.gamma
    noise = terms.sigma if local else terms.target_noise_std
    if record.batch_rate is None or record.clipping != "per-sample":
        # no amplification: the replace-one pair moves both worlds by r from a common point, i.e. 2r apart;
        # r = max(add/remove shift, replace-one distance / 2) keeps both relations at least as charged
        return 1.0, max(num, ro / 2.0) / noise
    return inclusion_rate(record.batch_rate, record.local_steps), num / noise


def _round_pld(relation: str, p: float, r: float, discretization: float = DISCRETIZATION) -> Any:
    from dp_accounting import NeighboringRelation
    from dp_accounting.pld import privacy_loss_distribution as pld

    if r == 0.0:
        return pld.identity(discretization)
    rel = NeighboringRelation.REPLACE_ONE if relation == "replace-one" else NeighboringRelation.ADD_OR_REMOVE_ONE
    return pld.from_gaussian_mechanism(1.0 / r, sensitivity=1.0, sampling_prob=p, neighboring_relation=rel,
                                       value_discretization_interval=discretization)


@dataclass
class BatchSampledComposition:
    """The composed PLD of the rounds so far under one relation (one convolution per round); ``peek``
    composes one more round without changing anything (kept for the ``push`` that usually follows)."""

    relation: str
    _plds: RoundByRoundPLD[tuple[float, float]] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.relation not in _RELATIONS:
            raise ValueError(f"relation must be one of {_RELATIONS}, got {self.relation!r}")
        relation = self.relation
        self._plds = RoundByRoundPLD(lambda pair: _round_pld(relation, *pair))

    @property
    def count(self) -> int:
        """The rounds pushed so far."""
        return self._plds.count

    def peek(self, pair: tuple[float, float]) -> Any:
        """The composed PLD after one more round with ``pair`` (p_t, r_t), nothing changed."""
        return self._plds.peek(pair)

    def push(self, pair: tuple[float, float]) -> None:
        self._plds.push(pair)

    def epsilon(self, delta: float, pld: Any = None) -> float:
        """epsilon (nats) at ``delta`` of the rounds so far (or of ``pld``, e.g. a :meth:`peek`); 0 before any round."""
        return self._plds.epsilon(delta, pld)

    def delta(self, epsilon: float) -> float:
        """delta at ``epsilon`` (nats) of the rounds so far; 0 before any round."""
        return self._plds.delta(epsilon)


@dataclass
class BatchSampledAccount:
    """The ``batch_sampled`` bound of a run under both relations, fed by the accountant with each
    round's record (its clip-only terms are recomputed here: the drift bound of L is never used)."""

    threat_model: str
    smoothness: float
    colluders: int
    client_sampled: bool = False  # Poisson client sampling too: no credit claimed for it (docs/MATH.md §23.4)
    replace_one: BatchSampledComposition = field(init=False)
    add_remove: BatchSampledComposition = field(init=False)
    max_rate: float = field(init=False, default=0.0)

    def __post_init__(self) -> None:
        if self.threat_model not in AMPLIFIED_THREAT_MODELS:
            raise ValueError(f"batch sampling amplifies only {tuple(AMPLIFIED_THREAT_MODELS)}, "
                             f"not threat_model {self.threat_model!r}")
        self.replace_one = BatchSampledComposition("replace-one")
        self.add_remove = BatchSampledComposition("add/remove-one")

    def pair(self, record: RoundRecord, terms: RoundTerms) -> tuple[float, float]:
        if terms.uses_smoothness:
            terms = round_terms(record, self.smoothness, self.colluders, assume_smooth_losses=False)
        return round_pair(record, terms, self.threat_model)

    def push(self, record: RoundRecord, terms: RoundTerms) -> None:
        pair = self.pair(record, terms)
        self.replace_one.push(pair)
        self.add_remove.push(pair)
        self.max_rate = max(self.max_rate, record.batch_rate or 1.0)

    def peek(self, record: RoundRecord, terms: RoundTerms, add_remove_too: bool = True) -> tuple[Any, Any, float]:
        """(PLD, add/remove PLD, max rate) after one more round; ``add_remove_too=False``: no add/remove PLD (None)."""
        pair = self.pair(record, terms)
        return (self.replace_one.peek(pair), self.add_remove.peek(pair) if add_remove_too else None,
                max(self.max_rate, record.batch_rate or 1.0))

    def amend(self, bounds: dict[str, BoundValue], add_remove: dict[str, Any], delta: float,
              trial: tuple[Any, Any, float] | None = None, add_remove_too: bool = True) -> dict[str, Any]:
        """Add the ``batch_sampled`` bound to a report's ``bounds`` (mu: the unamplified bound's, a valid
        Gaussian-DP parameter of these rounds; epsilon: the PLD's), let it carry the add/remove-one
        guarantee where smaller (``add_remove_too=False``: ``add_remove`` left as it is, for a caller that reads
        only the certified epsilon), and return the report's ``batch_sampling`` section."""
        pld, pld_ar, rate = (None, None, self.max_rate) if trial is None else trial
        base_name = AMPLIFIED_THREAT_MODELS[self.threat_model]
        base = bounds[base_name]
        assumption = batch_assumption(rate, self.client_sampled)
        assumes = (*base.assumes, assumption)
        bounds[BATCH_SAMPLED_BOUND] = BoundValue(mu=base.mu, epsilon=self.replace_one.epsilon(delta, pld),
                                                 sound=True, assumes=assumes)
        # the add/remove guarantee so far is a sound bound of this threat model (the unamplified one, or with
        # client sampling the sampled / sampled_secret one): the smaller of it and this one holds
        eps_ar = self.add_remove.epsilon(delta, pld_ar) if add_remove_too else math.inf
        if eps_ar < add_remove["epsilon"]:
            add_remove.update(bound=BATCH_SAMPLED_BOUND, epsilon=eps_ar)
        return {"sampling": "poisson", "max_rate": rate, "bound": BATCH_SAMPLED_BOUND,
                "certified_for": self.threat_model, "epsilon_without_amplification": base.epsilon,
                "assumes": assumption}


def composed_epsilon(relation: str, pairs: list[tuple[float, float]], delta: float,
                     discretization: float = DISCRETIZATION) -> float:
    """epsilon at ``delta`` of the rounds' pairs (p_t, r_t) composed (runs of equal pairs self-composed:
    fast for planned runs; equal to round-by-round composition up to the discretisation)."""
    return epsilon_at(compose_runs(pairs, lambda pair: _round_pld(relation, *pair, discretization)), delta)


def batch_sampled_sigma(config: AccountantConfig, rounds: int, target_epsilon: float) -> float:
    """The smallest sigma (to 1e-6 relative, rounded up) at which the replace-one ``batch_sampled`` epsilon of
    ``rounds`` planned rounds (rate ``config.batch_rate``) is <= ``target_epsilon``: every r_t is proportional to
    1/sigma and epsilon decreases in sigma, so a bisection on the planned pairs finds it."""
    int_at_least("rounds", rounds, 1)
    unit = dataclasses.replace(config, sigma=1.0)
    pairs = []
    for t in range(1, rounds + 1):
        record = unit.planned_round(t)
        pairs.append(round_pair(record, round_terms(record, unit.smoothness, unit.colluders), unit.threat_model))

    def fits(sigma: float, discretization: float = 1e-3) -> bool:  # coarse while searching, checked finely below
        eps = composed_epsilon("replace-one", [(p, r / sigma) for p, r in pairs], config.delta, discretization)
        return eps <= target_epsilon

    hi = 1.0
    while not fits(hi):
        hi *= 2.0
    lo = hi / 2.0
    while fits(lo) and lo > 1e-12:
        lo /= 2.0
    while hi - lo > 1e-4 * hi:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    while not fits(hi, DISCRETIZATION):  # the accountant's own discretisation decides
        hi *= 1.0 + 1e-4
    return hi

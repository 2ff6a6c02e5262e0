"""Immutable, validated inputs of the accountant: the planned configuration and the
record of one round as it actually ran.

Units and conventions (see docs/MATH.md §1, §13, §14):

- ``sigma``: per-client noise **standard deviation** (each client adds N(0, sigma^2 I)).
- ``clip_norm`` (V): L2 clipping norm of the local gradient (per batch) or of each
  per-sample gradient (per sample).
- ``step_sizes``: the K local step sizes eta_{k,t} used in the round.
- ``weights``: aggregation weights p_{t,i} of the clients whose replies were
  aggregated (>= 0, summing to 1). Uniform weights 1/m are the paper's model.
- ``smoothness`` (L): the smoothness constant of every (per-sample) loss. It enters the
  model-sensitivity factor rho_t of the final-model bound (and the paper's closed forms)
  and, only when ``assume_smooth_losses`` is set, the per-sample drift factor kappa;
  composition and local DP never depend on it otherwise (docs/MATH.md §13).
- ``assume_smooth_losses``: the operator's explicit assertion that every (per-sample)
  loss is L-smooth with the configured L. Without it no bound that depends on L
  (final_model, paper, per-sample theta < 1) may certify (docs/MATH.md §13, §15).
"""

from __future__ import annotations

import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any

from fl_dp_flower.vocabulary import (ALGORITHMS, BOUND_CHOICES, BOUND_NAMES, CLIPPING_MODES, SAMPLE_SECRECIES,
                                     SCHEDULES, THREAT_MODELS, Algorithm, BoundChoice, BoundName, Clipping,
                                     SampleSecrecy, Schedule, ThreatModel)

from .plan_rules import (SMOOTHNESS_FIELDS, batch_sampling_problems, check_prox,  # noqa: F401
                         colluder_problems, sampling_problems, secrecy_problems,
                         secure_sum_problems, smoothness_problems)
from .schedules import step_sizes
from .validate import choice, int_at_least, nonnegative, plausible_delta, positive

__all__ = ["ALGORITHMS", "BOUND_CHOICES", "BOUND_NAMES", "CLIPPING_MODES", "SCHEDULES", "SMOOTHNESS_FIELDS",
           "THREAT_MODELS", "AccountantConfig", "colluder_problems", "sampling_problems", "secrecy_problems", "secure_sum_problems",
           "smoothness_problems", "Algorithm", "BoundChoice", "BoundName", "Clipping", "RoundRecord", "Schedule", "ThreatModel"]


def _fields_of(cls: type, data: Any, what: str) -> dict[str, Any]:
    """``data`` as keyword arguments of dataclass ``cls``: unknown and missing fields are named."""
    if not isinstance(data, dict):
        raise ValueError(f"{what} must be a JSON object, got {type(data).__name__}")
    known = {f.name: f for f in fields(cls)}
    unknown = sorted(set(data) - set(known))
    if unknown:
        raise ValueError(f"{what} has unknown field(s) {unknown}")
    missing = sorted(n for n, f in known.items()
                     if n not in data and f.default is MISSING and f.default_factory is MISSING)
    if missing:
        raise ValueError(f"{what} lacks required field(s) {missing}")
    return dict(data)


@dataclass(frozen=True)
class AccountantConfig:
    """The planned run: what the paper's closed forms and planning tools are evaluated on.

    ``clients`` is the planned number of clients aggregated per round (m).
    ``delta`` is the delta at which epsilon is reported. ``threat_model`` selects
    which sound bounds may certify the guarantee:

    - ``all-rounds`` (default): every broadcast global model is visible -> composition.
    - ``final-model``: only the final model is released -> min(composition, final_model,
      the paper's bound where it is sound).
    - ``curious-server``: the server sees each client's noisy upload -> local_dp.
    - ``secure-aggregation``: the server sees only the secure sum of the uploads (SecAgg+) ->
      secure_aggregation, composition's mu against the server (docs/MATH.md §20).

    ``assume_smooth_losses`` (default False) asserts that every (per-sample) loss is
    L-smooth with L = ``smoothness``; the bounds that rest on it certify only when set.
    ``colluders`` (c) is the number of participating clients colluding with the adversary of
    the all-rounds and final-model bounds (docs/MATH.md §14.2a): 0 = an outside observer, 1
    (default) = any one participating client, who knows its own noisy upload and subtracts
    it. Per-round noise counts only the clients outside the coalition (uniform weights:
    sigma*sqrt(m - c)/m); a round with m <= c certifies local DP for that round. In cohort
    mode c counts virtual clients (a node operator who knows its whole cohort is
    c = clients-per-node).

    ``sampling_rate`` (q in (0, 1], default None = fixed-size sampling): Poisson client sampling;
    ``clients`` is then the expected number of contributions per round, floor(q N) for a population
    of N clients (what planning assumes; the accountant uses each round's realized count). The
    all-rounds threat model gets the amplified ``sampled`` bound (docs/MATH.md §19).

    ``sample_secrecy`` (default "public"): who may learn a round's members. "public" (the ledger names
    them): the public-sample analysis only. "secret" (counts published, identities owner-only): the
    all-rounds adversary also gets the ``sampled_secret`` bound conditioned on each round's count
    (docs/MATH.md §22), for Poisson and fixed-size sampling alike. ``population`` (N, default None):
    the clients a round draws from, for planning (p = clients / N; each run's records carry their own N_t).
    ``batch_rate`` (q in (0, 1], default None = fixed-size batches): every node draws its local batches
    by Poisson sampling at rate B/n <= q (per-sample clipping); the all-rounds and curious-server
    threat models get the amplified ``batch_sampled`` bound (docs/MATH.md §23). Planning assumes q.
    """

    algorithm: Algorithm = "fedavg"
    schedule: Schedule = "constant"
    lr: float = 0.1
    local_steps: int = 5
    clip_norm: float = 1.0
    clients: int = 10
    sigma: float = 1.0
    smoothness: float = 1.0
    prox_alpha: float | None = None
    delta: float = 1e-5
    threat_model: ThreatModel = "all-rounds"
    clipping: Clipping = "per-batch"
    batch_size: int | None = None
    cyclic_c: float | None = None
    iterative_z: float | None = None
    colluders: int = 1
    assume_smooth_losses: bool = False
    sampling_rate: float | None = None
    sum_grid_step: float | None = None  # secure aggregation's integer sum: grid step s (parameter units) ...
    sum_dimension: int | None = None  # ... and d, the values summed (docs/MATH.md §20.4; both or neither)
    sum_clients_per_upload: int = 1  # ... and the most clients one integer upload sums (a cohort node's; §20.6)
    sample_secrecy: SampleSecrecy = "public"
    population: int | None = None
    batch_rate: float | None = None  # Poisson batch sampling on the nodes (docs/MATH.md §23)

    def __post_init__(self) -> None:
        choice("algorithm", self.algorithm, ALGORITHMS)
        int_at_least("colluders", self.colluders, 0)
        if not isinstance(self.assume_smooth_losses, bool):
            raise ValueError(f"assume_smooth_losses must be true or false, got {self.assume_smooth_losses!r}")
        choice("schedule", self.schedule, SCHEDULES)
        choice("threat_model", self.threat_model, THREAT_MODELS)
        choice("clipping", self.clipping, CLIPPING_MODES)
        positive("lr", self.lr)
        int_at_least("local_steps", self.local_steps, 1)
        positive("clip_norm", self.clip_norm)
        int_at_least("clients", self.clients, 1)
        positive("sigma", self.sigma)
        nonnegative("smoothness", self.smoothness)
        plausible_delta("delta", self.delta, self.clients)
        if self.clipping == "per-sample":
            if self.batch_size is None:
                raise ValueError("batch_size is required with per-sample clipping (integer >= 1)")
            int_at_least("batch_size", self.batch_size, 1)
        elif self.batch_size is not None:
            int_at_least("batch_size", self.batch_size, 1)
        if self.cyclic_c is not None:
            positive("cyclic_c", self.cyclic_c)
        if self.iterative_z is not None:
            positive("iterative_z", self.iterative_z)
        check_prox(self.algorithm, self.prox_alpha, self.smoothness, self.lr, self.assume_smooth_losses)
        if self.sampling_rate is not None and not (positive("sampling_rate", self.sampling_rate) <= 1.0):
            raise ValueError(f"sampling_rate must be in (0, 1], got {self.sampling_rate!r}")
        choice("sample_secrecy", self.sample_secrecy, SAMPLE_SECRECIES)
        if self.population is not None:
            int_at_least("population", self.population, 1)
        for problem in secrecy_problems(self.threat_model, self.sample_secrecy, self.population, self.clients, self.batch_rate):
            raise ValueError(problem)
        if self.batch_rate is not None and not (positive("batch_rate", self.batch_rate) <= 1.0):
            raise ValueError(f"batch_rate must be in (0, 1], got {self.batch_rate!r}")
        for problem in batch_sampling_problems(self.threat_model, self.clipping, self.batch_rate) + colluder_problems(self.threat_model, self.colluders) + sampling_problems(
                self.threat_model, self.sampling_rate) + secure_sum_problems(self.threat_model, self.sum_grid_step,
                                                                             self.sum_dimension, self.sum_clients_per_upload):
            raise ValueError(problem)

    @property
    def fedprox_alpha(self) -> float:
        """FedProx's alpha (1/lr units; present for fedprox, checked by __post_init__)."""
        if self.prox_alpha is None:
            raise ValueError("prox_alpha is required for fedprox (> 0)")
        return float(self.prox_alpha)

    def planned_round(self, round_index: int, clients: int | None = None, *, applied: bool = True) -> "RoundRecord":
        """The record of round ``round_index`` (1-based) if it runs exactly as planned
        (``applied=False``: its aggregate never reaches the released model)."""
        int_at_least("round_index", round_index, 1)
        m = self.clients if clients is None else clients
        int_at_least("clients", m, 1)
        return RoundRecord(
            round=round_index,
            algorithm=self.algorithm,
            step_sizes=step_sizes(self.schedule, self.lr, round_index - 1, self.local_steps),
            clip_norm=self.clip_norm,
            sigma=self.sigma,
            weights=tuple([1.0 / m] * m),
            clipping=self.clipping,
            batch_size=self.batch_size,
            prox_alpha=self.prox_alpha,
            applied=applied,
            population=self.population,
            sampled=None if self.population is None else m,
            batch_rate=self.batch_rate,
        )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: Any) -> "AccountantConfig":
        """Parse a persisted config (a ledger header's); ValueError names the bad field.

        A header written before ``colluders`` existed was certified against an outside observer
        (c = 0): it reads as ``colluders = 0``, so replaying it recomputes its numbers as they
        were written (resuming it under c >= 1 is refused as a config change).
        """
        d = _fields_of(cls, data, "accountant config")
        d.setdefault("colluders", LEGACY_COLLUDERS)
        # written before ``assume_smooth_losses``: L-dependent bounds certified unconditionally then
        d.setdefault("assume_smooth_losses", LEGACY_ASSUME_SMOOTH_LOSSES)
        return cls(**d)


_WEIGHT_SUM_TOL = 1e-9
#: colluders of a ledger header written before the field existed (docs/MATH.md §14.2a)
LEGACY_COLLUDERS = 0
#: a header without ``assume_smooth_losses`` was certified with L taken for granted (issue 16 item 2/4)
LEGACY_ASSUME_SMOOTH_LOSSES = True


@dataclass(frozen=True)
class RoundRecord:
    """One round as it actually ran (1-based ``round``).

    ``weights`` are the aggregation weights of the replies that were aggregated,
    in the order of ``node_ids`` when given. ``node_ids`` is informational (the
    ledger shows who contributed); the math does not use it.

    ``applied`` is False when the round's aggregate never reached the released model (fewer
    replies than ``min-replies``, a round accounted by an unfinished-round resume, a round lost
    to a crash before its checkpoint). Composition and local DP count every accounted round;
    the final-model bound counts only applied rounds (docs/MATH.md §14.3a). A persisted record
    without the field (written before it existed) reads as applied, as it was accounted then.

    Poisson client sampling (docs/MATH.md §19): ``population`` is N_t, the clients the round's sample
    was drawn from, and ``sampled`` how many it drew (before dropouts and screening); ``weights``
    then hold the contributions that entered the sum (uniform), possibly none. Both None: a
    fixed-size round (and every record written before sampling existed).

    ``screening_drop`` bounds the probability that the server's data-dependent reply checks (residual
    noise, update magnitude) dropped an honest reply in this round (noise-check-alpha +
    update-bound-alpha; 0 where they did not run): charged to delta (docs/MATH.md §17.1). A record
    written before the field existed reads as 0, as it was certified then.
    ``batch_rate``: the largest Poisson batch-sampling rate B/n a contributing node applied (docs/MATH.md
    §23), as the nodes echoed it; None: fixed-size batches (no amplification).
    """

    round: int
    algorithm: Algorithm
    step_sizes: tuple[float, ...]
    clip_norm: float
    sigma: float
    weights: tuple[float, ...]
    clipping: Clipping = "per-batch"
    batch_size: int | None = None
    prox_alpha: float | None = None
    node_ids: tuple[int, ...] = field(default=())
    applied: bool = True
    population: int | None = None
    sampled: int | None = None
    screening_drop: float = 0.0
    batch_rate: float | None = None

    def __post_init__(self) -> None:
        int_at_least("round", self.round, 1)
        if (isinstance(self.screening_drop, bool) or not isinstance(self.screening_drop, (int, float))
                or not 0.0 <= self.screening_drop <= 1.0):
            raise ValueError(f"screening_drop must be a probability in [0, 1], got {self.screening_drop!r}")
        if self.batch_rate is not None and not (positive("batch_rate", self.batch_rate) <= 1.0):
            raise ValueError(f"batch_rate must be in (0, 1], got {self.batch_rate!r}")
        if not isinstance(self.applied, bool):
            raise ValueError(f"applied must be true or false, got {self.applied!r}")  # noqa: TRY004 (as every field)
        choice("algorithm", self.algorithm, ALGORITHMS)
        choice("clipping", self.clipping, CLIPPING_MODES)
        object.__setattr__(self, "step_sizes", tuple(float(x) for x in self.step_sizes))
        object.__setattr__(self, "weights", tuple(float(x) for x in self.weights))
        object.__setattr__(self, "node_ids", tuple(int(x) for x in self.node_ids))
        if len(self.step_sizes) < 1:
            raise ValueError("step_sizes must hold K >= 1 step sizes")
        for eta in self.step_sizes:
            positive("step_sizes[k]", eta)
        positive("clip_norm", self.clip_norm)
        positive("sigma", self.sigma)
        if self.population is not None:
            int_at_least("population", self.population, 1)
            if self.sampled is not None and not (0 <= int_at_least("sampled", self.sampled, 0) <= self.population):
                raise ValueError(f"sampled must be an integer in [0, population = {self.population}], got {self.sampled!r}")
        elif self.sampled is not None:
            raise ValueError("sampled is given only with population (a Poisson-sampled round)")
        if len(self.weights) < 1 and self.population is None:
            raise ValueError("weights must hold at least one aggregation weight (>= 1 client)")
        if not all(math.isfinite(p) and p >= 0.0 for p in self.weights):  # floats by now: one pass, then the culprit
            for p in self.weights:
                nonnegative("weights[i]", p)
        total = math.fsum(self.weights)
        if self.weights and abs(total - 1.0) > _WEIGHT_SUM_TOL:
            raise ValueError(f"weights must sum to 1 (tolerance 1e-9), got sum {total!r}")
        if self.node_ids and len(self.node_ids) != len(self.weights):
            raise ValueError("node_ids must have one entry per weight")
        if self.clipping == "per-sample":
            if self.batch_size is None:
                raise ValueError("batch_size is required with per-sample clipping (integer >= 1)")
            int_at_least("batch_size", self.batch_size, 1)
        if self.algorithm == "fedprox":
            if self.prox_alpha is None:
                raise ValueError("prox_alpha is required for a fedprox round")
            positive("prox_alpha", self.prox_alpha)

    @property
    def local_steps(self) -> int:
        return len(self.step_sizes)

    @property
    def clients(self) -> int:
        """Number of replies aggregated (m_t)."""
        return len(self.weights)

    @property
    def max_weight(self) -> float:
        return max(self.weights, default=0.0)

    @property
    def noise_std(self) -> float:
        """Std of the aggregate noise s_t = sigma * sqrt(sum_i p_i^2) (docs/MATH.md §14.1)."""
        return self.sigma * math.sqrt(math.fsum(p * p for p in self.weights))

    def hidden_noise_stds(self, colluders: int) -> tuple[float, float]:
        """(s_min, s_target): aggregate noise std left after a coalition of ``colluders``
        participants subtracts its own uploads (docs/MATH.md §14.2a), same units as sigma.

        The coalition is at most the m - 1 clients other than the target (c_eff = min(c, m - 1)).

        - ``s_min`` = sigma * sqrt(sum of the m - c_eff smallest p_i^2): the least noise any
          coalition leaves for any target; paired with gamma = max_i p_i * Gamma it is a sound
          per-round pair for the final-model bound.
        - ``s_target`` = sigma * sqrt(p_max^2 + sum of the m - 1 - c_eff smallest p_j^2 of the
          others): the noise hiding the largest-weight client from the coalition of the c_eff
          largest other weights, the worst (target, coalition) of one round (the ratio
          p_k / s is largest for the largest p_k); composition uses it, so a round never costs
          more than local DP.

        Uniform weights: both are sigma * sqrt(m - c_eff)/m; c = 0 gives :attr:`noise_std`.
        Targets are clients with p_k > 0 (a zero-weight client's upload is not in the aggregate).
        """
        c = int_at_least("colluders", colluders, 0)
        squares = sorted(p * p for p in self.weights)  # ascending
        keep = len(squares) - min(c, len(squares) - 1)
        s_min_sq = math.fsum(squares[:keep])
        if s_min_sq == 0.0:  # only zero weights among them: a zero-weight target leaks nothing, so the
            s_min_sq = min(q for q in squares if q > 0.0)  # least noise of a real target is its own
        s_min = self.sigma * math.sqrt(s_min_sq)
        others = squares[:-1]  # without one largest weight (the target)
        s_target = self.sigma * math.sqrt(math.fsum([squares[-1], *others[:keep - 1]]))
        return s_min, s_target

    def to_dict(self) -> dict[str, Any]:
        d = {f.name: getattr(self, f.name) for f in fields(self)}  # scalars and tuples: asdict's deep copy is not needed
        d["step_sizes"] = list(self.step_sizes)
        d["weights"] = list(self.weights)
        d["node_ids"] = list(self.node_ids)
        return d

    @classmethod
    def from_dict(cls, data: Any) -> "RoundRecord":
        """Parse a persisted round record (a ledger round line's); ValueError names the bad field."""
        d = _fields_of(cls, data, "round record")
        for key in ("step_sizes", "weights", "node_ids"):
            if key in d:
                if not isinstance(d[key], (list, tuple)):
                    raise ValueError(f"round record field {key!r} must be a list, got {d[key]!r}")
                d[key] = tuple(d[key])
        return cls(**d)

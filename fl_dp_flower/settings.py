"""The settings a user gives the library: what every client does (:class:`DPSettings`) and how a
round is sampled and closed (:class:`FederationSettings`). Frozen and validated by the privacy
layer's one set of checks (``privacy.validate``): a bad value raises ``ValueError`` naming the field
and its range. The reference app builds both from its run config (``AppConfig.dp_settings()``,
``AppConfig.federation_settings()``); a library user constructs them directly.

Units: ``sigma`` is the per-client noise standard deviation and ``clip_norm`` (V) the L2 clipping
norm, both in the units of the model's weights; ``lr`` is the schedule's constant (docs/MATH.md §2).
"""

from __future__ import annotations

import dataclasses
import difflib
import numbers
from dataclasses import asdict, dataclass
from typing import Any

from .privacy.records import AccountantConfig
from .privacy.validate import choice, int_at_least, nonnegative, positive
from .vocabulary import (ALGORITHMS, BATCH_SAMPLINGS, CLIENT_SAMPLINGS, CLIPPING_MODES, RELEASE_AVERAGES, SAMPLE_SECRECIES,
                         SCHEDULES, SERVER_OPTIMIZERS, THREAT_MODELS, WEIGHTINGS, Algorithm, ClientSampling, Clipping,
                         ReleaseAverage, SampleSecrecy, Schedule, ServerOptimizer, ThreatModel, Weighting)

__all__ = ["DPSettings", "FederationSettings", "round_problems", "server_step_problems"]


def round_problems(clients_per_round: int, min_replies: int, client_sampling: str, weighting: str,
                   sample_secrecy: str = "public", sampling_rate: float = 1.0) -> list[str]:
    """A round's cross-field rules (each value already in its own range), as messages naming the
    :class:`FederationSettings` fields; the one owner of these rules (the reference app names its dash keys in
    them)."""
    problems = []
    if min_replies > clients_per_round:
        problems.append(f"min_replies = {min_replies!r}: must be an integer in [1, clients_per_round = "
                        f"{clients_per_round}]")
    if client_sampling == "fixed" and sampling_rate != 1.0:
        problems.append(f"sampling_rate = {sampling_rate!r}: only client_sampling = 'poisson' uses it (each client "
                        "independently with probability q), while fixed-size sampling draws exactly clients_per_round "
                        "clients: leave sampling_rate at 1.0 or set client_sampling = 'poisson'")
    if client_sampling == "poisson" and weighting != "uniform":
        problems.append(f"weighting = {weighting!r}: client_sampling = 'poisson' needs 'uniform' (the aggregate divides "
                        "the summed updates by q N)")
    elif sample_secrecy == "secret" and weighting != "uniform":
        problems.append(f"weighting = {weighting!r}: sample_secrecy = 'secret' needs 'uniform' (each round record's "
                        "weights n_i / sum n would tell a ledger reader who took part, and unequal weights get no "
                        "amplification)")
    return problems


def server_step_problems(server_optimizer: str, server_lr: float, server_lr_end: float,
                         server_weight_decay: float) -> list[str]:
    """The server step's cross-field rules (each value already in its own range), as messages naming the
    :class:`FederationSettings` fields; the one owner of these rules (the reference app names its dash keys in
    them)."""
    problems = []
    if server_lr_end < 1.0 and server_optimizer == "none":
        problems.append(f"server_lr_end = {server_lr_end!r} needs server_optimizer 'momentum' or 'adam' (with 'none' "
                        "the next model is the aggregate: no step size to decay)")
    if server_weight_decay > 0.0 and server_optimizer == "none":
        problems.append(f"server_weight_decay = {server_weight_decay!r} needs server_optimizer 'momentum' or 'adam' "
                        "(with 'none' the next model is the aggregate: no server step to decay, while 'momentum' with "
                        "server_momentum 0 and server_lr 1 steps to the aggregate)")
    if server_weight_decay * server_lr >= 1.0:
        problems.append(f"server_weight_decay x server_lr must be < 1 (the decay factor 1 - server_lr x "
                        f"server_weight_decay stays positive), got {server_weight_decay!r} x {server_lr!r}")
    return problems


def _as_ints(settings: Any, *names: str) -> None:
    """Store each integer field given as another integral type (numpy's int64, ...) as a Python int, so every layer
    below sees an int; a bool or non-integral value is left for the field's own check to refuse."""
    for name in names:
        value = getattr(settings, name)
        if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
            object.__setattr__(settings, name, int(value))


@dataclass(frozen=True)
class DPSettings:
    """What every sampled client does in a round: K clipped steps, then N(0, sigma^2) noise.

    sigma: per-client noise std (> 0). clip_norm: V (> 0). local_steps: K (>= 1). batch_size: B
    (>= 1). lr: the schedule's constant (> 0). schedule: constant | cyclic | stage | iterative.
    clipping: per-batch | per-sample. algorithm: fedavg | fedprox; prox_alpha: FedProx alpha
    (> 0 for fedprox, with lr * prox_alpha <= 1; 0 for fedavg). The accountant's plan
    (:meth:`accountant_config`) asks alpha > smoothness L only with ``assume_smooth_losses=True``
    (the bounds that rest on L-smooth losses need it); otherwise any alpha > 0 (a usual FedProx mu of
    0.01 to 1) is certified by composition, by clipping alone. seed: -1 draws the noise from OS
    entropy; >= 0 makes it reproducible (experiments only: nodes refuse it unless they allow it).
    batch_sampling: "fixed" (B distinct samples per step) or "poisson" (each node includes each of its n
    samples independently at rate B/n; per-sample clipping; amplified, docs/MATH.md §23).
    """

    sigma: float
    clip_norm: float
    local_steps: int = 10
    batch_size: int = 32
    lr: float = 0.1
    schedule: Schedule = "constant"
    clipping: Clipping = "per-batch"
    algorithm: Algorithm = "fedavg"
    prox_alpha: float = 0.0
    seed: int = -1
    batch_sampling: str = "fixed"

    def __post_init__(self) -> None:
        _as_ints(self, "local_steps", "batch_size", "seed")
        positive("sigma", self.sigma)
        choice("batch_sampling", self.batch_sampling, BATCH_SAMPLINGS)
        if self.batch_sampling == "poisson" and self.clipping != "per-sample":
            raise ValueError(f"batch_sampling 'poisson' needs clipping 'per-sample', got {self.clipping!r}")
        positive("clip_norm", self.clip_norm)
        int_at_least("local_steps", self.local_steps, 1)
        int_at_least("batch_size", self.batch_size, 1)
        positive("lr", self.lr)
        choice("schedule", self.schedule, SCHEDULES)
        choice("clipping", self.clipping, CLIPPING_MODES)
        choice("algorithm", self.algorithm, ALGORITHMS)
        nonnegative("prox_alpha", self.prox_alpha)
        int_at_least("seed", self.seed, -1)
        if self.algorithm == "fedprox":
            positive("prox_alpha", self.prox_alpha)
            if self.lr * self.prox_alpha > 1:
                raise ValueError(f"lr * prox_alpha must be <= 1 for fedprox (every step size eta <= 1/alpha), "
                                 f"got {self.lr} * {self.prox_alpha}")

    @property
    def fedprox_alpha(self) -> float | None:
        """FedProx's alpha, None for FedAvg (the accountant's convention)."""
        return self.prox_alpha if self.algorithm == "fedprox" else None

    def accountant_config(self, *, clients: int | None = None, population: int | None = None, delta: float = 1e-5,
                          threat_model: ThreatModel = "all-rounds", smoothness: float = 1.0,
                          **extra: Any) -> AccountantConfig:
        """The :class:`AccountantConfig` of a run with these settings (``extra``: further AccountantConfig
        fields, e.g. ``cyclic_c``, ``sampling_rate``, ``sample_secrecy``).

        Name what you know. Fixed-size sampling: ``clients`` = m, the clients each round aggregates (with
        ``sample_secrecy="secret"`` also ``population`` = N, the clients it draws from). Poisson sampling
        (``sampling_rate`` q): ``population`` = N only; the plan then assumes floor(q N) contributions per
        round (``clients`` with ``sampling_rate`` is refused: it once meant floor(q N) here and N elsewhere).
        """
        choice("threat_model", threat_model, THREAT_MODELS)
        _check_extra_fields(extra)
        q = extra.get("sampling_rate")
        if q is not None and (population is None or clients is not None):
            raise ValueError("with sampling_rate (Poisson client sampling) name the population: accountant_config("
                             "population=N, sampling_rate=q), not clients= (the plan's count per round is then "
                             f"floor(q N)); got clients={clients!r}, population={population!r}")
        if q is not None:
            clients = max(1, int(float(q) * int_at_least("population", population, 1) + 1e-9))
        if clients is None:
            raise ValueError("clients (the clients each round aggregates, m) is required without sampling_rate")
        if extra.get("sample_secrecy") == "secret":
            extra["population"] = population
        elif population is not None and q is None:
            raise ValueError("population is used with sampling_rate or sample_secrecy='secret' (the plan's N); "
                             "with fixed-size sampling of a public sample give clients only")
        return AccountantConfig(
            algorithm=self.algorithm, schedule=self.schedule, lr=self.lr, local_steps=self.local_steps,
            clip_norm=self.clip_norm, clients=clients, sigma=self.sigma, smoothness=smoothness,
            prox_alpha=self.fedprox_alpha, delta=delta, threat_model=threat_model, clipping=self.clipping,
            batch_size=self.batch_size, **extra,
        )

    def check_accountant(self, config: AccountantConfig, clients: int) -> None:
        """Raise ``ValueError`` naming every field where the accountant's plan differs from these
        settings (the accountant would certify a run other than the one the clients are asked for)."""
        ours = {"algorithm": self.algorithm, "schedule": self.schedule, "lr": self.lr,
                "local_steps": self.local_steps, "clip_norm": self.clip_norm, "sigma": self.sigma,
                "clipping": self.clipping, "prox_alpha": self.fedprox_alpha, "clients": clients}
        if self.clipping == "per-sample" or config.batch_size is not None:
            ours["batch_size"] = self.batch_size
        diff = [f"{k}: accountant {getattr(config, k)!r} != settings {v!r}"
                for k, v in ours.items() if getattr(config, k) != v]
        if (config.batch_rate is not None) != (self.batch_sampling == "poisson"):
            diff.append(f"batch_rate: accountant {config.batch_rate!r} needs settings batch_sampling 'poisson' "
                        f"(and only then), got {self.batch_sampling!r}")
        if diff:
            raise ValueError("the accountant's configuration does not match the DP settings (" + "; ".join(diff) + ")")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: what accountant_config(...) takes itself, and what it sets from the settings (not an extra field)
_OWN_ARGUMENTS = ("clients", "population", "delta", "threat_model", "smoothness")
_FROM_SETTINGS = ("algorithm", "schedule", "lr", "local_steps", "clip_norm", "sigma", "prox_alpha", "clipping",
                  "batch_size")


def _check_extra_fields(extra: dict[str, Any]) -> None:
    """Refuse an ``accountant_config`` keyword that is no AccountantConfig field (or one the settings set), naming
    it, the closest fields and every field it takes."""
    fields = [f.name for f in dataclasses.fields(AccountantConfig) if f.name not in _FROM_SETTINGS]
    takes = sorted({*fields, *_OWN_ARGUMENTS})
    for key in extra:
        if key in _FROM_SETTINGS:
            raise TypeError(f"accountant_config() sets {key!r} from the DPSettings (DPSettings.{key}); change it "
                            "there")
        if key not in fields:
            close = difflib.get_close_matches(key, takes, n=2, cutoff=0.5)
            hint = f"did you mean {' or '.join(repr(c) for c in close)}? " if close else ""
            raise TypeError(f"accountant_config() got an unknown keyword {key!r}: {hint}it takes {', '.join(takes)}")


def planned_population(secrecy: str, sampling: str, clients_per_round: int, partitions: int,
                       clients_per_node: int) -> int | None:
    """N of a secret sample's plan (p = planned clients / N): clients_per_round with Poisson sampling,
    ``partitions`` x clients_per_node with fixed-size; None with a public sample (not needed)."""
    if secrecy != "secret":
        return None
    return clients_per_round if sampling == "poisson" else partitions * clients_per_node


@dataclass(frozen=True)
class FederationSettings:
    """How the server runs rounds.

    clients_per_round: m clients sampled per round (virtual clients in cohort mode).
    min_replies: a round with fewer usable replies is accounted but not aggregated.
    clients_per_node: > 1 is cohort mode (each node trains that many virtual clients).
    num_server_rounds: total rounds of the run (a resumed run continues to this total).
    round_timeout: seconds to wait for replies. weighting: uniform | examples.
    max_node_refusals: a node that refuses this many rounds in a row is no longer sampled.
    seed: -1 samples nodes with OS entropy; >= 0 reproducibly.
    client_sampling: "fixed" (exactly clients_per_round distinct clients) or "poisson" (every
    eligible client independently with probability sampling_rate q; clients_per_round is then the
    population N the server waits for, the aggregate divides by q N_t, and the plan assumes
    floor(q N) contributions per round: docs/MATH.md §19).
    sample_secrecy: "public" (the ledger names each round's members; the public-sample analysis) or
    "secret" (the ledger and metrics give counts, the ids go to the owner-only members.jsonl, and the
    all-rounds bound is conditioned on each round's count: docs/MATH.md §22).

    Server-side post-processing of the noisy aggregate (free under the all-rounds and
    curious-server threat models, refused under final-model; strategies/server_opt.py):
    server_optimizer: "none" (the next model is the aggregate), "momentum" (heavy ball on the
    pseudo-gradient w_t - aggregate, as Flower's FedAvgM) or "adam" (as Flower's FedAdam);
    server_lr: its step size (> 0); server_lr_end: the factor (in (0, 1]) of server_lr at the last
    planned round, linear from 1 at round 1 (1: constant); server_momentum: momentum beta, Adam's beta_1 (in [0, 1));
    server_adam_beta2, server_adam_eps: Adam's beta_2 (in [0, 1)) and tau (> 0);
    server_weight_decay: decoupled weight decay lambda of the server step (AdamW-style,
    w_{t+1} = w_t - lr_t step_t - lr_t lambda w_t; >= 0 with server_lr * lambda < 1; > 0 needs a server optimizer).
    release_average: the released model (evaluation, final model) is the server's iterate ("none"),
    its bias-corrected exponential moving average with decay release_ema_decay (in (0, 1)), or
    ("tail") the running mean of the iterates of the last ceil(release_tail_fraction * num_server_rounds)
    planned rounds (fraction in (0, 1]; before they begin, the iterate). Clients always train from
    the iterate.
    """

    clients_per_round: int = 10
    min_replies: int = 1
    clients_per_node: int = 1
    num_server_rounds: int = 10
    round_timeout: float = 600.0
    weighting: Weighting = "uniform"
    max_node_refusals: int = 3
    seed: int = -1
    client_sampling: ClientSampling = "fixed"
    sampling_rate: float = 1.0
    sample_secrecy: SampleSecrecy = "public"
    server_optimizer: ServerOptimizer = "none"
    server_lr: float = 1.0
    server_lr_end: float = 1.0
    server_momentum: float = 0.9
    server_adam_beta2: float = 0.99
    server_adam_eps: float = 1e-3
    server_weight_decay: float = 0.0
    release_average: ReleaseAverage = "none"
    release_ema_decay: float = 0.9
    release_tail_fraction: float = 0.5

    def __post_init__(self) -> None:
        _as_ints(self, "clients_per_round", "min_replies", "clients_per_node", "num_server_rounds", "max_node_refusals",
                 "seed")
        int_at_least("clients_per_round", self.clients_per_round, 1)
        int_at_least("min_replies", self.min_replies, 1)
        int_at_least("clients_per_node", self.clients_per_node, 1)
        int_at_least("num_server_rounds", self.num_server_rounds, 1)
        positive("round_timeout", self.round_timeout)
        choice("weighting", self.weighting, WEIGHTINGS)
        int_at_least("max_node_refusals", self.max_node_refusals, 1)
        int_at_least("seed", self.seed, -1)
        choice("client_sampling", self.client_sampling, CLIENT_SAMPLINGS)
        if not positive("sampling_rate", self.sampling_rate) <= 1.0:
            raise ValueError(f"sampling_rate must be in (0, 1], got {self.sampling_rate!r}")
        choice("sample_secrecy", self.sample_secrecy, SAMPLE_SECRECIES)
        if problems := round_problems(self.clients_per_round, self.min_replies, self.client_sampling, self.weighting,
                                      self.sample_secrecy, self.sampling_rate):
            raise ValueError("; ".join(problems))
        self._check_post_processing()

    def _check_post_processing(self) -> None:
        choice("server_optimizer", self.server_optimizer, SERVER_OPTIMIZERS)
        positive("server_lr", self.server_lr)
        if not positive("server_lr_end", self.server_lr_end) <= 1.0:
            raise ValueError(f"server_lr_end must be in (0, 1], got {self.server_lr_end!r}")
        for name in ("server_momentum", "server_adam_beta2"):
            if not nonnegative(name, getattr(self, name)) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)!r}")
        positive("server_adam_eps", self.server_adam_eps)
        nonnegative("server_weight_decay", self.server_weight_decay)
        if problems := server_step_problems(self.server_optimizer, self.server_lr, self.server_lr_end,
                                            self.server_weight_decay):
            raise ValueError("; ".join(problems))
        choice("release_average", self.release_average, RELEASE_AVERAGES)
        if not positive("release_ema_decay", self.release_ema_decay) < 1.0:
            raise ValueError(f"release_ema_decay must be in (0, 1), got {self.release_ema_decay!r}")
        if not positive("release_tail_fraction", self.release_tail_fraction) <= 1.0:
            raise ValueError(f"release_tail_fraction must be in (0, 1], got {self.release_tail_fraction!r}")

    @property
    def post_processing(self) -> bool:
        """A server optimizer or an averaged release is configured."""
        return self.server_optimizer != "none" or self.release_average != "none"

    @property
    def poisson(self) -> bool:
        """Poisson client sampling (each client independently with probability ``sampling_rate``)."""
        return self.client_sampling == "poisson"

    @property
    def planned_clients(self) -> int:
        """Contributions a planned round has: clients_per_round, or floor(q N) (at least 1) with Poisson
        sampling (the expected count, rounded down; realized counts vary, the accountant uses them)."""
        if not self.poisson:
            return self.clients_per_round
        return max(1, int(self.sampling_rate * self.clients_per_round + 1e-9))

    def planned_population(self, partitions: int) -> int | None:
        """N of a secret sample's plan (:func:`planned_population`)."""
        return planned_population(self.sample_secrecy, self.client_sampling, self.clients_per_round, partitions,
                                  self.clients_per_node)

    @property
    def accountant_sampling_rate(self) -> float | None:
        """``AccountantConfig.sampling_rate``: q with Poisson sampling, None with fixed-size sampling."""
        return self.sampling_rate if self.poisson else None

    @property
    def nodes_needed(self) -> int:
        """Connected nodes a round waits for: enough to offer ``clients_per_round`` clients."""
        return -(-self.clients_per_round // self.clients_per_node)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

"""The wire contract between a server running NoisyFedAvg/NoisyFedProx and its clients: the one
owner of the ``dp.*`` keys (docs/ARCHITECTURE.md has the table).

- Server -> client: :class:`TrainInstruction` (``to_config`` writes the train ConfigRecord's
  ``dp.*`` keys; ``from_config`` parses and checks them on the client, raising :class:`Refused`
  naming the bad key). In cohort mode the server adds :data:`MEMBERS`.
- Client -> server: :func:`echo` (the settings as applied, in the reply's MetricRecord) and the
  server reads them back with :data:`ECHO_KEYS`.
- Refusal: a node that will not run an instruction (its guardrails or its policy forbid it)
  answers with :func:`refusal`: an ``Error`` whose code is :data:`REFUSAL_CODE` and whose reason
  starts with :data:`REFUSAL_PREFIX`; the server counts such replies as *refusals*
  (``max-node-refusals``), unlike failures (a dead node, a timeout, a crash), which it only logs.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from flwr.app import Error, Message
from flwr.common.constant import ErrorCode

from fl_dp_flower.errors import FlDpError
from .vocabulary import ALGORITHMS, BATCH_SAMPLINGS, CLIPPING_MODES, SCHEDULES, Algorithm, Clipping, Schedule

REFUSAL_CODE = ErrorCode.MOD_FAILED_PRECONDITION
REFUSAL_PREFIX = "refused by node: "

PREFIX = "dp."  # every key of this contract starts with it (and no other module writes one)

ROUND_INDEX = "dp.round-index"
ALGORITHM = "dp.algorithm"
SCHEDULE = "dp.schedule"
LR = "dp.lr"
LOCAL_STEPS = "dp.local-steps"
CLIP_NORM = "dp.clip-norm"
SIGMA = "dp.sigma"
CLIPPING = "dp.clipping"
BATCH_SIZE = "dp.batch-size"
PROX_ALPHA = "dp.prox-alpha"
SEED = "dp.seed"
PARTITION_ID = "dp.partition-id"  # echoed: the node's data partition (the server detects duplicates)
MEMBERS = "dp.members"  # cohort mode: the virtual-client slots a node trains (instruction and echo)
#: secure aggregation (training/secure_sum.py): the step of the upload's integer grid (instruction and echo)
SUM_GRID_STEP = "dp.sum-grid-step"
#: Poisson batch sampling on the node (docs/MATH.md §23): "fixed" (absent: an older server) or "poisson";
#: a node that applied "poisson" echoes the rate B/n it used as dp.batch-rate (a MetricRecord holds numbers
#: only; never which samples it drew); no dp.batch-rate in a reply: fixed-size batches
BATCH_SAMPLING = "dp.batch-sampling"
BATCH_RATE = "dp.batch-rate"
#: the reply's ArrayRecord holding the integer upload under secure aggregation (instead of "arrays")
SECURE_SUM_RECORD = "secure-sum"

#: instruction field -> (wire key, type): the train ConfigRecord's dp.* keys
INSTRUCTION_KEYS: dict[str, tuple[str, type]] = {
    "round_index": (ROUND_INDEX, int),
    "algorithm": (ALGORITHM, str),
    "schedule": (SCHEDULE, str),
    "lr": (LR, float),
    "local_steps": (LOCAL_STEPS, int),
    "clip_norm": (CLIP_NORM, float),
    "sigma": (SIGMA, float),
    "clipping": (CLIPPING, str),
    "batch_size": (BATCH_SIZE, int),
    "prox_alpha": (PROX_ALPHA, float),
    "seed": (SEED, int),
}
#: the settings as applied, echoed in every train reply's MetricRecord (field -> wire key)
ECHO_KEYS: dict[str, str] = {
    "sigma": SIGMA, "clip_norm": CLIP_NORM, "local_steps": LOCAL_STEPS, "lr": LR,
    "round_index": ROUND_INDEX, "batch_size": BATCH_SIZE, "prox_alpha": PROX_ALPHA,
}


class Refused(FlDpError, ValueError):
    """The node will not run this instruction (the reason, naming the key, is the message)."""


def _get(cfg: Mapping[str, Any], key: str, kind: type) -> Any:
    if key not in cfg:
        raise Refused(f"train config is missing {key!r}")
    value = cfg[key]
    if kind is str:
        if not isinstance(value, str):
            raise Refused(f"{key} must be a string, got {value!r}")
        return value
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise Refused(f"{key} must be a number, got {value!r}")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise Refused(f"{key} must be an integer, got {value!r}")
        return int(value)
    if not math.isfinite(value):
        raise Refused(f"{key} must be finite, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class TrainInstruction:
    """The ``dp.*`` keys of one train instruction (units: those of the weights).

    round_index: 0-based schedule index t. prox_alpha: 0.0 for fedavg. seed: -1 = OS entropy.
    """

    round_index: int
    algorithm: Algorithm
    schedule: Schedule
    lr: float
    local_steps: int
    clip_norm: float
    sigma: float
    clipping: Clipping
    batch_size: int
    prox_alpha: float
    seed: int
    batch_sampling: str = "fixed"

    @property
    def applied_prox_alpha(self) -> float:
        """The proximal alpha the client applies (0 for fedavg)."""
        return self.prox_alpha if self.algorithm == "fedprox" else 0.0

    def to_config(self) -> dict[str, Any]:
        """The train ConfigRecord's ``dp.*`` entries (``dp.batch-sampling`` only when "poisson", so that
        fixed-batch instructions stay what older nodes parse)."""
        config = {key: kind(getattr(self, name)) for name, (key, kind) in INSTRUCTION_KEYS.items()}
        if self.batch_sampling != "fixed":
            config[BATCH_SAMPLING] = self.batch_sampling
        return config

    @classmethod
    def from_config(cls, cfg: Mapping[str, Any]) -> "TrainInstruction":
        """Parse and check the server's ``dp.*`` train config; raise :class:`Refused` naming the key."""
        sampling = _get(cfg, BATCH_SAMPLING, str) if BATCH_SAMPLING in cfg else "fixed"
        s = cls(**{name: _get(cfg, key, kind) for name, (key, kind) in INSTRUCTION_KEYS.items()},
                batch_sampling=sampling)
        checks = [
            (s.algorithm in ALGORITHMS, f"{ALGORITHM} must be one of {ALGORITHMS}, got {s.algorithm!r}"),
            (s.schedule in SCHEDULES, f"{SCHEDULE} must be one of {SCHEDULES}, got {s.schedule!r}"),
            (s.clipping in CLIPPING_MODES, f"{CLIPPING} must be one of {CLIPPING_MODES}, got {s.clipping!r}"),
            (s.sigma > 0, f"{SIGMA} must be > 0 (noise is mandatory), got {s.sigma!r}"),
            (s.clip_norm > 0, f"{CLIP_NORM} must be > 0, got {s.clip_norm!r}"),
            (s.lr > 0, f"{LR} must be > 0, got {s.lr!r}"),
            (s.local_steps >= 1, f"{LOCAL_STEPS} must be >= 1, got {s.local_steps!r}"),
            (s.batch_size >= 1, f"{BATCH_SIZE} must be >= 1, got {s.batch_size!r}"),
            (s.round_index >= 0, f"{ROUND_INDEX} must be >= 0, got {s.round_index!r}"),
            (s.prox_alpha >= 0, f"{PROX_ALPHA} must be >= 0, got {s.prox_alpha!r}"),
            (s.seed >= -1, f"{SEED} must be -1 (OS entropy) or >= 0, got {s.seed!r}"),
            (s.batch_sampling in BATCH_SAMPLINGS,
             f"{BATCH_SAMPLING} must be one of {BATCH_SAMPLINGS}, got {s.batch_sampling!r}"),
            (s.batch_sampling != "poisson" or s.clipping == "per-sample",
             f"{BATCH_SAMPLING}='poisson' needs {CLIPPING}='per-sample', got {s.clipping!r}"),
        ]
        for ok, reason in checks:
            if not ok:
                raise Refused(reason)
        if s.algorithm == "fedprox" and s.lr * s.prox_alpha > 1:
            # docs/MATH.md §3: the FedProx sensitivity terms need eta_k * alpha <= 1 (eta_0 = lr is the largest)
            raise Refused(f"{LR} * {PROX_ALPHA} must be <= 1 for fedprox, got {s.lr * s.prox_alpha!r}")
        return s

    @classmethod
    def from_message(cls, msg: Message, config_key: str = "config") -> "TrainInstruction":
        """Parse the instruction of a train ``Message`` (its ConfigRecord under ``config_key``)."""
        if config_key not in msg.content.config_records:
            raise Refused(f"train instruction has no ConfigRecord {config_key!r}")
        return cls.from_config(msg.content.config_records[config_key])


def sum_grid_config(step: float) -> dict[str, Any]:
    """The train ConfigRecord entry that asks for the integer upload of secure aggregation."""
    return {SUM_GRID_STEP: float(step)}


#: an integer list echoed through Flower's SecAgg+ (its legacy FitRes metrics hold scalars only): this prefix + "i,j,..."
SECURE_LIST_PREFIX = "int-list:"


def secure_echo(metrics: dict[str, Any]) -> dict[str, Any]:
    """A reply's metrics as SecAgg+ carries them: each integer list (a cohort's ``dp.members``) as a string."""
    return {k: SECURE_LIST_PREFIX + ",".join(str(int(i)) for i in v) if isinstance(v, list) else v
            for k, v in metrics.items()}


def from_secure_echo(metrics: dict[str, Any]) -> dict[str, Any]:
    """:func:`secure_echo` undone (the server side); a malformed list stays a string (screening rejects it)."""
    out = dict(metrics)
    for k, v in metrics.items():
        if isinstance(v, str) and v.startswith(SECURE_LIST_PREFIX):
            body = v[len(SECURE_LIST_PREFIX):]
            try:
                out[k] = [int(i) for i in body.split(",")] if body else []
            except ValueError:
                pass
    return out


def sum_grid_from_config(cfg: Mapping[str, Any]) -> float | None:
    """The grid step when the instruction asks for secure aggregation's integer upload, else None;
    :class:`Refused` naming the key when it is malformed."""
    if SUM_GRID_STEP not in cfg:
        return None
    step: float = _get(cfg, SUM_GRID_STEP, float)
    if not (step > 0 and math.frexp(step)[0] == 0.5):
        raise Refused(f"{SUM_GRID_STEP} must be a power of two > 0, got {step!r}")
    return step


def echo(instruction: TrainInstruction, *, local_steps: int, batch_size: int,
         samples: int | None = None) -> dict[str, Any]:
    """The reply's echo of the settings as applied (``local_steps`` and ``batch_size`` as run: B
    shrinks to the local data size when that is smaller). With Poisson batches (``samples``: the n the
    node sampled from) it adds the rate ``dp.batch-rate`` = B/n."""
    applied = {"sigma": instruction.sigma, "clip_norm": instruction.clip_norm, "local_steps": local_steps,
               "lr": instruction.lr, "round_index": instruction.round_index, "batch_size": batch_size,
               "prox_alpha": instruction.applied_prox_alpha}
    echoed: dict[str, Any] = {ECHO_KEYS[name]: value for name, value in applied.items()}
    if instruction.batch_sampling == "poisson":
        if not samples or batch_size > samples:
            raise ValueError(f"a Poisson-batched echo needs the samples n >= B = {batch_size}, got {samples!r}")
        echoed[BATCH_RATE] = batch_size / samples
    return echoed


def refusal(msg: Message, reason: str | Exception) -> Message:
    """The refusal reply to ``msg`` (counted by the server's ``max-node-refusals``)."""
    return Message(Error(code=REFUSAL_CODE, reason=f"{REFUSAL_PREFIX}{reason}"), reply_to=msg)

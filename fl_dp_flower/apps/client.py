"""ClientApp: global model -> K clipped GD steps -> N(0, sigma^2) on every uploaded value -> reply.

Train instruction (docs/ARCHITECTURE.md): ``msg.content["arrays"]`` (global model w_t) and
``msg.content["config"]`` with the ``dp.*`` keys. Reply: ``RecordDict({"arrays": noisy state_dict,
"metrics": MetricRecord})`` with num-examples, dp.partition-id and the settings as applied
(dp.sigma, dp.clip-norm, dp.local-steps, dp.lr, dp.round-index, dp.batch-size, dp.prox-alpha);
train statistics only with ``share-metrics`` (below).

Node-side guardrails: a node can set ``min-sigma``, ``max-clip-norm``, ``max-local-steps`` and
``max-lr`` in its node config. A train instruction that violates them (or is malformed: sigma <= 0,
non-finite numbers, unknown schedule/clipping/algorithm, FedProx with eta*alpha > 1, per-sample
clipping with a batch larger than the local data) is refused with an ``Error`` reply: the node never
releases a less-private update than its operator allows.

Node policy (the node's decision, never the server's; docs/deployment.md §2.5):

- ``allow-fixed-seed`` (default false): a train instruction with ``dp.seed >= 0`` asks for noise
  that anyone who knows the seed can regenerate and subtract. The node refuses it unless its node
  config sets ``allow-fixed-seed=true`` or its environment sets ``FL_DP_ALLOW_FIXED_SEED=1``
  (the only way in Flower's simulation engine, whose node config holds just the partition).
- ``share-metrics`` (default false): ``train-loss``, ``clipped-fraction``, ``train-seconds``
  (the local training time, which depends on the data) and ``nonfinite-gradients`` are computed
  on the local data and are neither noised nor accounted, so they are only sent when the node
  config sets ``share-metrics=true`` or its environment ``FL_DP_SHARE_METRICS=1`` (the count of
  non-finite gradients is always logged on the node); evaluate instructions (loss/accuracy on the local test split, also
  un-noised) are refused unless it does.

Data: ``partition-id`` / ``num-partitions`` from the node config (num-partitions falls back to the
run config), dataset settings from the run config (``data-dir`` in the node config wins).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from flwr.app import ArrayRecord, Context, Error, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl_dp_flower.config import AppConfig, ConfigError
from fl_dp_flower.privacy.schedules import step_sizes
from fl_dp_flower.protocol import REFUSAL_CODE, REFUSAL_PREFIX
from fl_dp_flower.training.data import DEFAULT_DATA_SEED, Partition, load_partition
from fl_dp_flower.training.cohort import Member, cohort_update
from fl_dp_flower.training.local_update import evaluate_model, local_update
from fl_dp_flower.vocabulary import ALGORITHMS, CLIPPING_MODES, SCHEDULES
from fl_dp_flower.training.models import build_model
from fl_dp_flower.training.noise import add_gaussian_noise_, make_noise_source

log = logging.getLogger(__name__)

REFUSED = REFUSAL_CODE  # Error code of a refused train instruction
NODE_LIMITS = {  # node-config key -> (setting, comparison that must hold)
    "min-sigma": ("dp.sigma", ">="),
    "max-clip-norm": ("dp.clip-norm", "<="),
    "max-local-steps": ("dp.local-steps", "<="),
    "max-lr": ("dp.lr", "<="),
}
ALLOW_FIXED_SEED = "allow-fixed-seed"  # node-config key (bool)
ALLOW_FIXED_SEED_ENV = "FL_DP_ALLOW_FIXED_SEED"  # node environment: "1" allows, like the key
SHARE_METRICS = "share-metrics"  # node-config key (bool): send un-noised train/eval statistics
SHARE_METRICS_ENV = "FL_DP_SHARE_METRICS"  # node environment: "1" shares them, like the key

app = ClientApp()


class Refused(ValueError):
    """The node will not run this train instruction (reason in the message)."""


@dataclass(frozen=True)
class TrainSettings:
    """The dp.* keys of a train instruction, type-checked (units: those of the weights)."""

    round_index: int
    algorithm: str
    schedule: str
    lr: float
    local_steps: int
    clip_norm: float
    sigma: float
    clipping: str
    batch_size: int
    prox_alpha: float
    seed: int


def _get(cfg: Mapping, key: str, kind: type):
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


def parse_train_config(cfg: Mapping) -> TrainSettings:
    """Validate the server's dp.* train config; raise Refused naming the bad key."""
    s = TrainSettings(
        round_index=_get(cfg, "dp.round-index", int),
        algorithm=_get(cfg, "dp.algorithm", str),
        schedule=_get(cfg, "dp.schedule", str),
        lr=_get(cfg, "dp.lr", float),
        local_steps=_get(cfg, "dp.local-steps", int),
        clip_norm=_get(cfg, "dp.clip-norm", float),
        sigma=_get(cfg, "dp.sigma", float),
        clipping=_get(cfg, "dp.clipping", str),
        batch_size=_get(cfg, "dp.batch-size", int),
        prox_alpha=_get(cfg, "dp.prox-alpha", float),
        seed=_get(cfg, "dp.seed", int),
    )
    checks = [
        (s.algorithm in ALGORITHMS, f"dp.algorithm must be one of {ALGORITHMS}, got {s.algorithm!r}"),
        (s.schedule in SCHEDULES, f"dp.schedule must be one of {SCHEDULES}, got {s.schedule!r}"),
        (s.clipping in CLIPPING_MODES, f"dp.clipping must be one of {CLIPPING_MODES}, got {s.clipping!r}"),
        (s.sigma > 0, f"dp.sigma must be > 0 (noise is mandatory), got {s.sigma!r}"),
        (s.clip_norm > 0, f"dp.clip-norm must be > 0, got {s.clip_norm!r}"),
        (s.lr > 0, f"dp.lr must be > 0, got {s.lr!r}"),
        (s.local_steps >= 1, f"dp.local-steps must be >= 1, got {s.local_steps!r}"),
        (s.batch_size >= 1, f"dp.batch-size must be >= 1, got {s.batch_size!r}"),
        (s.round_index >= 0, f"dp.round-index must be >= 0, got {s.round_index!r}"),
        (s.prox_alpha >= 0, f"dp.prox-alpha must be >= 0, got {s.prox_alpha!r}"),
        (s.seed >= -1, f"dp.seed must be -1 (OS entropy) or >= 0, got {s.seed!r}"),
    ]
    for ok, reason in checks:
        if not ok:
            raise Refused(reason)
    if s.algorithm == "fedprox" and s.lr * s.prox_alpha > 1:
        # docs/MATH.md §3: the FedProx sensitivity terms need eta_k * alpha <= 1 (eta_0 = lr is the largest)
        raise Refused(f"dp.lr * dp.prox-alpha must be <= 1 for fedprox, got {s.lr * s.prox_alpha!r}")
    return s


def check_node_limits(s: TrainSettings, node_config: Mapping) -> None:
    """Raise Refused if ``s`` violates a min-sigma / max-clip-norm / max-local-steps / max-lr limit."""
    applied = {"dp.sigma": s.sigma, "dp.clip-norm": s.clip_norm, "dp.local-steps": s.local_steps, "dp.lr": s.lr}
    for key, (setting, op) in NODE_LIMITS.items():
        if key not in node_config:
            continue
        try:
            limit = float(node_config[key])
        except (TypeError, ValueError):
            raise Refused(f"node config {key}={node_config[key]!r} is not a number") from None
        if not math.isfinite(limit):
            raise Refused(f"node config {key}={limit!r} is not finite")
        value = applied[setting]
        if not (value >= limit if op == ">=" else value <= limit):
            raise Refused(f"{setting}={value!r} violates this node's limit {key}={limit!r}")


def node_flag(node_config: Mapping, key: str) -> bool:
    """A boolean node-config switch (absent = false); anything but true/false is refused."""
    value = node_config.get(key, False)
    if not isinstance(value, bool):
        raise Refused(f"node config {key}={value!r} must be true or false")
    return value


def fixed_seed_allowed(node_config: Mapping, environ: Mapping[str, str] | None = None) -> bool:
    """Whether this node accepts reproducible (seeded) noise: node config or node environment."""
    env = os.environ if environ is None else environ
    return node_flag(node_config, ALLOW_FIXED_SEED) or env.get(ALLOW_FIXED_SEED_ENV, "") == "1"


def metrics_shared(node_config: Mapping, environ: Mapping[str, str] | None = None) -> bool:
    """Whether this node sends un-noised statistics: node config or node environment (the only
    way in Flower's simulation engine, as for allow-fixed-seed)."""
    env = os.environ if environ is None else environ
    return node_flag(node_config, SHARE_METRICS) or env.get(SHARE_METRICS_ENV, "") == "1"


def check_node_policy(s: TrainSettings, node_config: Mapping, environ: Mapping[str, str] | None = None) -> None:
    """Raise Refused if ``s`` asks for a fixed noise seed this node has not allowed."""
    if s.seed >= 0 and not fixed_seed_allowed(node_config, environ):
        raise Refused(
            f"dp.seed={s.seed} asks for reproducible noise, which whoever knows the seed can subtract; "
            f"this node allows it only with node config {ALLOW_FIXED_SEED}=true or "
            f"{ALLOW_FIXED_SEED_ENV}=1 in its environment"
        )


def _device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def run_config(context: Context) -> AppConfig:
    """The run config, validated like the server's (a config this node cannot parse is refused)."""
    try:
        return AppConfig.from_run_config(context.run_config)
    except ConfigError as err:
        raise Refused(str(err).replace("\n", " ")) from None


def _partition(context: Context, config: AppConfig) -> Partition:
    """This node's share of the dataset: node config first (``partition-id``, ``num-partitions``,
    ``data-dir``), the run config for the rest."""
    nc = context.node_config
    if "partition-id" not in nc:
        raise Refused("node config has no 'partition-id'")
    return load_partition(
        config.dataset, str(nc.get("data-dir", config.data_dir)), int(nc["partition-id"]),
        int(nc.get("num-partitions", config.num_partitions)), config.partitioning, config.dirichlet_alpha,
        DEFAULT_DATA_SEED, config.test_fraction,
    )


def _global_model(msg: Message, config: AppConfig, device: torch.device) -> torch.nn.Module:
    model = build_model(config.dataset)
    model.load_state_dict(msg.content["arrays"].to_torch_state_dict())
    return model.to(device)


def _derived_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed for (seed, partition, round, stream): distinct noise per client and round."""
    return int(np.random.SeedSequence([seed, *parts]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def shared_statistics(**values: float | int) -> dict[str, float | int]:
    """The un-noised statistics of local training (sent only with ``share-metrics=true``), in
    reply-key form: train-seconds, train-loss, clipped-fraction, nonfinite-gradients."""
    return {key.replace("_", "-"): value for key, value in values.items()}


def _log_nonfinite(count: int, unit: str) -> None:
    if count:
        log.warning("%d non-finite %s gradient(s) this round were replaced by zero before clipping "
                    "(NaN/Inf loss or data); the upload stays finite and within the clipping bound", count, unit)


def _refuse(msg: Message, err: Refused) -> Message:
    log.warning("Refusing train instruction: %s", err)
    return Message(Error(code=REFUSED, reason=f"{REFUSAL_PREFIX}{err}"), reply_to=msg)


def _cohort_slots(cfg: Mapping, config: AppConfig) -> list[int] | None:
    """The virtual-client slots a cohort instruction asks this node to train (None: one client)."""
    if "dp.members" not in cfg:
        return None
    slots = cfg["dp.members"]
    cpn = config.clients_per_node
    if (not isinstance(slots, list) or not slots or len(set(slots)) != len(slots)
            or not all(isinstance(j, int) and not isinstance(j, bool) and 0 <= j < cpn for j in slots)):
        raise Refused(f"dp.members must be distinct slots in [0, {cpn - 1}] ('clients-per-node' = {cpn}), "
                      f"got {slots!r}")
    return sorted(slots)


def _train_cohort(msg: Message, context: Context, s: TrainSettings, config: AppConfig, slots: list[int],
                  etas: tuple[float, ...], share: bool) -> Message:
    """Cohort mode: every sampled virtual client of this node runs the local update; the reply
    carries the sum of their noisy uploads (training.cohort). Noise: ``cohort-noise = "summed"``
    draws the sum's noise at once (the same distribution), ``"per-member"`` one stream per member."""
    nc = context.node_config
    if s.clipping != "per-batch":
        raise Refused("cohort mode supports per-batch clipping only")
    cpn = config.clients_per_node
    pid, parts = int(nc["partition-id"]), int(nc.get("num-partitions", config.num_partitions))
    device = _device()
    model = _global_model(msg, config, device)
    if any(True for _ in model.buffers()):
        raise Refused("cohort mode needs a model without buffers (every value is a noised parameter)")
    members = []
    for j in slots:
        client = pid * cpn + j  # this virtual client's partition of parts * cpn
        part = load_partition(config.dataset, str(nc.get("data-dir", config.data_dir)), client, parts * cpn,
                              config.partitioning, config.dirichlet_alpha, DEFAULT_DATA_SEED, config.test_fraction)
        batch_gen = torch.Generator(device="cpu")
        batch_gen.manual_seed(_derived_seed(s.seed, client, s.round_index, 1) if s.seed >= 0 else secrets.randbits(63))
        noise_seed = -1 if s.seed == -1 else _derived_seed(s.seed, client, s.round_index, 0)
        per_member = config.cohort_noise == "per-member"
        members.append(Member(part.x_train, part.y_train, batch_gen,
                              make_noise_source(config.noise_mode, device, noise_seed) if per_member else None))
    summed = None
    if config.cohort_noise == "summed":  # one draw of the members' summed noise (training.cohort)
        summed = make_noise_source(config.noise_mode, device,
                                   -1 if s.seed == -1 else _derived_seed(s.seed, pid, s.round_index, 2))
    alpha = s.prox_alpha if s.algorithm == "fedprox" else 0.0
    started = time.perf_counter()
    result = cohort_update(model, members, step_sizes=etas, clip_norm=s.clip_norm, batch_size=s.batch_size,
                           sigma=s.sigma, prox_alpha=alpha, summed_noise=summed)
    _log_nonfinite(result.nonfinite_gradients, "(member, step)")
    metrics = MetricRecord({
        "num-examples": sum(len(m.y) for m in members),
        **(shared_statistics(train_seconds=time.perf_counter() - started, clipped_fraction=result.clipped_fraction,
                             nonfinite_gradients=result.nonfinite_gradients) if share else {}),
        "dp.members": slots,
        "dp.partition-id": pid,
        "dp.sigma": s.sigma, "dp.clip-norm": s.clip_norm, "dp.local-steps": len(etas), "dp.lr": s.lr,
        "dp.round-index": s.round_index, "dp.batch-size": min(result.batch_sizes), "dp.prox-alpha": alpha,
    })
    arrays = ArrayRecord({k: v.detach().cpu() for k, v in result.total.items()})
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Local update on this node's partition (or its cohort's), then noise on every uploaded value."""
    torch.set_num_threads(1)
    try:
        s = parse_train_config(msg.content["config"])
        check_node_limits(s, context.node_config)
        check_node_policy(s, context.node_config)
        share = metrics_shared(context.node_config)
        config = run_config(context)
        slots = _cohort_slots(msg.content["config"], config)
        if slots is not None:
            if "partition-id" not in context.node_config:
                raise Refused("node config has no 'partition-id'")
            etas = step_sizes(s.schedule, s.lr, s.round_index, s.local_steps)
            return _train_cohort(msg, context, s, config, slots, etas, share)
        part = _partition(context, config)
        if s.clipping == "per-sample" and s.batch_size > len(part.y_train):
            raise Refused(
                f"dp.batch-size={s.batch_size} exceeds the {len(part.y_train)} local samples; "
                "per-sample clipping would then use a smaller B than accounted"
            )
        etas = step_sizes(s.schedule, s.lr, s.round_index, s.local_steps)
    except Refused as err:
        return _refuse(msg, err)

    device = _device()
    model = _global_model(msg, config, device)
    pid = int(context.node_config["partition-id"])
    batch_gen = torch.Generator(device="cpu")
    batch_gen.manual_seed(_derived_seed(s.seed, pid, s.round_index, 1) if s.seed >= 0 else secrets.randbits(63))
    alpha = s.prox_alpha if s.algorithm == "fedprox" else 0.0
    started = time.perf_counter()
    stats = local_update(
        model, part.x_train, part.y_train,
        step_sizes=etas, clip_norm=s.clip_norm, clipping=s.clipping,
        batch_size=s.batch_size, prox_alpha=alpha, generator=batch_gen,
    )
    noise_seed = -1 if s.seed == -1 else _derived_seed(s.seed, pid, s.round_index, 0)
    add_gaussian_noise_(model, s.sigma, make_noise_source(config.noise_mode, device, noise_seed))
    train_seconds = time.perf_counter() - started
    _log_nonfinite(stats.nonfinite_gradients, "per-sample" if s.clipping == "per-sample" else "step")

    metrics = MetricRecord({
        "num-examples": len(part.y_train),  # public under replace-one adjacency (docs/deployment.md)
        **(shared_statistics(train_seconds=train_seconds, train_loss=stats.loss,
                             clipped_fraction=stats.clipped_fraction,
                             nonfinite_gradients=stats.nonfinite_gradients) if share else {}),
        "dp.partition-id": pid,  # the server detects two nodes given one partition
        "dp.sigma": s.sigma,
        "dp.clip-norm": s.clip_norm,
        "dp.local-steps": stats.steps,
        "dp.lr": s.lr,
        "dp.round-index": s.round_index,
        "dp.batch-size": stats.batch_size,
        "dp.prox-alpha": alpha,
    })
    arrays = ArrayRecord({k: v.detach().cpu() for k, v in model.state_dict().items()})
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


@app.evaluate()
def evaluate(msg: Message, context: Context) -> Message:
    """Loss/accuracy of the received model on this node's local test split (un-noised: only
    with node config ``share-metrics=true``)."""
    torch.set_num_threads(1)
    try:
        if not metrics_shared(context.node_config):
            raise Refused(f"evaluate replies are un-noised statistics of local data; this node sends "
                          f"them only with node config {SHARE_METRICS}=true")
        config = run_config(context)
        part = _partition(context, config)
    except Refused as err:
        return _refuse(msg, err)
    model = _global_model(msg, config, _device())
    loss, acc = evaluate_model(model, part.x_test, part.y_test)
    metrics = MetricRecord({"eval-loss": loss, "eval-acc": acc, "num-examples": len(part.y_test)})
    return Message(RecordDict({"metrics": metrics}), reply_to=msg)

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
import time
from collections.abc import Mapping

import numpy as np
import torch
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp

from fl_dp_flower import protocol
from fl_dp_flower.client import (check_batch_fits, derived_seed, log_nonfinite, member_streams, private_update,
                                 shared_statistics, sum_grid, train_reply)
from fl_dp_flower.secagg_mod import secure_aggregation_mod
from fl_dp_flower.app.config import AppConfig, ConfigError
from fl_dp_flower.node import (ALLOW_FIXED_SEED, ALLOW_FIXED_SEED_ENV, NODE_LIMITS, SHARE_METRICS,  # noqa: F401
                               SHARE_METRICS_ENV, check_node_limits, check_node_policy, fixed_seed_allowed,
                               metrics_shared, node_flag)
from fl_dp_flower.privacy.schedules import step_sizes
from fl_dp_flower.protocol import REFUSAL_CODE, Refused, TrainInstruction, refusal
from fl_dp_flower.training.cohort import CohortResult, CohortSettings, KeyedStreams, train_cohort
from fl_dp_flower.training.cohort_data import CohortData, resident_partitions
from fl_dp_flower.training.cohort_secure import SecureCohortUpload, secure_cohort_upload
from fl_dp_flower.training.data import DEFAULT_DATA_SEED, Partition, load_partition
from fl_dp_flower.training.local_update import evaluate_model
from fl_dp_flower.training.models import build_model
from fl_dp_flower.training.noise import FIXED_SEED_WARNING, make_noise_source
from fl_dp_flower.training.secure_sum import SumGrid

log = logging.getLogger(__name__)

REFUSED = REFUSAL_CODE  # Error code of a refused train instruction
TrainSettings = TrainInstruction  # the dp.* keys of a train instruction (fl_dp_flower.protocol)
parse_train_config = TrainInstruction.from_config
_derived_seed = derived_seed

app = ClientApp(mods=[secure_aggregation_mod])  # SecAgg+ rounds (threat-model secure-aggregation)


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
        DEFAULT_DATA_SEED, config.test_fraction, config.validation_fraction,
    )


def _global_model(msg: Message, config: AppConfig, device: torch.device) -> torch.nn.Module:
    model = build_model(config.dataset, config.model)
    model.load_state_dict(msg.content.array_records["arrays"].to_torch_state_dict())
    return model.to(device)


def _refuse(msg: Message, err: Refused) -> Message:
    log.warning("Refusing train instruction: %s", err)
    return refusal(msg, err)


def _cohort_slots(cfg: Mapping, config: AppConfig) -> list[int] | None:
    """The virtual-client slots a cohort instruction asks this node to train (None: one client)."""
    if protocol.MEMBERS not in cfg:
        return None
    slots = cfg[protocol.MEMBERS]
    cpn = config.clients_per_node
    if (not isinstance(slots, list) or not slots or len(set(slots)) != len(slots)
            or not all(isinstance(j, int) and not isinstance(j, bool) and 0 <= j < cpn for j in slots)):
        raise Refused(f"{protocol.MEMBERS} must be distinct slots in [0, {cpn - 1}] ('clients-per-node' = {cpn}), "
                      f"got {slots!r}")
    return sorted(slots)


def _train_cohort(msg: Message, context: Context, s: TrainSettings, config: AppConfig, slots: list[int],
                  etas: tuple[float, ...], share: bool, grid: SumGrid | None = None) -> Message:
    """Cohort mode: every sampled virtual client of this node runs the local update; the reply
    carries the sum of their noisy uploads (training.cohort). Noise: ``cohort-noise = "summed"``
    draws the sum's noise at once (the same distribution), ``"per-member"`` one stream per member.
    With a sum ``grid`` (secure aggregation): the members' integer sum, each member with its own
    single-client streams and Skellam noise (training/cohort_secure.py, docs/MATH.md §20.6)."""
    nc = context.node_config
    cpn = config.clients_per_node
    pid, parts = int(nc["partition-id"]), int(nc.get("num-partitions", config.num_partitions))
    device = _device()
    model = _global_model(msg, config, device)
    if any(True for _ in model.buffers()):
        raise Refused("cohort mode needs a model without buffers (every value is a noised parameter)")
    # the node's clients-per-node partitions, resident on the device from the first round on
    pool = resident_partitions(config.dataset, str(nc.get("data-dir", config.data_dir)), pid * cpn, cpn, parts * cpn,
                               config.partitioning, config.dirichlet_alpha, DEFAULT_DATA_SEED, config.test_fraction,
                               config.validation_fraction, str(device))
    rows = np.asarray(slots, dtype=np.int64)
    smallest = int(np.argmin(pool.sizes[rows]))
    check_batch_fits(s, int(pool.sizes[rows[smallest]]), f" of virtual client {pid * cpn + slots[smallest]}")
    alpha = s.prox_alpha if s.algorithm == "fedprox" else 0.0
    settings = CohortSettings(step_sizes=etas, clip_norm=s.clip_norm, batch_size=s.batch_size, sigma=s.sigma,
                              prox_alpha=alpha, clipping=s.clipping)
    clients = pid * cpn + rows
    if grid is not None:  # secure aggregation: each member as one client would, the node uploads the integer sum
        if s.seed >= 0 and config.noise_mode == "standard":
            log.warning(FIXED_SEED_WARNING)
        batch, noise = member_streams(s.seed, clients.tolist(), s.round_index, config.noise_mode)
        started = time.perf_counter()
        up = secure_cohort_upload(model, pool, rows, batch, noise, grid, settings)
        if up.clamped:  # the grid plan makes this astronomically unlikely; the accountant charges its probability
            log.warning("secure aggregation: %d value(s) of this node's sum were clamped to the range Flower passes",
                        up.clamped)
        metrics = _cohort_metrics(pool, rows, slots, pid, s, etas, up, share, started)
        metrics.update(protocol.sum_grid_config(grid.step))
        ints = ArrayRecord({k: Array(np.ascontiguousarray(a)) for k, a in zip(model.state_dict().keys(), up.upload,
                                                                               strict=True)})
        return Message(RecordDict({protocol.SECURE_SUM_RECORD: ints, "metrics": metrics}), reply_to=msg)
    # batches (and per-member noise) drawn chunk-wise on the device, keyed by seed, round and client ids
    streams = KeyedStreams(None if s.seed == -1 else s.seed, s.round_index, pid * cpn + rows, config.noise_mode)
    summed = None
    if config.cohort_noise == "summed":  # one draw of the members' summed noise (training.cohort)
        summed = make_noise_source(config.noise_mode, device,
                                   -1 if s.seed == -1 else _derived_seed(s.seed, pid, s.round_index, 2))
    started = time.perf_counter()
    result = train_cohort(model, pool, rows, streams, settings, summed_noise=summed)
    metrics = _cohort_metrics(pool, rows, slots, pid, s, etas, result, share, started)
    arrays = ArrayRecord({k: v.detach().cpu() for k, v in result.total.items()})
    return Message(RecordDict({"arrays": arrays, "metrics": metrics}), reply_to=msg)


def _cohort_metrics(pool: CohortData, rows: np.ndarray, slots: list[int], pid: int, s: TrainSettings,
                    etas: tuple[float, ...], result: CohortResult | SecureCohortUpload, share: bool,
                    started: float) -> MetricRecord:
    """A cohort reply's metrics: num-examples, the shared statistics (``share-metrics``), the members, the echo."""
    log_nonfinite(result.nonfinite_gradients, "per-sample" if s.clipping == "per-sample" else "(member, step)")
    return MetricRecord({
        "num-examples": int(pool.sizes[rows].sum()),
        **(shared_statistics(train_seconds=time.perf_counter() - started, clipped_fraction=result.clipped_fraction,
                             nonfinite_gradients=result.nonfinite_gradients) if share else {}),
        protocol.MEMBERS: slots,
        protocol.PARTITION_ID: pid,
        **protocol.echo(s, local_steps=len(etas), batch_size=min(result.batch_sizes)),
    })


@app.train()
def train(msg: Message, context: Context) -> Message:
    """Local update on this node's partition (or its cohort's), then noise on every uploaded value."""
    torch.set_num_threads(1)
    try:
        s = TrainInstruction.from_config(msg.content["config"])
        check_node_limits(s, context.node_config)
        check_node_policy(s, context.node_config)
        share = metrics_shared(context.node_config)
        config = run_config(context)
        slots = _cohort_slots(msg.content["config"], config)
        grid = sum_grid(msg)
        if slots is not None and s.batch_sampling == "poisson":
            raise Refused(f"cohort mode ({protocol.MEMBERS}) with {protocol.BATCH_SAMPLING}='poisson' is not "
                          "supported: Poisson batches are drawn by one client per node")
        if slots is not None:
            if "partition-id" not in context.node_config:
                raise Refused("node config has no 'partition-id'")
            etas = step_sizes(s.schedule, s.lr, s.round_index, s.local_steps)
            return _train_cohort(msg, context, s, config, slots, etas, share, grid)
        part = _partition(context, config)
        check_batch_fits(s, len(part.y_train))
    except Refused as err:
        return _refuse(msg, err)

    model = _global_model(msg, config, _device())
    started = time.perf_counter()
    pid = int(context.node_config["partition-id"])
    # with a sum grid (secure aggregation): the integer upload with Skellam noise (training/secure_sum.py)
    stats, secure = private_update(model, part.x_train, part.y_train, s, grid, client=pid, noise_mode=config.noise_mode)
    return train_reply(msg, s, model, stats, num_examples=len(part.y_train),  # public under replace-one
                       share_metrics=share, train_seconds=time.perf_counter() - started,
                       extra_metrics={protocol.PARTITION_ID: pid}, secure_sum=secure)  # the server detects two nodes given one partition


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

"""The client side of Noisy-FedAvg / Noisy-FedProx for any torch model and data.

High level, in your own ClientApp::

    app = ClientApp()
    app.train()(dp_train(model_fn=MyNet, data_fn=load_my_partition, loss_fn=F.cross_entropy))

``dp_train`` parses the server's instruction (:class:`~fl_dp_flower.protocol.TrainInstruction`),
applies the node's guardrails and policy (:mod:`fl_dp_flower.node`; a violation is a refusal
reply), loads the global model, runs K clipped steps (+ FedProx's proximal term) with the
schedule's step sizes, adds N(0, sigma^2) to every uploaded value and replies with the echo of the
settings as applied. You never write a ``dp.*`` key.

Lower level, for your own loop: ``TrainInstruction.from_message(msg)``, ``check_node(...)``,
:func:`noisy_local_update` (K clipped steps + noise, in place) and :func:`train_reply`.

The model must hold parameters only: every uploaded value is noised and accounted as a trained
parameter, so a model with buffers (BatchNorm's running statistics) is refused; use GroupNorm or
LayerNorm instead.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from flwr.app import Array, ArrayRecord, Context, Message, MetricRecord, RecordDict
from torch import nn

from .node import check_node, metrics_shared
from .privacy.schedules import step_sizes
from .protocol import (BATCH_SIZE, PARTITION_ID, SECURE_SUM_RECORD, Refused, TrainInstruction, echo, refusal,
                       sum_grid_config, sum_grid_from_config)
from .training.local_update import LocalUpdateStats, LossFn, local_update
from .training.noise import FIXED_SEED_WARNING, add_gaussian_noise_, make_noise_source
from .training.secure_sum import SumGrid, encode_update

__all__ = ["check_batch_fits", "check_dp_instruction", "check_loss_runs", "check_model_fits", "check_no_buffers", "derived_seed", "dp_train",
           "log_nonfinite", "member_streams", "node_data", "noisy_local_update",
           "private_update", "secure_sum_update", "shared_statistics", "sum_grid", "train_reply"]

log = logging.getLogger(__name__)

ModelFn = Callable[[], nn.Module]
DataFn = Callable[[Context], tuple[torch.Tensor, torch.Tensor]]
SecureUpload = tuple[SumGrid, list[np.ndarray]]


def sum_grid(msg: Message, config_key: str = "config") -> SumGrid | None:
    """The grid of secure aggregation's integer upload when the train instruction asks for it
    (``protocol.SUM_GRID_STEP``: the grid step, a power of two), else None; :class:`Refused` when malformed."""
    found = sum_grid_from_config(msg.content.config_records[config_key])
    return None if found is None else SumGrid(step=found)


def check_no_buffers(model: nn.Module) -> None:
    """Raise ``ValueError`` if ``model`` has buffers (they would be uploaded but not trained under the
    clipping bound, e.g. BatchNorm's running statistics, which are statistics of the local data)."""
    names = [name for name, _ in model.named_buffers()]
    if names:
        raise ValueError(
            f"{type(model).__name__} has buffers {names[:5]}{' ...' if len(names) > 5 else ''}: every uploaded "
            "value must be a parameter trained under the clipping bound (buffers such as BatchNorm's running "
            "statistics are un-clipped statistics of the local data). Use GroupNorm or LayerNorm instead of "
            "BatchNorm, or register constants as non-persistent buffers (persistent=False)."
        )


def derived_seed(seed: int, *parts: int) -> int:
    """A 63-bit seed for (seed, client, round, stream): distinct noise per client and round."""
    return int(np.random.SeedSequence([seed, *parts]).generate_state(1, np.uint64)[0] >> np.uint64(1))


def shared_statistics(**values: float | int) -> dict[str, float | int]:
    """The un-noised statistics of local training (sent only with ``share-metrics``), in reply-key
    form: train-seconds, train-loss, clipped-fraction, nonfinite-gradients."""
    return {key.replace("_", "-"): value for key, value in values.items()}


def log_nonfinite(count: int, unit: str) -> None:
    if count:
        log.warning("%d non-finite %s gradient(s) this round were replaced by zero before clipping "
                    "(NaN/Inf loss or data); the upload stays finite and within the clipping bound", count, unit)


def _clipped_steps(model: nn.Module, x: torch.Tensor, y: torch.Tensor, s: TrainInstruction, client: int,
                   loss_fn: LossFn) -> LocalUpdateStats:
    check_no_buffers(model)
    etas = step_sizes(s.schedule, s.lr, s.round_index, s.local_steps)
    batch_gen = torch.Generator(device="cpu")
    batch_gen.manual_seed(derived_seed(s.seed, client, s.round_index, 1) if s.seed >= 0 else secrets.randbits(63))
    stats = local_update(model, x, y, step_sizes=etas, clip_norm=s.clip_norm, clipping=s.clipping,
                         batch_size=s.batch_size, prox_alpha=s.applied_prox_alpha, generator=batch_gen,
                         loss_fn=loss_fn, batch_sampling=s.batch_sampling)
    log_nonfinite(stats.nonfinite_gradients, "per-sample" if s.clipping == "per-sample" else "step")
    return stats


def noisy_local_update(model: nn.Module, x: torch.Tensor, y: torch.Tensor, instruction: TrainInstruction, *,
                       client: int = 0, loss_fn: LossFn = F.cross_entropy,
                       noise_mode: str = "standard") -> LocalUpdateStats:
    """K clipped steps of ``instruction`` on (x, y), then N(0, sigma^2) on every value of ``model``'s
    state dict, in place. ``client`` (e.g. the partition id) separates the streams of a fixed seed;
    with ``seed = -1`` batches and noise come from OS entropy. ``loss_fn(outputs, targets)`` returns
    the batch MEAN loss. ``noise_mode``: "standard" or "secure" (training/noise.py)."""
    s = instruction
    stats = _clipped_steps(model, x, y, s, client, loss_fn)
    noise_seed = -1 if s.seed == -1 else derived_seed(s.seed, client, s.round_index, 0)
    device = next(model.parameters()).device
    add_gaussian_noise_(model, s.sigma, make_noise_source(noise_mode, device, noise_seed))
    return stats


def secure_sum_update(model: nn.Module, x: torch.Tensor, y: torch.Tensor, instruction: TrainInstruction,
                      grid: SumGrid, *, client: int = 0, loss_fn: LossFn = F.cross_entropy,
                      noise_mode: str = "standard") -> tuple[LocalUpdateStats, list[np.ndarray]]:
    """Secure aggregation's client step (training/secure_sum.py): K clipped steps of ``instruction``,
    then the integer upload k = clamp(round(Delta / s) + Skellam) + 2^29 of the clean update Delta, in the
    state dict's order, with Skellam noise of variance sigma^2 (parameter units) per value. ``model``
    ends up holding the CLEAN local model: upload only the returned integers. Noise seeding as
    :func:`noisy_local_update` (``noise_mode`` "secure" or ``seed = -1``: OS entropy)."""
    s = instruction
    before = {k: v.detach().to("cpu", torch.float64).numpy().copy() for k, v in model.state_dict().items()}
    stats = _clipped_steps(model, x, y, s, client, loss_fn)
    after = {k: v.detach().to("cpu", torch.float64).numpy() for k, v in model.state_dict().items()}
    fixed = s.seed >= 0 and noise_mode == "standard"
    if fixed:
        log.warning(FIXED_SEED_WARNING)
    rng = np.random.default_rng(derived_seed(s.seed, client, s.round_index, 0)) if fixed else None
    upload, clamped = encode_update([after[k] - before[k] for k in before], grid, s.sigma, rng)
    if clamped:  # the grid plan makes this astronomically unlikely; the accountant charges its probability
        log.warning("secure aggregation: %d value(s) of this upload were clamped to the range Flower passes", clamped)
    return stats, upload


def member_streams(seed: int, clients: Sequence[int], round_index: int,
                   noise_mode: str = "standard") -> tuple[list[torch.Generator], list[np.random.Generator | None]]:
    """Each client's (batch generator, Skellam generator) for secure aggregation, exactly as
    :func:`secure_sum_update` seeds them for that ``client``: a cohort node gives every member the streams it
    would have as a single client (training/cohort_secure.py). ``seed = -1``: batches from OS entropy and
    noise None (OS entropy); ``noise_mode`` "secure": noise None."""
    batch, noise = [], []
    for client in clients:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(derived_seed(seed, int(client), round_index, 1) if seed >= 0 else secrets.randbits(63))
        batch.append(gen)
        fixed = seed >= 0 and noise_mode == "standard"
        noise.append(np.random.default_rng(derived_seed(seed, int(client), round_index, 0)) if fixed else None)
    return batch, noise


def private_update(model: nn.Module, x: torch.Tensor, y: torch.Tensor, instruction: TrainInstruction,
                   grid: SumGrid | None, *, client: int = 0, loss_fn: LossFn = F.cross_entropy,
                   noise_mode: str = "standard") -> tuple[LocalUpdateStats, SecureUpload | None]:
    """The update an instruction asks for: :func:`secure_sum_update` when it carries a sum grid
    (secure aggregation; returns the grid and the integers for :func:`train_reply`'s ``secure_sum``),
    else :func:`noisy_local_update` (``model`` noised in place; None)."""
    if grid is None:
        return noisy_local_update(model, x, y, instruction, client=client, loss_fn=loss_fn, noise_mode=noise_mode), None
    stats, upload = secure_sum_update(model, x, y, instruction, grid, client=client, loss_fn=loss_fn,
                                      noise_mode=noise_mode)
    return stats, (grid, upload)


def check_batch_fits(instruction: TrainInstruction, samples: int, whose: str = "") -> None:
    """Refuse per-sample clipping with a batch larger than the ``samples`` held (``whose``: e.g. " of
    virtual client 3"): the update would then average over a smaller B than the accountant charges."""
    if (instruction.clipping == "per-sample" or instruction.batch_sampling == "poisson") \
            and instruction.batch_size > samples:
        raise Refused(f"{BATCH_SIZE}={instruction.batch_size} exceeds the {samples} local samples{whose}; "
                      "per-sample clipping would then use a smaller B than accounted")


def train_reply(msg: Message, instruction: TrainInstruction, model: nn.Module, stats: LocalUpdateStats, *,
                num_examples: int, share_metrics: bool = False, train_seconds: float | None = None,
                extra_metrics: Mapping[str, Any] | None = None, secure_sum: SecureUpload | None = None) -> Message:
    """The train reply: the noisy model, ``num-examples``, ``extra_metrics``, the echo of the settings
    as applied and, with ``share_metrics``, the un-noised statistics (train seconds, train loss,
    clipped fraction, non-finite gradients). With ``secure_sum`` (grid, integer upload of
    :func:`secure_sum_update`) the reply carries the integers under ``protocol.SECURE_SUM_RECORD``
    instead of the model (which is then clean) and echoes the grid."""
    metrics: dict[str, Any] = {"num-examples": int(num_examples)}
    if share_metrics:
        metrics.update(shared_statistics(**({"train_seconds": train_seconds} if train_seconds is not None else {}),
                                         train_loss=stats.loss, clipped_fraction=stats.clipped_fraction,
                                         nonfinite_gradients=stats.nonfinite_gradients))
    metrics.update(extra_metrics or {})
    metrics.update(echo(instruction, local_steps=stats.steps, batch_size=stats.batch_size, samples=num_examples))
    if secure_sum is not None:
        grid, upload = secure_sum
        metrics.update(sum_grid_config(grid.step))
        keys = list(model.state_dict().keys())
        ints = ArrayRecord({k: Array(np.ascontiguousarray(a)) for k, a in zip(keys, upload, strict=True)})
        return Message(RecordDict({SECURE_SUM_RECORD: ints, "metrics": MetricRecord(metrics)}), reply_to=msg)
    arrays = ArrayRecord({k: v.detach().cpu() for k, v in model.state_dict().items()})
    return Message(RecordDict({"arrays": arrays, "metrics": MetricRecord(metrics)}), reply_to=msg)


def node_data(x: Any, y: Any, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """``data_fn``'s ``(x, y)`` as tensors: numpy arrays (and array-likes) are converted, floating
    inputs to the model's ``dtype``, integer labels to int64 (cross-entropy's). :class:`Refused`,
    naming data_fn, for what cannot train: no arrays, lengths that differ, an empty partition."""
    def tensor(name: str, value: Any) -> torch.Tensor:
        if isinstance(value, torch.Tensor):
            return value
        try:
            return torch.as_tensor(np.asarray(value))
        except (TypeError, ValueError, RuntimeError) as err:
            raise Refused(f"data_fn must return (x, y) as tensors or numpy arrays; {name} is a "
                          f"{type(value).__name__} ({err})") from None

    xt, yt = tensor("x", x), tensor("y", y)
    if xt.ndim == 0 or yt.ndim == 0 or len(xt) != len(yt):
        raise Refused(f"data_fn returned x of shape {tuple(xt.shape)} and y of shape {tuple(yt.shape)}: both need "
                      "the samples along their first dimension, as many in each")
    if len(yt) == 0:
        raise Refused("data_fn returned an empty partition (0 samples): this node cannot train; give it data or "
                      "leave it out of the federation (each round it is sampled in has one contributor fewer, "
                      "which costs more privacy than planned)")
    if xt.is_floating_point() and xt.dtype != dtype:
        xt = xt.to(dtype)
    if not (yt.is_floating_point() or yt.dtype == torch.int64):
        yt = yt.to(torch.int64)
    return xt, yt


def check_dp_instruction(msg: Message, config_key: str = "config") -> None:
    """Refuse, naming the server's strategy, a train message that carries no ``dp.*`` setting at all: a plain
    Flower strategy (``FedAvg``) sent it, so there is neither noise to apply nor an accountant to count it."""
    records = msg.content.config_records
    if config_key in records and not any(str(key).startswith("dp.") for key in records[config_key]):
        raise Refused(f"the train instruction carries no dp.* settings (ConfigRecord {config_key!r} has "
                      f"{sorted(records[config_key])[:5]}): the ServerApp's strategy must be fl_dp_flower's "
                      "NoisyFedAvg or NoisyFedProx (a plain Flower strategy neither asks for noise nor accounts it)")


def check_model_fits(model: nn.Module, msg: Message, arrays_key: str = "arrays") -> None:
    """Refuse, naming model_fn, a train message whose global model does not fit ``model`` (another key,
    a missing one, another shape): the ServerApp's initial model and the ClientApp's ``model_fn`` must
    build the same network."""
    records = msg.content.array_records
    if arrays_key not in records:
        raise Refused(f"the train message has no ArrayRecord {arrays_key!r} (it has {sorted(records)}): "
                      "dp_train's arrays_key must name the key the strategy sends (NoisyFedAvg: 'arrays')")
    mine = {key: tuple(value.shape) for key, value in model.state_dict().items()}
    theirs = {key: tuple(array.shape) for key, array in records[arrays_key].items()}
    if mine == theirs:
        return
    problems = [f"missing in the server's model: {sorted(set(mine) - set(theirs))[:5]}"] if set(mine) - set(theirs) else []
    if set(theirs) - set(mine):
        problems.append(f"not in model_fn()'s: {sorted(set(theirs) - set(mine))[:5]}")
    problems += [f"{key}: server {theirs[key]} != model_fn() {mine[key]}"
                 for key in mine if key in theirs and mine[key] != theirs[key]][:5]
    raise Refused(f"the server's global model does not fit model_fn() ({type(model).__name__}): "
                  f"{'; '.join(problems)}. The ServerApp's initial_arrays and the ClientApp's model_fn must build "
                  "the same model")


def check_loss_runs(model: nn.Module, x: torch.Tensor, y: torch.Tensor, loss_fn: LossFn, samples: int) -> None:
    """Refuse, naming data_fn, model_fn and loss_fn, data the model cannot train on: the model or the loss
    fails on the first ``samples`` samples (shapes, dtypes), or labels lie outside the outputs' classes
    (cross-entropy, checked over every label: a bad label later in the data would fail mid-round)."""
    device = next(model.parameters()).device
    shapes = f"x has shape {tuple(x.shape)} ({x.dtype}), y {tuple(y.shape)} ({y.dtype})"
    with torch.no_grad():
        try:
            out = model(x[:samples].to(device))
        except (RuntimeError, IndexError, ValueError, TypeError) as err:
            raise Refused(f"model_fn()(x) fails on data_fn's x ({type(err).__name__}: {str(err).strip()[:300]}); "
                          f"{shapes}") from None
        if loss_fn is F.cross_entropy and not y.is_floating_point() and out.ndim == 2:
            low, high, classes = int(y.min()), int(y.max()), out.shape[1]
            if low < 0 or high >= classes:
                raise Refused(f"data_fn's labels span [{low}, {high}] but model_fn()'s output has {classes} classes: "
                              f"cross-entropy needs labels in [0, {classes - 1}]")
        try:
            loss_fn(out, y[:samples].to(device))
        except (RuntimeError, IndexError, ValueError, TypeError) as err:
            raise Refused(f"loss_fn(model_fn()(x), y) fails on data_fn's data ({type(err).__name__}: "
                          f"{str(err).strip()[:300]}); {shapes}") from None


def _client_index(context: Context) -> int:
    return int(context.node_config.get("partition-id", context.node_id))


def dp_train(model_fn: ModelFn, data_fn: DataFn, loss_fn: LossFn = F.cross_entropy, *,
             arrays_key: str = "arrays", config_key: str = "config",
             device: str | torch.device | None = None) -> Callable[[Message, Context], Message]:
    """A ClientApp train function: ``app.train()(dp_train(model_fn, data_fn, loss_fn))``.

    model_fn(): a fresh model whose state dict matches the server's initial ``ArrayRecord``
    (parameters only, see :func:`check_no_buffers`; checked here once). data_fn(context): this
    node's training data ``(x, y)`` as tensors or numpy arrays (converted: :func:`node_data`; an empty or
    mismatched partition is refused, naming data_fn). loss_fn(outputs, targets): the batch mean loss.
    A refused instruction gets a refusal reply (counted by the server's ``max-node-refusals``); so do,
    before any step, a global model that does not fit ``model_fn()`` (:func:`check_model_fits`) and data
    the loss cannot take, e.g. labels outside the model's classes (:func:`check_loss_runs`).
    """
    check_no_buffers(model_fn())
    where = torch.device(device) if device is not None else None

    def train(msg: Message, context: Context) -> Message:
        try:
            check_dp_instruction(msg, config_key)
            instruction = TrainInstruction.from_message(msg, config_key)
            check_node(instruction, context.node_config)
            grid = sum_grid(msg, config_key)
            share = metrics_shared(context.node_config)
            model = model_fn()
            x, y = node_data(*data_fn(context), dtype=next(model.parameters()).dtype)
            check_batch_fits(instruction, len(y))
            check_model_fits(model, msg, arrays_key)
            model.load_state_dict(msg.content.array_records[arrays_key].to_torch_state_dict())
            model.to(where or torch.device("cuda" if torch.cuda.is_available() else "cpu"))
            check_loss_runs(model, x, y, loss_fn, instruction.batch_size)
        except Refused as err:
            log.warning("Refusing train instruction: %s", err)
            return refusal(msg, err)
        started = time.perf_counter()
        stats, secure = private_update(model, x, y, instruction, grid, client=_client_index(context), loss_fn=loss_fn)
        return train_reply(msg, instruction, model, stats, num_examples=len(y), share_metrics=share,
                           train_seconds=time.perf_counter() - started,
                           extra_metrics={PARTITION_ID: _client_index(context)}, secure_sum=secure)

    return train

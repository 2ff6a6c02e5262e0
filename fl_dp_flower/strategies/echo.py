"""The settings a client applied, as the server planned them or as a reply echoes them (:class:`Applied`),
and the one parser of a reply's echo (:func:`parse_applied`). Owned here so that screening
(:mod:`.screening`) and reconciliation and aggregation (:mod:`.replies`) both depend on it and not on
each other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flwr.app import MetricRecord

from fl_dp_flower import protocol


@dataclass(frozen=True)
class Applied:
    """Settings of one client's local update (planned by the server or echoed by a client)."""

    sigma: float
    clip_norm: float
    local_steps: int
    lr: float
    round_index: int
    batch_size: int | None = None
    prox_alpha: float | None = None
    batch_rate: float | None = None  # the Poisson batch rate B/n the node echoed (None: not Poisson-sampled)


def metric_number(metrics: MetricRecord, key: str, *, integer: bool, minimum: float, strict: bool) -> float | int:
    """The number ``metrics[key]`` (ValueError naming the key unless a finite number of the kind and range asked)."""
    if key not in metrics:
        raise ValueError(f"metrics lack {key!r}")
    value = metrics[key]
    if isinstance(value, (bool, list)) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"{key} = {value!r} is not a finite number")
    if integer:
        if isinstance(value, float) and not value.is_integer():
            raise ValueError(f"{key} = {value!r} is not an integer")
        value = int(value)
    if value < minimum or (strict and value == minimum):
        raise ValueError(f"{key} = {value!r} must be {'>' if strict else '>='} {minimum}")
    return value


def parse_applied(metrics: MetricRecord, *, fedprox: bool) -> Applied:
    """The echoed settings of one reply (ValueError if missing or invalid; a reply without any ``dp.*`` echo,
    e.g. a plain Flower train reply, is told so, naming the functions that write one)."""
    if not any(key in metrics for key in protocol.ECHO_KEYS.values()):
        keys = ", ".join((protocol.SIGMA, protocol.CLIP_NORM, protocol.LOCAL_STEPS, protocol.LR, protocol.ROUND_INDEX))
        raise ValueError(
            f"the reply's metrics lack the {protocol.PREFIX}* echo of the settings the node applied ({keys}, ...): a "
            "plain Flower train reply? Train with fl_dp_flower.client.dp_train, or build the reply with "
            "fl_dp_flower.client.train_reply")
    batch = int(metric_number(metrics, protocol.BATCH_SIZE, integer=True, minimum=1, strict=False)) if protocol.BATCH_SIZE in metrics else None
    rate = None
    if protocol.BATCH_RATE in metrics:
        rate = metric_number(metrics, protocol.BATCH_RATE, integer=False, minimum=0.0, strict=True)
        if rate > 1.0:
            raise ValueError(f"{protocol.BATCH_RATE} must be in (0, 1], got {rate!r}")
    alpha = None
    if fedprox and protocol.PROX_ALPHA in metrics:
        alpha = metric_number(metrics, protocol.PROX_ALPHA, integer=False, minimum=0.0, strict=True)
    return Applied(
        sigma=metric_number(metrics, protocol.SIGMA, integer=False, minimum=0.0, strict=True),
        clip_norm=metric_number(metrics, protocol.CLIP_NORM, integer=False, minimum=0.0, strict=True),
        local_steps=int(metric_number(metrics, protocol.LOCAL_STEPS, integer=True, minimum=1, strict=False)),
        lr=metric_number(metrics, protocol.LR, integer=False, minimum=0.0, strict=True),
        round_index=int(metric_number(metrics, protocol.ROUND_INDEX, integer=True, minimum=0, strict=False)),
        batch_size=batch,
        prox_alpha=alpha,
        batch_rate=rate,
    )

"""A node's own rules, applied before it trains (the node's decision, never the server's;
docs/deployment.md §2.5). Each check raises :class:`~fl_dp_flower.protocol.Refused` naming the
setting and the node-config key; the client answers with a refusal reply.

Guardrails (node config): ``min-sigma``, ``max-clip-norm``, ``max-local-steps``, ``max-lr``: the node
never releases a less private update than its operator allows.

Policy:

- ``allow-fixed-seed`` (default false): an instruction with ``dp.seed >= 0`` asks for noise that
  anyone who knows the seed can regenerate and subtract. Refused unless the node config sets
  ``allow-fixed-seed=true`` or the node's environment sets ``FL_DP_ALLOW_FIXED_SEED=1`` (the only
  way in Flower's simulation engine, whose node config holds just the partition).
- ``batch-sampling`` (absent: any): "fixed" or "poisson"; the node refuses an instruction whose
  ``dp.batch-sampling`` differs (e.g. a site that wants every round's batches Poisson-sampled on it,
  docs/MATH.md §23).
- ``share-metrics`` (default false): statistics of local training that are neither noised nor
  accounted (train loss, clipped fraction, train seconds, non-finite gradients) are sent only when
  the node config sets it (or ``FL_DP_SHARE_METRICS=1`` in the node's environment). They are outside the
  certificate; with Poisson batches they also depend on the batches drawn, which voids the node's batch
  amplification (the server warns once per run: :mod:`fl_dp_flower.strategies.shared_stats`, which says why
  ``train-seconds`` is not withheld alone).
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import Any

from .protocol import BATCH_SAMPLING, CLIP_NORM, LOCAL_STEPS, LR, SEED, SIGMA, Refused, TrainInstruction
from .vocabulary import BATCH_SAMPLINGS

NODE_LIMITS = {  # node-config key -> (setting, comparison that must hold)
    "min-sigma": (SIGMA, ">="),
    "max-clip-norm": (CLIP_NORM, "<="),
    "max-local-steps": (LOCAL_STEPS, "<="),
    "max-lr": (LR, "<="),
}
ALLOW_FIXED_SEED = "allow-fixed-seed"  # node-config key (bool)
ALLOW_FIXED_SEED_ENV = "FL_DP_ALLOW_FIXED_SEED"  # node environment: "1" allows, like the key
NODE_BATCH_SAMPLING = "batch-sampling"  # node-config key: the only dp.batch-sampling this node runs
SHARE_METRICS = "share-metrics"  # node-config key (bool): send un-noised train/eval statistics
SHARE_METRICS_ENV = "FL_DP_SHARE_METRICS"  # node environment: "1" shares them, like the key


def check_node_limits(s: TrainInstruction, node_config: Mapping[str, Any]) -> None:
    """Raise Refused if ``s`` violates a min-sigma / max-clip-norm / max-local-steps / max-lr limit."""
    applied = {SIGMA: s.sigma, CLIP_NORM: s.clip_norm, LOCAL_STEPS: s.local_steps, LR: s.lr}
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


def node_flag(node_config: Mapping[str, Any], key: str) -> bool:
    """A boolean node-config switch (absent = false); anything but true/false is refused."""
    value = node_config.get(key, False)
    if not isinstance(value, bool):
        raise Refused(f"node config {key}={value!r} must be true or false")
    return value


def fixed_seed_allowed(node_config: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> bool:
    """Whether this node accepts reproducible (seeded) noise: node config or node environment."""
    env = os.environ if environ is None else environ
    return node_flag(node_config, ALLOW_FIXED_SEED) or env.get(ALLOW_FIXED_SEED_ENV, "") == "1"


def metrics_shared(node_config: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> bool:
    """Whether this node sends un-noised statistics: node config or node environment (the only
    way in Flower's simulation engine, as for allow-fixed-seed)."""
    env = os.environ if environ is None else environ
    return node_flag(node_config, SHARE_METRICS) or env.get(SHARE_METRICS_ENV, "") == "1"


def check_node_policy(s: TrainInstruction, node_config: Mapping[str, Any],
                      environ: Mapping[str, str] | None = None) -> None:
    """Raise Refused if ``s`` asks for a fixed noise seed this node has not allowed, or for batch sampling
    other than the node's ``batch-sampling``."""
    if NODE_BATCH_SAMPLING in node_config:
        wanted = node_config[NODE_BATCH_SAMPLING]
        if wanted not in BATCH_SAMPLINGS:
            raise Refused(f"node config {NODE_BATCH_SAMPLING}={wanted!r} must be one of {BATCH_SAMPLINGS}")
        if s.batch_sampling != wanted:
            raise Refused(f"{BATCH_SAMPLING}={s.batch_sampling!r} differs from this node's "
                          f"{NODE_BATCH_SAMPLING}={wanted!r}")
    if s.seed >= 0 and not fixed_seed_allowed(node_config, environ):
        raise Refused(
            f"{SEED}={s.seed} asks for reproducible noise, which whoever knows the seed can subtract; "
            f"this node allows it only with node config {ALLOW_FIXED_SEED}=true or "
            f"{ALLOW_FIXED_SEED_ENV}=1 in its environment"
        )


def check_node(s: TrainInstruction, node_config: Mapping[str, Any], environ: Mapping[str, str] | None = None) -> None:
    """The node's guardrails, then its policy (raise Refused naming the key)."""
    check_node_limits(s, node_config)
    check_node_policy(s, node_config, environ)

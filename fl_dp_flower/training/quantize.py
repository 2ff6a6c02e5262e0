"""Quantization of the noisy uploads for secure aggregation (docs/MATH.md §20.4).

SecAgg+ sums integer vectors modulo ``modulus_range``. Each client therefore maps its upload (the
noisy update u = Delta + N(0, sigma^2 I), added before this step) to integers: clip every value to
[-R, R], shift and scale to [0, Q] (Q = ``quantization_range``; step s = 2R/Q) and round
stochastically (unbiased; the error of one value is below one step). The server sums the m integer
vectors modulo the field and maps the sum back (minus the m shifts). Flower's own helpers
(:mod:`flwr.common.secure_aggregation.quantization`, the functions SecAgg+ itself uses) do the
scaling and rounding; this module chooses R and Q, counts clipped values and keeps the sum exact.

Choice of R (docs/MATH.md §20.4): the clean update has L2 norm at most B = V * sum_k eta_k (every
local step moves the model by at most eta_k V, FedAvg and FedProx alike), so every coordinate has
|Delta_j| <= B, and u_j = Delta_j + sigma Z_j is clipped only if |Z_j| > (R - B)/sigma. Over the n
values that are quantized (parameters x clients, x rounds when stated per run) the union bound gives

    P(any value clipped) <= 2 n Phi_bar((R - B)/sigma),    so  R = B + sigma * Phi_bar^{-1}(p / (2n))

makes it at most p. Choice of Q: the field must hold the sum of m values in [0, Q] without wrapping,
m Q <= modulus_range - 1; Q is the largest power of two that fits (the finest step).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np
from flwr.common.secure_aggregation.quantization import dequantize, quantize
from scipy.stats import norm

from fl_dp_flower.privacy.validate import int_at_least, positive

__all__ = ["DEFAULT_MODULUS_RANGE", "QuantizationPlan", "clip_probability_bound", "clipping_range",
           "dequantize_sum", "plan_quantization", "quantization_range_for", "quantize_upload", "update_bound"]

#: SecAgg+'s default field (Flower: a power of two, at most 2^32)
DEFAULT_MODULUS_RANGE = 2**32
_MAX_LEVELS = 2**30


def update_bound(clip_norm: float, step_sizes: Sequence[float]) -> float:
    """B = V * sum_k eta_k: the largest L2 norm (hence any coordinate) of a clean local update."""
    v = positive("clip_norm", clip_norm)
    etas = [positive("step_sizes[k]", e) for e in step_sizes]
    if not etas:
        raise ValueError("step_sizes must hold K >= 1 step sizes")
    return v * math.fsum(etas)


def clipping_range(sigma: float, bound: float, values: int, clip_probability: float) -> float:
    """R = B + sigma * Phi_bar^{-1}(p / (2n)): P(any of n values u_j = Delta_j + sigma Z_j, |Delta_j| <= B,
    leaves [-R, R]) <= p by the Gaussian tail and the union bound (module docstring)."""
    s = positive("sigma", sigma)
    if not (isinstance(bound, (int, float)) and math.isfinite(bound) and bound >= 0):
        raise ValueError(f"bound (B, the largest |coordinate| of a clean update) must be a finite number >= 0, "
                         f"got {bound!r}")
    n = int_at_least("values", values, 1)
    if not (isinstance(clip_probability, float) and 0.0 < clip_probability < 1.0):
        raise ValueError(f"clip_probability must be a float in (0, 1), got {clip_probability!r}")
    return float(bound) + s * float(norm.isf(clip_probability / (2.0 * n)))


def clip_probability_bound(clip_range: float, sigma: float, bound: float, values: int) -> float:
    """The union bound min(1, 2 n Phi_bar((R - B)/sigma)) on P(any value clipped) (1 when R <= B)."""
    r, s = positive("clip_range", clip_range), positive("sigma", sigma)
    n = int_at_least("values", values, 1)
    if r <= bound:
        return 1.0
    return min(1.0, 2.0 * n * float(norm.sf((r - bound) / s)))


def quantization_range_for(clients: int, modulus_range: int = DEFAULT_MODULUS_RANGE) -> int:
    """The largest power of two Q <= 2^30 with clients * Q <= modulus_range - 1 (the sum never wraps), >= 2
    (2^30: Flower's stochastic rounding casts to int32, which must hold Q itself)."""
    m = int_at_least("clients", clients, 1)
    mod = int_at_least("modulus_range", modulus_range, 4)
    if mod & (mod - 1):
        raise ValueError(f"modulus_range must be a power of two (SecAgg+), got {modulus_range!r}")
    fits = min((mod - 1) // m, _MAX_LEVELS)
    q = 1 << (fits.bit_length() - 1) if fits >= 1 else 0
    if q < 2:
        raise ValueError(f"modulus_range {modulus_range} cannot hold the sum of {m} clients' values "
                         "(needs clients * 2 <= modulus_range - 1)")
    return q


@dataclass(frozen=True)
class QuantizationPlan:
    """How one round's uploads are quantized: clip range R, levels Q, the field, and what R guarantees.

    ``clip_probability`` p bounds P(any of ``values`` values is clipped) (union bound, module docstring);
    ``step`` = 2R/Q is the grid spacing (parameter units); rounding adds at most one step per value
    (unbiased) and, to the average of m uploads, variance at most step^2/(4m) per value."""

    clip_range: float
    quantization_range: int
    modulus_range: int
    clients: int
    values: int
    clip_probability: float
    update_bound: float
    sigma: float

    @property
    def step(self) -> float:
        return 2.0 * self.clip_range / self.quantization_range

    def to_dict(self) -> dict[str, float | int]:
        return {"clip_range": self.clip_range, "quantization_range": self.quantization_range,
                "modulus_range": self.modulus_range, "clients": self.clients, "values": self.values,
                "clip_probability": self.clip_probability, "update_bound": self.update_bound,
                "sigma": self.sigma, "step": self.step}


def plan_quantization(sigma: float, clip_norm: float, step_sizes: Sequence[float], parameters: int, clients: int,
                      clip_probability: float, *, rounds: int = 1,
                      modulus_range: int = DEFAULT_MODULUS_RANGE) -> QuantizationPlan:
    """R and Q for ``clients`` uploads of ``parameters`` values each, over ``rounds`` rounds (the union
    bound covers parameters x clients x rounds values), so that P(any value clipped) <= ``clip_probability``."""
    n = int_at_least("parameters", parameters, 1) * int_at_least("clients", clients, 1) * int_at_least(
        "rounds", rounds, 1)
    b = update_bound(clip_norm, step_sizes)
    r = clipping_range(sigma, b, n, clip_probability)
    return QuantizationPlan(clip_range=r, quantization_range=quantization_range_for(clients, modulus_range),
                            modulus_range=modulus_range, clients=clients, values=n,
                            clip_probability=clip_probability, update_bound=b, sigma=float(sigma))


def quantize_upload(arrays: Sequence[np.ndarray], plan: QuantizationPlan) -> tuple[list[np.ndarray], int]:
    """(integer arrays in [0, Q], number of values outside [-R, R] that were clipped) for one upload.

    Flower's stochastic rounding draws from numpy's global generator (as SecAgg+ does on the client)."""
    r = plan.clip_range
    clipped = sum(int(np.count_nonzero(np.abs(np.asarray(a, dtype=np.float64)) > r)) for a in arrays)
    as_float = [np.asarray(a, dtype=np.float64) for a in arrays]
    return [np.asarray(q, dtype=np.int64) for q in quantize(as_float, r, plan.quantization_range)], clipped


def dequantize_sum(summed: Sequence[np.ndarray], plan: QuantizationPlan, clients: int) -> list[np.ndarray]:
    """The sum of ``clients`` dequantized uploads from their integer sum (reduced modulo the field):
    each upload q maps back to q * 2R/Q - R, so the sum is S * 2R/Q - clients * R."""
    m = int_at_least("clients", clients, 1)
    if m > plan.clients:
        raise ValueError(f"clients must be at most the planned {plan.clients} (the field holds that many), got {m}")
    reduced = [np.mod(np.asarray(s, dtype=np.int64), plan.modulus_range) for s in summed]
    once = dequantize(reduced, plan.clip_range, plan.quantization_range)  # S * 2R/Q - R
    return [np.asarray(a, dtype=np.float64) - (m - 1) * plan.clip_range for a in once]

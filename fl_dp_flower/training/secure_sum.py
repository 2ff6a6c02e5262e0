"""Integer uploads for secure aggregation: the clean update on a grid plus Skellam noise (docs/MATH.md §20.4).

SecAgg+ sums integers modulo 2^32. Rounding a *noisy* float upload is not post-processing of the
real-valued sum, so under secure aggregation every client instead

1. rounds its clean update Delta = w_local - w_t to the grid of step s (nearest; a power of two):
   a0 = round(Delta / s), integers;
2. adds integer noise a = a0 + Sk, Sk = Poisson(lam) - Poisson(lam) per value, lam = sigma^2 / (2 s^2),
   so the noise variance is sigma^2 in parameter units, as the Gaussian mode's;
3. clamps a to [-H, H), H = 2^29 (the range Flower's quantization passes; the grid plan makes a clamp
   astronomically unlikely and the accountant adds its probability to delta), and uploads k = a + H.

SecAgg+ returns S = sum_i k_i mod 2^32 = (sum_i a_i + n H) mod 2^32, so the server obtains
(sum_i a_i) mod 2^32 exactly: a function of the exact integer sum (no per-client carry), whose noise
sum_i Sk_i is Skellam exactly (privacy/skellam.py accounts it). The server reads the sum as the residue
in [-2^31, 2^31); it is wrong only if the true sum left that range (a wrap), which the grid plan makes
improbable. A wrap is post-processing: it can cost accuracy, never privacy.

Passing k through Flower's SecAgg+ exactly: its client-side ``quantize`` maps a float v to
round((clip(v, -R, R) + R) * L / (2R)) and its workflow prepends the weight factor L to the vector.
With L = :data:`FLOWER_LEVELS` = 2^30 - 1 (odd: the summed factor n * L is never 0 modulo 2^32) and
R = L / 2, the float v = k - R maps to exactly k (every step is exact in float64), and
:func:`decode_sum` inverts the workflow's dequantization exactly (for up to about 2^21 contributors,
where float64 still holds the workflow's intermediate values exactly).
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from fl_dp_flower.privacy.skellam import CLIENT_HALF_RANGE, grid_plan
from fl_dp_flower.privacy.validate import int_at_least, positive

__all__ = ["FLOWER_LEVELS", "FLOWER_MODULUS", "FLOWER_RANGE", "SumGrid", "clamp_upload", "decode_sum", "encode_update",
           "grid_values", "plan_grid", "skellam_noise", "to_flower_values"]

#: SecAgg+'s field (modulus_range): sums are taken modulo 2^32
FLOWER_MODULUS = 2**32
#: Flower's quantization_range L: odd, so the workflow's summed weight factor n * L is never 0 mod 2^32
FLOWER_LEVELS = 2**30 - 1
#: Flower's clipping_range R = L / 2: quantize(k - R) = k exactly for integers k in [0, L]
FLOWER_RANGE = FLOWER_LEVELS / 2


@dataclass(frozen=True)
class SumGrid:
    """The integer encoding of one run's uploads: the grid ``step`` s (parameter units, a power of two)."""

    step: float

    def __post_init__(self) -> None:
        s = positive("step", self.step)
        if math.frexp(s)[0] != 0.5:
            raise ValueError(f"step must be a power of two (exact float arithmetic on the grid), got {self.step!r}")

    def poisson_rate(self, sigma: float) -> float:
        """lam = sigma^2 / (2 s^2): each of the two Poissons of one value's Skellam noise (variance
        2 lam = (sigma/s)^2 grid steps^2, i.e. sigma^2 in parameter units)."""
        return positive("sigma", sigma) ** 2 / (2.0 * self.step**2)


def plan_grid(sigma: float, clip_norm: float, step_sizes: Sequence[float], clients: int, dimension: int, rounds: int,
              wrap_probability: float = 1e-9, members_per_upload: int = 1) -> SumGrid:
    """The finest power-of-two grid for ``clients`` uploads of ``dimension`` values over ``rounds`` rounds whose
    decoded sums wrap with probability at most ``wrap_probability`` (:func:`fl_dp_flower.privacy.skellam.grid_plan`;
    the clean update's coordinates are bounded by B = V sum_k eta_k: every local step moves the model by at
    most eta_k V, FedAvg and FedProx alike). A wrap costs accuracy, never privacy. ``members_per_upload``: the
    most clients one upload sums (a cohort node's clients-per-node); the plan also keeps such a node's sum
    inside the range one upload carries (docs/MATH.md §20.6)."""
    etas = [positive("step_sizes[k]", e) for e in step_sizes]
    if not etas:
        raise ValueError("step_sizes must hold K >= 1 step sizes")
    bound = positive("clip_norm", clip_norm) * math.fsum(etas)
    return SumGrid(step=grid_plan(sigma, bound, clients, dimension, rounds, wrap_probability,
                                  members_per_upload=members_per_upload).step)


def skellam_noise(shape: tuple[int, ...], rate: float, rng: np.random.Generator | None = None) -> np.ndarray:
    """Poisson(rate) - Poisson(rate), int64, of ``shape``; ``rng=None`` seeds numpy's PCG64 from OS
    entropy (``secrets``). numpy's generator is not a cryptographic PRNG (as torch's Gaussian in
    noise-mode ``standard``); the OS-entropy seed makes the noise unpredictable."""
    gen = rng if rng is not None else np.random.default_rng(secrets.randbits(128))
    lam = positive("rate", rate)
    draws = gen.poisson(lam, size=(2, *shape))  # int64, filled value by value: two draws of ``shape`` in turn
    return draws[0] - draws[1]


def grid_values(update: Sequence[np.ndarray], grid: SumGrid, sigma: float,
                rng: np.random.Generator | None = None) -> list[np.ndarray]:
    """a = round(Delta / s) + Skellam(lam) per array of the clean update Delta, int64, not clamped: one
    client's integers (a cohort node sums its members' before clamping, training/cohort_secure.py). The
    noise is drawn array by array in the update's order, two Poisson draws of the array's shape each."""
    rate = grid.poisson_rate(sigma)
    out = []
    for delta in update:
        d = np.asarray(delta, dtype=np.float64)
        if not np.all(np.isfinite(d)):
            raise ValueError("update holds a non-finite value: it cannot be put on the grid")
        out.append(np.rint(d / grid.step).astype(np.int64) + skellam_noise(d.shape, rate, rng))
    return out


def clamp_upload(values: Sequence[np.ndarray]) -> tuple[list[np.ndarray], int]:
    """(k = clamp(a, -H, H - 1) + H per array, int64 in [0, 2^30); the number of clamped values): the
    integers one upload carries through Flower's SecAgg+."""
    out, clamped = [], 0
    for a in values:
        clamped += int(np.count_nonzero((a < -CLIENT_HALF_RANGE) | (a >= CLIENT_HALF_RANGE)))
        out.append(np.clip(a, -CLIENT_HALF_RANGE, CLIENT_HALF_RANGE - 1) + CLIENT_HALF_RANGE)
    return out, clamped


def encode_update(update: Sequence[np.ndarray], grid: SumGrid, sigma: float,
                  rng: np.random.Generator | None = None) -> tuple[list[np.ndarray], int]:
    """(k = clamp(round(Delta / s) + Skellam(lam), -H, H - 1) + H per array of the clean update Delta, int64 in
    [0, 2^30); the number of clamped values): the only noise this client adds under secure aggregation."""
    return clamp_upload(grid_values(update, grid, sigma, rng))


def to_flower_values(encoded: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The floats v = k - R that Flower's ``quantize`` (clipping range R, levels L) maps to exactly k."""
    return [np.asarray(k, dtype=np.int64).astype(np.float64) - FLOWER_RANGE for k in encoded]


def decode_sum(aggregated: Sequence[np.ndarray], contributors: int, grid: SumGrid) -> list[np.ndarray]:
    """The sum of the contributors' (rounded update + noise), parameter units, from the vector Flower's
    ``SecAggPlusWorkflow`` hands to ``aggregate_fit`` (clipping range R, levels L, modulus 2^32).

    The workflow computes ((S mod 2^32) - n R) * L / F with F = (n L) mod 2^32; this inverts it to
    S mod 2^32 = (sum_i a_i + n H) mod 2^32, subtracts n H and takes the residue in [-2^31, 2^31)."""
    n = int_at_least("contributors", contributors, 1)
    factor = (n * FLOWER_LEVELS) % FLOWER_MODULUS
    out = []
    for vec in aggregated:
        s_mod = np.rint(np.asarray(vec, dtype=np.float64) * (factor / FLOWER_LEVELS) + n * FLOWER_RANGE)
        residue = np.mod(s_mod.astype(np.int64) - n * CLIENT_HALF_RANGE, FLOWER_MODULUS)
        centred = np.where(residue >= FLOWER_MODULUS // 2, residue - FLOWER_MODULUS, residue)
        out.append(centred.astype(np.float64) * grid.step)
    return out

"""Tails of the Skellam law and the clamp of one secure-aggregation upload (docs/MATH.md §20.4, §20.6).

:func:`skellam_tail_bound` (Chernoff) bounds P(Poisson(lam) - Poisson(lam) >= k). One upload carries integers
in [-2^29, 2^29) (:data:`CLIENT_HALF_RANGE`: Flower's SecAgg+ quantization passes [0, 2^30)); a client, or a
cohort node summing up to M clients' integers, clamps to that range. :func:`log_clamp_bound` bounds the
probability that any upload of a round is clamped, which the accountant charges to delta; the grid plan
(:func:`.skellam.grid_plan`) keeps the whole run's below e^:data:`CLAMP_PLAN_LOG_BOUND`.
"""

from __future__ import annotations

import math
import numbers

from .validate import int_at_least, nonnegative, positive

__all__ = ["CLAMP_PLAN_LOG_BOUND", "CLIENT_HALF_RANGE", "log_clamp_bound", "log_skellam_tail_bound",
           "skellam_tail_bound"]

#: the largest |integer| one upload may hold: Flower's SecAgg+ quantization takes values in [0, 2^30)
CLIENT_HALF_RANGE = 2**29
#: the grid plan keeps log P(any upload of the run clamped) at or below this (nats): a clamp is charged to delta,
#: (1 + e^eps) P(clamp) <= 1e-6 delta (secure_aggregation.py), which e^-200 meets for every eps - log(delta) <= 186
CLAMP_PLAN_LOG_BOUND = -200.0


def skellam_tail_bound(threshold: float, rate: float) -> float:
    """Chernoff bound on P(X >= threshold) for X = Poisson(rate) - Poisson(rate) (a proven upper bound).

    E exp(tX) = exp(2 rate (cosh t - 1)); with t = asinh(k / (2 rate)) the bound is
    exp(-2 rate (u asinh u - (sqrt(1 + u^2) - 1))), u = k / (2 rate), k = ceil(threshold). 1 for k <= 0.

    Args:
        threshold: k, any real number (X is an integer: P(X >= k) = P(X >= ceil k)).
        rate: the rate of each Poisson, >= 0 (0: X = 0).
    """
    if isinstance(threshold, bool) or not isinstance(threshold, numbers.Real) or math.isnan(float(threshold)):
        raise ValueError(f"threshold must be a real number, got {threshold!r}")
    lam = nonnegative("rate", rate)
    k = math.ceil(float(threshold)) if math.isfinite(float(threshold)) else float(threshold)
    if k <= 0:
        return 1.0
    if lam == 0.0 or math.isinf(k):
        return 0.0
    return math.exp(log_skellam_tail_bound(k, lam))


def log_skellam_tail_bound(threshold: float, rate: float) -> float:
    """The natural log of :func:`skellam_tail_bound` (finite where the bound itself underflows to 0; -inf for
    rate 0 or an infinite threshold, 0 for a threshold <= 0). Same arguments."""
    lam = nonnegative("rate", rate)
    k = math.ceil(float(threshold)) if math.isfinite(float(threshold)) else float(threshold)
    if k <= 0:
        return 0.0
    if lam == 0.0 or math.isinf(k):
        return -math.inf
    u = k / (2.0 * lam)
    return -2.0 * lam * (u * math.asinh(u) - u * u / (1.0 + math.sqrt(1.0 + u * u)))


def log_clamp_bound(step: float, sigma: float, update_bound: float, clients: int, dimension: int,
                    members_per_upload: int = 1) -> float:
    """log of an upper bound on P(some upload's integers of one round leave [-2^29, 2^29)), where they are clamped
    (training/secure_sum.py). An upload sums the integers a = round(Delta/s) + Sk of at most M =
    ``members_per_upload`` clients (1; a cohort node: its members, training/cohort_secure.py): its clean part is
    at most M (B/s + 1/2) per value and its noise is Skellam(M lam), so a clamp needs |Sk(M lam)| >= 2^29 -
    M (B/s + 1/2): two Chernoff tails, union over at most ``clients`` uploads x dimension values. Unlike a wrap,
    a clamp changes an upload: the accountant adds it to delta (docs/MATH.md §20.4, §20.6)."""
    s, sig, b = positive("step", step), positive("sigma", sigma), positive("update_bound", update_bound)
    m, d = int_at_least("clients", clients, 1), int_at_least("dimension", dimension, 1)
    k = int_at_least("members_per_upload", members_per_upload, 1)
    margin = CLIENT_HALF_RANGE - k * (b / s + 0.5)
    if margin <= 0:
        return 0.0
    return min(0.0, math.log(2.0 * m * d) + log_skellam_tail_bound(margin, k * sig * sig / (2.0 * s * s)))

"""Per-round terms of a planned run (docs/MATH.md §4, §13): the Table 2 terms for a planned
schedule (:func:`planned_terms`, ``lr`` restored in CD/ID gamma, ``c = c_K``/``z = z_K`` by
default), the schedule-level per-sample factor theta (:func:`planned_theta`), and the exact
per-round terms the accountant would compute for the planned rounds (:func:`bound_terms`),
the companions of :mod:`closed_forms` and :mod:`planned_bounds`. Units as in :mod:`terms`.

Only ``math``, ``numpy`` and ``scipy`` are used.
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from .records import AccountantConfig
from .schedules import step_sizes
from .terms import (
    _CHUNK,
    _first_step_sensitivity,
    _kappa_from,
    _sum_log1p,
    drift_bound_allowed,
    fedprox_log_rho,
    harmonic,
    per_sample_theta,
    resolve_cyclic_c,
    resolve_iterative_z,
)
from .validate import int_at_least

__all__ = [
    "EXACT_ROUNDS_MAX",
    "EXACT_STEP_BUDGET",
    "bound_terms",
    "exact_rounds_limit",
    "planned_terms",
    "planned_theta",
]


def planned_theta(config: AccountantConfig) -> float:
    """Schedule-level per-sample factor theta = min(1, kappa_0/B) (docs/MATH.md §13 table); 1 per batch.

    K = 1: 1/B exactly (no L needed). K >= 2: 1 (clipping only) unless
    ``config.assume_smooth_losses``; then kappa_0 is the drift factor of the round t = 0,
    which dominates every later round: C/SD ((1 + lr L)^K - 1)/(K lr L); CD/ID
    (prod_n(1 + lr L/n) - 1)/(lr L H_K); FedProx alpha/(alpha - L).
    """
    if config.clipping != "per-sample":
        return 1.0
    K = config.local_steps
    if K == 1:
        return per_sample_theta(1.0, config.batch_size or 1)
    if not drift_bound_allowed(config.clipping, K, config.assume_smooth_losses):
        return 1.0
    L = float(config.smoothness)
    lr = float(config.lr)
    if config.algorithm == "fedprox":
        alpha = config.fedprox_alpha
        kappa = alpha / (alpha - L) if alpha > L else math.inf
    elif L == 0.0:
        kappa = 1.0
    elif config.schedule in ("constant", "stage"):
        kappa = _kappa_from(K * math.log1p(lr * L), K * lr * L)
    else:  # cyclic, iterative: t = 0 steps are lr/(k+1)
        parts = []
        for start in range(1, K + 1, _CHUNK):
            n = np.arange(start, min(K, start + _CHUNK - 1) + 1, dtype=float)
            parts.append(float(np.sum(np.log1p(lr * L / n))))
        kappa = _kappa_from(math.fsum(parts), lr * L * harmonic(K))
    return per_sample_theta(kappa, config.batch_size or 1)


def _log_prod_one_minus(config: AccountantConfig, T: int, rate: float) -> np.ndarray:
    """sum_k log1p(-eta_{k,t} * rate) for t = 0..T-1 (rate: alpha or alpha - L; eta * alpha <= 1)."""
    lr, K = float(config.lr), config.local_steps
    with np.errstate(divide="ignore"):
        if config.schedule in ("constant", "cyclic"):  # the same steps every round
            etas = np.asarray(step_sizes(config.schedule, config.lr, 0, config.local_steps), dtype=float)
            return np.full(T, float(np.sum(np.log1p(-np.minimum(etas * rate, 1.0)))))
        t = np.arange(T, dtype=float)
        if config.schedule == "stage":
            return K * np.log1p(-np.minimum(lr * rate / (t + 1.0), 1.0))
        out = np.empty(T)  # iterative: eta_{k,t} = lr / (tK + k + 1), in chunks of rounds
        k = np.arange(K, dtype=float)
        chunk = max(1, (1 << 22) // K)
        for lo in range(0, T, chunk):
            tt = t[lo:lo + chunk, None]
            out[lo:lo + chunk] = np.sum(np.log1p(-np.minimum(lr * rate / (tt * K + k + 1.0), 1.0)), axis=1)
        return out


def _planned_first_steps(config: AccountantConfig, T: int) -> np.ndarray:
    """eta_{0,t} for t = 0..T-1 (the first local step of each planned round)."""
    lr, K = float(config.lr), config.local_steps
    t = np.arange(T, dtype=float)
    if config.schedule in ("constant", "cyclic"):
        return np.full(T, lr)
    if config.schedule == "stage":
        return lr / (t + 1.0)
    return lr / (t * K + 1.0)


def _planned_fedprox_terms(config: AccountantConfig, T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact per-round FedProx terms (log rho_t, gamma_t, add/remove gamma_t) of the planned rounds
    (what :func:`round_terms` gives them)."""
    alpha, L, V, m = config.fedprox_alpha, float(config.smoothness), float(config.clip_norm), config.clients
    log_rho = np.full(T, fedprox_log_rho(alpha, L))
    client = 2.0 * V * -np.expm1(_log_prod_one_minus(config, T, alpha)) / alpha
    client_ar = client
    if config.local_steps == 1:
        first_ro, first_ar = _first_step_sensitivity(config.clipping, config.batch_size, V)
        first = _planned_first_steps(config, T)
        client, client_ar = first * first_ro, first * first_ar
    elif drift_bound_allowed(config.clipping, config.local_steps, config.assume_smooth_losses) and alpha > L:
        gap = alpha - L
        smooth = (2.0 * V / (config.batch_size or 1)) * -np.expm1(_log_prod_one_minus(config, T, gap)) / gap
        client, client_ar = np.minimum(client, smooth), np.minimum(client_ar, smooth / 2.0)
    return log_rho, client / m, client_ar / m


def _planned_fedavg_sums(config: AccountantConfig, T: int) -> tuple[np.ndarray, np.ndarray]:
    """(sum_k eta_{k,t}, sum_k log1p(eta_{k,t} L)) for t = 0..T-1, from the schedule's own step sizes.

    O(K) for constant/cyclic, O(T) for stage, O(T K) in chunks for iterative.
    """
    lr, K, L = float(config.lr), config.local_steps, float(config.smoothness)
    if config.schedule in ("constant", "cyclic"):
        etas = np.asarray(step_sizes(config.schedule, config.lr, 0, K), dtype=float)
        log_rho = _sum_log1p(etas * L) if L > 0 else 0.0
        return np.full(T, math.fsum(etas.tolist())), np.full(T, log_rho)
    t = np.arange(T, dtype=float)
    if config.schedule == "stage":
        eta = lr / (t + 1.0)
        return K * eta, K * np.log1p(eta * L)
    sums, logs = np.empty(T), np.empty(T)  # iterative: eta_{k,t} = lr / (tK + k + 1)
    k = np.arange(K, dtype=float)
    chunk = max(1, (1 << 22) // K)
    for lo in range(0, T, chunk):
        etas = lr / (t[lo:lo + chunk, None] * K + k + 1.0)
        sums[lo:lo + chunk] = np.sum(etas, axis=1)
        logs[lo:lo + chunk] = np.sum(np.log1p(etas * L), axis=1)
    return sums, logs


def _planned_fedavg_terms(config: AccountantConfig, T: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Exact per-round FedAvg terms (log rho_t, gamma_t, add/remove gamma_t) of the planned rounds:
    what :func:`round_terms` gives them, per-round kappa_t included (docs/MATH.md §13, §16)."""
    V, K, L, m = float(config.clip_norm), config.local_steps, float(config.smoothness), config.clients
    sum_eta, log_rho = _planned_fedavg_sums(config, T)
    if L == 0.0:
        log_rho = np.zeros(T)
    first_ro, first_ar = _first_step_sensitivity(config.clipping, config.batch_size, V)
    first = _planned_first_steps(config, T)
    if K == 1:
        return log_rho, first * first_ro / m, first * first_ar / m
    client = 2.0 * V * sum_eta
    client_ar = np.minimum(first * first_ar + 2.0 * V * (sum_eta - first), client)
    if drift_bound_allowed(config.clipping, K, config.assume_smooth_losses):
        if L > 0:
            with np.errstate(over="ignore", invalid="ignore", divide="ignore"):
                kappa = np.where(log_rho < 700.0, np.expm1(np.minimum(log_rho, 700.0)) / (L * sum_eta), np.inf)
            kappa = np.where(log_rho == 0.0, 1.0, np.where(np.isnan(kappa), np.inf, np.maximum(kappa, 1.0)))
        else:
            kappa = np.ones(T)
        client = client * np.minimum(1.0, kappa / (config.batch_size or 1))
        with np.errstate(invalid="ignore"):
            smooth_half = np.where(np.isfinite(kappa), (V / (config.batch_size or 1)) * kappa * sum_eta, np.inf)
        client_ar = np.minimum(client_ar, smooth_half)
    return log_rho, client / m, client_ar / m


#: bound_terms computes exact terms for at most this many local steps in total (iterative:
#: O(T K)); the rounds beyond get their Table 2 terms, which are upper bounds on both.
EXACT_STEP_BUDGET = 1 << 26
#: and for at most this many rounds (the planner's exact PAVA / direct-sum range).
EXACT_ROUNDS_MAX = 1 << 20


def exact_rounds_limit(config: AccountantConfig) -> int:
    """How many leading planned rounds :func:`bound_terms` gives exactly (>= 1)."""
    if config.schedule == "iterative":
        return max(1, min(EXACT_ROUNDS_MAX, EXACT_STEP_BUDGET // config.local_steps))
    return EXACT_ROUNDS_MAX


def planned_terms(config: AccountantConfig, rounds: int) -> tuple[np.ndarray, np.ndarray]:
    """Table 2 terms (log rho_t, gamma_t) for t = 0..T-1 of a planned run (docs/MATH.md §4, §13).

    m = ``config.clients`` (uniform weights), lr kept in the CD/ID gamma, c = cyclic_c
    or c_K, z = iterative_z or z_K (smaller values raise ValueError), and every gamma_t
    multiplied by the schedule-level per-sample factor theta of :func:`planned_theta`.

    | method  | log rho_t                 | gamma_t                          |
    | C       | K log1p(lr L)             | 2 lr V K / m                     |
    | CD      | c lr L log1p(K)           | 2 c lr V log1p(K) / m            |
    | SD      | K log1p(lr L/(t+1))       | 2 lr V K / (m (t+1))             |
    | ID      | z lr L log1p(1/(t+1))     | 2 z lr V log1p(1/(t+1)) / m      |
    | FedProx | log1p(L/(alpha - L))      | 2V / (m alpha)                   |

    These are the companions of the paper's closed forms. The planner's sound bounds use
    :func:`bound_terms` instead, which differ for FedProx.

    Vectorized (O(T) numpy).
    """
    T = int_at_least("rounds", rounds, 1)
    lr = float(config.lr)
    L = float(config.smoothness)
    K = config.local_steps
    V = float(config.clip_norm)
    m = config.clients
    theta = planned_theta(config)
    if config.algorithm == "fedprox":
        alpha = config.fedprox_alpha
        log_rho = np.full(T, fedprox_log_rho(alpha, L))
        gamma = np.full(T, theta * 2.0 * V / (m * alpha))
        return log_rho, gamma
    schedule = config.schedule
    if schedule == "constant":
        log_rho = np.full(T, K * math.log1p(lr * L))
        gamma = np.full(T, theta * 2.0 * lr * V * K / m)
    elif schedule == "cyclic":
        c = resolve_cyclic_c(config)
        log_rho = np.full(T, c * lr * L * math.log1p(K))
        gamma = np.full(T, theta * 2.0 * c * lr * V * math.log1p(K) / m)
    elif schedule == "stage":
        n = np.arange(1, T + 1, dtype=float)
        log_rho = K * np.log1p((lr * L) / n)
        gamma = (theta * 2.0 * lr * V * K / m) / n
    else:  # iterative
        z = resolve_iterative_z(config)
        n = np.arange(1, T + 1, dtype=float)
        l1p = np.log1p(1.0 / n)
        log_rho = (z * lr * L) * l1p
        gamma = (theta * 2.0 * z * lr * V / m) * l1p
    return log_rho, gamma


def bound_terms(config: AccountantConfig, rounds: int, *, add_remove: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """The terms (log rho_t, gamma_t) the planner's certified bounds (composition, final model,
    local DP) use: for t < :func:`exact_rounds_limit`, the exact record-based terms of each planned
    round's own step sizes, i.e. what the accountant's :func:`round_terms` gives those rounds
    (per-round kappa_t for per-sample clipping, FedProx's telescoped 2V(1 - prod(1 - eta alpha))/alpha);
    beyond, the Table 2 terms of :func:`planned_terms`, which bound both from above.
    ``add_remove``: gamma_t under add/remove-one (docs/MATH.md §16) instead of replace-one.

    The paper's closed forms keep the Table 2 terms. The exact terms are smaller for CD/ID
    (Table 2's c_K, z_K cover the worst round; ID at K = 5 is up to z_K = 3.3 times larger in late
    rounds) and for FedProx (2V/(m alpha) ignores lr and K).
    """
    T = int_at_least("rounds", rounds, 1)
    n = min(T, exact_rounds_limit(config))
    exact = _planned_fedprox_terms if config.algorithm == "fedprox" else _planned_fedavg_terms
    log_rho, gamma, gamma_ar = exact(config, n)
    if add_remove:
        gamma = gamma_ar
    if n == T:
        return log_rho, gamma
    table_rho, table_gamma = planned_terms(config, T)
    if config.algorithm == "fedprox":  # FedProx's Table 2 gamma is K-free; use FedAvg per-batch (>= it)
        fedavg = dataclasses.replace(config, algorithm="fedavg", prox_alpha=None, clipping="per-batch")
        table_gamma = planned_terms(fedavg, T)[1]
    return np.concatenate([log_rho, table_rho[n:]]), np.concatenate([gamma, table_gamma[n:]])

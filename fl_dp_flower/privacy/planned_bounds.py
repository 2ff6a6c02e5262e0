"""The four bounds of a planned homogeneous run (docs/MATH.md §8.1, §10): the mu after T rounds
(:func:`planned_bounds`) and after each round 1..T (:func:`planned_curve`), from the planned
terms of :mod:`planned_terms`, with Hurwitz-zeta tails for very long runs.

Only ``math``, ``numpy`` and ``scipy`` are used.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable

import numpy as np
from scipy.special import zeta

from .bounds import _prefix_sums, _rounds, hidden_clients
from .closed_forms import _paper_form, paper_mu, tanh_ratio
from .final_model import OnlineFinalModel
from .planned_terms import bound_terms, exact_rounds_limit, planned_terms
from .records import AccountantConfig

__all__ = [
    "FINAL_MODEL_EXACT_ROUNDS",
    "planned_bounds",
    "planned_curve",
]


#: planned_bounds runs the exact O(T) PAVA for stage/iterative up to this many rounds;
#: beyond it the final-model value is a sound upper bound (see planned_bounds).
FINAL_MODEL_EXACT_ROUNDS = 1 << 20
# Sums of 1/n^2 and ln^2(1+1/n) are evaluated term by term up to this n, and with
# Hurwitz-zeta differences of the series beyond it (docs/MATH.md §8.1).
_DIRECT_SUM_MAX = 1 << 20


def _sum_inv_pow_tail(k: int, lo: int, hi: int) -> float:
    """sum_{n=lo}^{hi} n^-k via Hurwitz zeta (lo >= 1)."""
    return float(zeta(k, lo) - zeta(k, hi + 1))


def _direct_then_tail(lo: int, hi: int, term: Callable[[np.ndarray], np.ndarray],
                      tail: Callable[[int, int], float]) -> float:
    """sum_{n=lo}^{hi} term(n) (0 if hi < lo): summed directly (small terms first) up to
    2^20, then ``tail(start, hi)`` in closed form."""
    if hi < lo:
        return 0.0
    total = 0.0
    mid = min(hi, _DIRECT_SUM_MAX)
    if lo <= mid:
        total += float(np.sum(term(np.arange(mid, lo - 1, -1, dtype=float))))
    start = max(lo, mid + 1)
    if start <= hi:
        total += tail(start, hi)
    return total


def _sum_inv_sq(lo: int, hi: int) -> float:
    """sum_{n=lo}^{hi} 1/n^2: direct to 2^20, Hurwitz zeta beyond."""
    return _direct_then_tail(lo, hi, lambda n: 1.0 / (n * n), lambda a, b: _sum_inv_pow_tail(2, a, b))


# ln^2(1+u) = u^2 - u^3 + 11u^4/12 - 5u^5/6 + 137u^6/180 + O(u^7), used for n > 2^20 (u < 1e-6)
_LOG1P_SQ_SERIES = ((2, 1.0), (3, -1.0), (4, 11.0 / 12.0), (5, -5.0 / 6.0), (6, 137.0 / 180.0))


def _sum_log1p_inv_sq(lo: int, hi: int) -> float:
    """sum_{n=lo}^{hi} ln^2(1 + 1/n): direct to 2^20, series + Hurwitz zeta beyond."""
    return _direct_then_tail(
        lo, hi, lambda n: np.square(np.log1p(1.0 / n)),
        lambda a, b: math.fsum(c * _sum_inv_pow_tail(k, a, b) for k, c in _LOG1P_SQ_SERIES))


def _is_constant_terms(config: AccountantConfig) -> bool:
    """Every planned round has the same terms (then final model = composition, docs/MATH.md §7.2)."""
    return config.schedule in ("constant", "cyclic")


def _table2_sum_gamma_sq(config: AccountantConfig, first: int, last: int) -> float:
    """sum_{t=first}^{last} gamma_t^2 of the Table 2 terms (0-based t), O(1)/O(2^20): an upper bound
    on the exact terms' sum (FedProx: FedAvg's per-batch terms, 1 - prod(1 - eta alpha) <= alpha sum eta)."""
    if last < first:
        return 0.0
    if config.algorithm == "fedprox":
        config = dataclasses.replace(config, algorithm="fedavg", prox_alpha=None, clipping="per-batch")
    gamma0 = float(planned_terms(config, 1)[1][0])
    if _is_constant_terms(config):
        return (last - first + 1) * gamma0 * gamma0
    if config.schedule == "stage":  # gamma_t = gamma_0/(t+1)
        return gamma0 * gamma0 * _sum_inv_sq(first + 1, last + 1)
    amp = gamma0 / math.log(2.0)  # iterative: gamma_t = amp * ln(1 + 1/(t+1))
    return amp * amp * _sum_log1p_inv_sq(first + 1, last + 1)


def _planned_sum_gamma_sq(config: AccountantConfig, first: int, last: int, add_remove: bool = False) -> float:
    """sum_{t=first}^{last} gamma_t^2 of :func:`terms.bound_terms` (0-based t): the exact terms summed
    directly over their range (O(1) when every round is the same), the Table 2 closed forms beyond."""
    if last < first:
        return 0.0
    if _is_constant_terms(config):
        gamma0 = float(bound_terms(config, 1, add_remove=add_remove)[1][0])
        return (last - first + 1) * gamma0 * gamma0
    direct_last = min(last, exact_rounds_limit(config) - 1)
    total = 0.0
    if first <= direct_last:
        g = bound_terms(config, direct_last + 1, add_remove=add_remove)[1][first:direct_last + 1]
        total += float(np.sum(np.square(g[::-1])))
    if last > direct_last:
        total += _table2_sum_gamma_sq(config, max(first, direct_last + 1), last)
    return total


def planned_bounds(config: AccountantConfig, rounds: int, *, add_remove: bool = False) -> dict[str, float]:
    """The four mu values after ``rounds`` homogeneous planned rounds (keys :data:`BOUND_KEYS`).

    Terms: :func:`terms.bound_terms` (the exact per-round terms the accountant would compute for
    the planned rounds; Table 2 upper bounds beyond :func:`terms.exact_rounds_limit`),
    s_t = sigma*sqrt(m - c_eff)/m (the noise a coalition of ``config.colluders`` participants
    cannot subtract, §14.2a; the accountant's rule for uniform weights; c = 0: sigma/sqrt(m)),
    client sensitivity m*gamma_t (uniform weights 1/m). ``add_remove``: under add/remove-one
    (docs/MATH.md §16); then there is no ``paper`` key.

    - ``paper``: :func:`paper_mu` on the Table 2 terms (O(1)).
    - ``composition``: sqrt(m sum gamma_t^2)/sigma * sqrt(m/(m - c_eff)); O(1) for C/CD, direct sums
      over the exact range and Hurwitz-zeta closed forms of the Table 2 terms beyond (docs/MATH.md §8.1).
    - ``local_dp``: m sqrt(sum gamma_t^2)/sigma (does not depend on c).
    - ``final_model``: equals composition for C/CD (docs/MATH.md §7.2). Otherwise the exact
      PAVA optimum over the first n0 = min(T, exact range) rounds followed by lambda = 1
      (composition) on the rest: exact for T <= n0, beyond a feasible point of the same problem,
      hence a sound upper bound, and <= composition.
    """
    T = _rounds(rounds)
    m = config.clients
    sigma = float(config.sigma)
    hidden = hidden_clients(m, config.colluders) / m  # (m - c_eff)/m: s_t^2 = hidden * sigma^2/m
    sum_sq = _planned_sum_gamma_sq(config, 0, T - 1, add_remove)
    composition = math.sqrt(m * sum_sq) / sigma / math.sqrt(hidden)
    local_dp = m * math.sqrt(sum_sq) / sigma
    if _is_constant_terms(config):
        final = composition
    else:
        n0 = min(T, FINAL_MODEL_EXACT_ROUNDS, exact_rounds_limit(config))
        log_rho, gamma = bound_terms(config, n0, add_remove=add_remove)
        s = sigma / math.sqrt(m) * math.sqrt(hidden)
        model = OnlineFinalModel()
        model._extend_arrays(log_rho, gamma, np.full(n0, s))
        final_sq = model.mu**2
        if T > n0:
            final_sq += m * _planned_sum_gamma_sq(config, n0, T - 1, add_remove) / sigma**2 / hidden
        final = min(math.sqrt(final_sq), composition)
    mus = {"composition": composition, "final_model": final, "local_dp": local_dp}
    return mus if add_remove else {"paper": paper_mu(config, T), **mus}


def planned_curve(config: AccountantConfig, rounds: int) -> dict[str, np.ndarray]:
    """mu after each round 1..T for each bound (keys :data:`BOUND_KEYS`), O(T) in total.

    Same planned terms as :func:`planned_bounds` (exact PAVA over the exact range, then
    lambda = 1 on the rest; a pure-Python pass for stage/iterative, about 1 s per 1e6 rounds).
    """
    T = _rounds(rounds)
    m = config.clients
    sigma = float(config.sigma)
    kind, coef, a = _paper_form(config, None, None)
    t = np.arange(1, T + 1, dtype=float)
    if kind == "sd":
        paper = coef * np.sqrt(2.0 - 1.0 / t)
    else:
        paper = coef * np.sqrt(tanh_ratio(a, t))
    hidden = hidden_clients(m, config.colluders) / m
    log_rho, gamma = bound_terms(config, T)
    cum_sq = _prefix_sums(np.square(gamma))
    composition = np.sqrt(m * cum_sq) / sigma / math.sqrt(hidden)
    local_dp = m * np.sqrt(cum_sq) / sigma
    if _is_constant_terms(config):
        final = composition.copy()
    else:
        n0 = min(T, exact_rounds_limit(config))
        s = sigma / math.sqrt(m) * math.sqrt(hidden)
        out = np.empty(T)
        OnlineFinalModel()._extend_arrays(log_rho[:n0], gamma[:n0], np.full(n0, s), out=out[:n0])
        out[n0:] = out[n0 - 1] + m * (cum_sq[n0:] - cum_sq[n0 - 1]) / sigma**2 / hidden
        final = np.minimum(np.sqrt(out), composition)
    return {"paper": paper, "composition": composition, "final_model": final, "local_dp": local_dp}

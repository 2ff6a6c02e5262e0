"""The paper's closed forms (Theorem 3 (a)-(d) for FedAvg, Theorem 4 for FedProx) of the GDP
parameter mu after T homogeneous rounds (docs/MATH.md §5, §7.3, §10).

Only Theorem 3(c),(d) (stage, iterative) are sound (:func:`bounds.paper_is_sound`); the others
are reported for comparison. The terms are the Table 2 ones of :mod:`planned_terms`.

Only ``math``, ``numpy`` and ``scipy`` are used.
"""

from __future__ import annotations

import math

import numpy as np

from .bounds import _rounds, hidden_clients
from .planned_terms import planned_theta
from .records import AccountantConfig
from .terms import fedprox_log_rho, resolve_cyclic_c, resolve_iterative_z
from .validate import int_at_least, positive

__all__ = [
    "paper_mu",
    "tanh_ratio",
]


def tanh_ratio(a: float | np.ndarray, rounds: float | np.ndarray) -> float | np.ndarray:
    """R(a, T) = tanh(T a/2)/tanh(a/2) = (rho+1)/(rho-1) (rho^T-1)/(rho^T+1), rho = e^a; R(0, T) = T.

    Stable for every a >= 0 and T (no rho^T is formed; docs/MATH.md §2, §10).
    """
    a_arr = np.asarray(a, dtype=float)
    t_arr = np.asarray(rounds, dtype=float)
    den = np.tanh(a_arr / 2.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        r = np.where(den > 0, np.tanh(t_arr * a_arr / 2.0) / np.where(den > 0, den, 1.0), t_arr)
    if np.ndim(r) == 0:
        return float(r)
    return r


def _paper_form(
    config: AccountantConfig, clients: int | None, sigma: float | None
) -> tuple[str, float, float]:
    """(kind, coefficient, a): mu_T = coef * sqrt(R(a, T)) ("tanh") or coef * sqrt(2 - 1/T) ("sd")."""
    m = int_at_least("clients", config.clients if clients is None else clients, 1)
    s = positive("sigma", config.sigma if sigma is None else sigma)
    # sqrt(m) -> sqrt(m - c_eff): the noise a coalition of c participants cannot subtract (§14.2a)
    pref = planned_theta(config) / (math.sqrt(hidden_clients(m, config.colluders)) * s)
    lr = float(config.lr)
    L = float(config.smoothness)
    K = config.local_steps
    V = float(config.clip_norm)
    if config.algorithm == "fedprox":  # Theorem 4
        alpha = config.fedprox_alpha
        if not alpha > L:  # Theorem 4 needs alpha > L: no closed form (an infinite, unsound bound)
            return "sd", math.inf, 0.0
        return "tanh", 2.0 * V / alpha * pref, fedprox_log_rho(alpha, L)
    if config.schedule == "constant":  # Theorem 3(a)
        return "tanh", 2.0 * lr * V * K * pref, K * math.log1p(lr * L)
    if config.schedule == "cyclic":  # Theorem 3(b), lr restored
        c = resolve_cyclic_c(config)
        return "tanh", 2.0 * c * lr * V * math.log1p(K) * pref, c * lr * L * math.log1p(K)
    if config.schedule == "stage":  # Theorem 3(c)
        return "sd", 2.0 * lr * V * K * pref, 0.0
    z = resolve_iterative_z(config)  # Theorem 3(d), lr restored
    return "sd", 2.0 * z * lr * V * pref, 0.0


def paper_mu(
    config: AccountantConfig,
    rounds: int,
    *,
    clients: int | None = None,
    sigma: float | None = None,
) -> float:
    """The paper's stated mu_T (Theorem 3(a)-(d), Theorem 4) in the stable forms of docs/MATH.md §5.

    pref = 1/(sqrt(m - c_eff) sigma) (c_eff of :func:`hidden_clients`; c = 0: the paper's
    1/(sqrt(m) sigma)), R(a, T) = tanh(T a/2)/tanh(a/2):

    - C: 2 lr V K pref sqrt(R(a,T)), a = K log1p(lr L)
    - CD: 2 c lr V log1p(K) pref sqrt(R(a,T)), a = c lr L log1p(K)  (lr restored, c >= c_K)
    - SD: 2 lr V K pref sqrt(2 - 1/T)
    - ID: 2 z lr V pref sqrt(2 - 1/T)  (lr restored, z >= z_K)
    - FedProx: 2V/alpha pref sqrt(R(a,T)), a = log1p(L/(alpha - L))

    times the per-sample factor theta (docs/MATH.md §13). O(1) for any T. ``clients``/``sigma``
    override ``config.clients``/``config.sigma``. Only SD/ID are valid bounds
    (:func:`paper_is_sound`).
    """
    T = _rounds(rounds)
    kind, coef, a = _paper_form(config, clients, sigma)
    if kind == "sd":
        return coef * math.sqrt(2.0 - 1.0 / T)
    return coef * math.sqrt(tanh_ratio(a, T))

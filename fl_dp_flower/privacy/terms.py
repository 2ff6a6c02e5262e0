"""Per-round privacy terms: model-sensitivity factor rho_t, data sensitivity gamma_t,
aggregate noise std s_t, and the per-sample-clipping drift factor (docs/MATH.md §4, §13, §14).

Conventions and units (docs/MATH.md §1):

- ``lr`` is the learning-rate constant, ``eta_{k,t}`` the local step sizes (same units
  as lr), ``V`` (``clip_norm``) the clipping norm in parameter-gradient units, so every
  sensitivity below is a distance in parameter space (same units as ``lr * V``).
- ``L`` (``smoothness``) is the smoothness constant of every (per-sample) loss; it only
  enters rho_t and the drift factor kappa.
- ``sigma`` is the per-client noise **standard deviation**; ``s_t`` is the std of the
  aggregated noise ``sigma * sqrt(sum_i p_i^2)`` (= sigma/sqrt(m) for uniform weights).
- ``rho_t`` is always handled as ``log rho_t`` (rho itself overflows for large K).

Two entry points:

- :func:`round_terms` gives the exact record-based terms of docs/MATH.md §14.1 from the step
  sizes a round actually used (what the accountant consumes).
- :func:`planned_terms` gives the Table 2 terms of docs/MATH.md §4 for a planned schedule (with
  ``lr`` restored in CD/ID gamma, ``c = c_K``/``z = z_K`` by default, and the
  schedule-level per-sample factor theta of docs/MATH.md §13), the companions of the closed
  forms in :mod:`bounds`.

Only ``math``, ``numpy`` and ``scipy`` are used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from .records import AccountantConfig, RoundRecord
from .schedules import step_sizes
from .validate import int_at_least, nonnegative, positive

__all__ = [
    "EULER_GAMMA",
    "RoundTerms",
    "default_cyclic_c",
    "default_iterative_z",
    "drift_kappa",
    "harmonic",
    "per_sample_theta",
    "planned_terms",
    "planned_theta",
    "resolve_cyclic_c",
    "resolve_iterative_z",
    "round_terms",
]

EULER_GAMMA = 0.57721566490153286060651209008240243

# Below this n the harmonic number is summed exactly (fsum); above it the
# Euler-Maclaurin series (terms to n^-8) is accurate to < 1e-17 absolute.
_HARMONIC_DIRECT_MAX = 64
# Chunk size for sums over very long step-size vectors (bounded memory).
_CHUNK = 1 << 20


# ---------------------------------------------------------------- validation helpers


def _step_array(step_sizes: Iterable[float]) -> np.ndarray:
    try:
        etas = np.asarray(step_sizes, dtype=float).ravel()
    except (TypeError, ValueError) as exc:
        raise ValueError(f"step_sizes must be a sequence of numbers > 0: {exc}") from None
    if etas.size < 1:
        raise ValueError("step_sizes must hold K >= 1 step sizes")
    if not np.all(np.isfinite(etas)) or not np.all(etas > 0):
        raise ValueError("step_sizes must all be finite numbers > 0")
    return etas


# ---------------------------------------------------------------- harmonic numbers, c_K, z_K


def harmonic(n: int) -> float:
    """Harmonic number H_n = sum_{k=1}^n 1/k = psi(n+1) + gamma_Euler (H_0 = 0).

    Exact summation (``math.fsum``) for n <= 64, otherwise the Euler-Maclaurin series
    ln n + gamma + 1/(2n) - 1/(12n^2) + 1/(120n^4) - 1/(252n^6) + 1/(240n^8), whose
    truncation error is < 1e-17 there; stable for any n (no cancellation).
    """
    n = int_at_least("n", n, 0)
    if n <= _HARMONIC_DIRECT_MAX:
        return math.fsum(1.0 / k for k in range(1, n + 1))
    x = float(n)
    inv2 = 1.0 / (x * x)
    tail = inv2 * (-1.0 / 12.0 + inv2 * (1.0 / 120.0 + inv2 * (-1.0 / 252.0 + inv2 / 240.0)))
    return math.log(x) + EULER_GAMMA + 0.5 / x + tail


def default_cyclic_c(local_steps: int) -> float:
    """Smallest valid CD constant c_K = H_K / ln(K+1) (docs/MATH.md §4): 1/ln 2 at K = 1, 1.274 at K = 5."""
    k = int_at_least("local_steps", local_steps, 1)
    return harmonic(k) / math.log1p(k)


def default_iterative_z(local_steps: int) -> float:
    """Smallest valid ID constant z_K = H_K / ln 2 (docs/MATH.md §4): 1.443 (K=1), 3.294 (K=5), 20.76 (K=1e6)."""
    k = int_at_least("local_steps", local_steps, 1)
    return harmonic(k) / math.log(2.0)


def _constant_or_minimum(name: str, value: float | None, minimum: float, formula: str, local_steps: int) -> float:
    """``value`` if given and >= ``minimum``, ``minimum`` if None; ValueError below the minimum.

    A constant below its minimum underestimates the per-round sensitivity, so the
    resulting numbers would not be upper bounds (docs/MATH.md §4).
    """
    if value is None:
        return minimum
    if float(value) < minimum:
        raise ValueError(
            f"{name} = {value!r} is below the minimum {formula} = {minimum!r} "
            f"for local_steps K = {local_steps}; a smaller value gives no valid bound"
        )
    return float(value)


@dataclass(frozen=True)
class ScheduleConstant:
    """The constant of a schedule whose per-round terms use one (docs/MATH.md §4)."""

    field: str  # AccountantConfig / AppConfig field: "cyclic_c" or "iterative_z"
    formula: str  # the smallest valid value, as a formula
    minimum: Callable[[int], float]  # K -> that value


#: schedule -> its constant; the one source of the c_K / z_K minimum rule.
SCHEDULE_CONSTANTS: dict[str, ScheduleConstant] = {
    "cyclic": ScheduleConstant("cyclic_c", "c_K = H_K/ln(K+1)", default_cyclic_c),
    "iterative": ScheduleConstant("iterative_z", "z_K = H_K/ln 2", default_iterative_z),
}


def resolve_constant(schedule: str, value: float | None, local_steps: int) -> float:
    """The constant used for ``schedule``'s terms: ``value``, or the minimum when None;
    ValueError (naming the field and the minimum) when ``value`` is below the minimum."""
    spec = SCHEDULE_CONSTANTS[schedule]
    return _constant_or_minimum(spec.field, value, spec.minimum(local_steps), spec.formula, local_steps)


def resolve_cyclic_c(config: AccountantConfig) -> float:
    """c used for the CD terms: ``config.cyclic_c`` or c_K; raises ValueError if c < c_K."""
    return resolve_constant("cyclic", config.cyclic_c, config.local_steps)


def resolve_iterative_z(config: AccountantConfig) -> float:
    """z used for the ID terms: ``config.iterative_z`` or z_K; raises ValueError if z < z_K."""
    return resolve_constant("iterative", config.iterative_z, config.local_steps)


# ---------------------------------------------------------------- per-sample drift factor


def _kappa_from(log_rho: float, l_sum: float) -> float:
    """kappa = expm1(log_rho)/l_sum with l_sum = L * sum eta; inf-safe, >= 1."""
    if log_rho == 0.0 or l_sum == 0.0:
        return 1.0  # L = 0 (or L*eta underflows): (prod - 1)/L reads as sum eta
    if log_rho < 700.0:
        kappa = math.expm1(log_rho) / l_sum
    else:
        # log kappa = a + log(-expm1(-a)) - log(L sum eta); -expm1(-a) == 1 here
        log_kappa = log_rho + math.log(-math.expm1(-log_rho)) - math.log(l_sum)
        kappa = math.exp(log_kappa) if log_kappa < 709.0 else math.inf
    if math.isnan(kappa):
        return math.inf
    return max(1.0, kappa)  # kappa >= 1 exactly; guard against the last-ulp rounding


def _sum_log1p(x: np.ndarray) -> float:
    if x.size <= _CHUNK:
        return float(np.sum(np.log1p(x)))
    return math.fsum(float(np.sum(np.log1p(x[i : i + _CHUNK]))) for i in range(0, x.size, _CHUNK))


def drift_kappa(step_sizes: Iterable[float], smoothness: float) -> float:
    """Per-sample drift factor kappa = (prod_k(1 + eta_k L) - 1) / (L sum_k eta_k) >= 1 (docs/MATH.md §13).

    Evaluated as expm1(sum_k log1p(eta_k L)) / (L sum_k eta_k), in log space when the
    exponent is large; returns ``math.inf`` when kappa overflows a float (then the
    per-sample factor theta is 1). kappa = 1 exactly at L = 0 and for K = 1 (up to
    rounding). Dimensionless.
    """
    etas = _step_array(step_sizes)
    L = nonnegative("smoothness", smoothness)
    if L == 0.0:
        return 1.0
    a = _sum_log1p(etas * L)
    l_sum = L * math.fsum(etas.tolist()) if etas.size <= _CHUNK else L * float(np.sum(etas))
    return _kappa_from(a, l_sum)


def per_sample_theta(kappa: float, batch_size: int) -> float:
    """Per-sample clipping factor theta = min(1, kappa / B) (docs/MATH.md §13), dimensionless.

    Multiplies the per-batch sensitivity 2V sum eta. ``kappa`` may be ``inf``.
    """
    k = positive("kappa", kappa, allow_inf=True)
    b = int_at_least("batch_size", batch_size, 1)
    return min(1.0, k / b)


# ---------------------------------------------------------------- record-based terms (§14.1)


@dataclass(frozen=True)
class RoundTerms:
    """Privacy terms of one round (docs/MATH.md §14.1).

    - ``log_rho``: log of the model-sensitivity factor rho_t (dimensionless, >= 0).
    - ``gamma``: aggregate data sensitivity gamma_t = max_i p_i * Gamma_t (parameter units).
    - ``client_sensitivity``: Gamma_t, sensitivity of one client's upload (parameter units).
    - ``noise_std``: aggregate noise std s_t the coalition of c colluding participants cannot
      subtract, least over every coalition and target (docs/MATH.md §14.2a; c = 0:
      sigma * sqrt(sum_i p_i^2)); the final-model bound pairs it with ``gamma``.
    - ``target_noise_std``: the noise hiding the largest-weight client from the worst
      coalition (>= ``noise_std``; equal for uniform weights); composition uses it.
    - ``sigma``: per-client noise std of the round.

    Per-round GDP contributions: gamma/target_noise_std (central), client_sensitivity/sigma (local).
    """

    log_rho: float
    gamma: float
    client_sensitivity: float
    noise_std: float
    sigma: float
    target_noise_std: float


def _fedprox_parts(etas: np.ndarray, alpha: float, L: float) -> tuple[float, float]:
    """(1 - prod_k(1 - eta_k alpha), 1 - prod_k(1 - eta_k (alpha - L))) for eta_k <= 1/alpha."""
    x = np.minimum(etas * alpha, 1.0)
    with np.errstate(divide="ignore"):
        s1 = _sum_log1p(-x)
    one_minus_prod_alpha = -math.expm1(s1) if s1 != -math.inf else 1.0
    y = np.minimum(etas * (alpha - L), 1.0)
    with np.errstate(divide="ignore"):
        s2 = _sum_log1p(-y)
    one_minus_prod_gap = -math.expm1(s2) if s2 != -math.inf else 1.0
    return one_minus_prod_alpha, one_minus_prod_gap


def round_terms(record: RoundRecord, smoothness: float, colluders: int = 0) -> RoundTerms:
    """Exact per-round terms of docs/MATH.md §14.1 from the step sizes the round actually used.

    FedAvg (Lemmas 7, 8): Gamma = 2V sum_k eta_k, log rho = sum_k log1p(eta_k L).
    Per-sample clipping: Gamma *= theta_t = min(1, kappa_t/B), kappa_t = drift_kappa of
    this round's own steps (docs/MATH.md §13).

    FedProx (Lemmas 9, 10; needs alpha > L and every eta_k <= 1/alpha, else ValueError):
    Gamma = 2V(1 - prod_k(1 - eta_k alpha))/alpha (telescoped, <= 2V/alpha) and the
    paper's log rho = log(alpha/(alpha - L)) = log1p(L/(alpha - L)). Per-sample clipping
    uses the sound telescoped min of docs/MATH.md §13,

        Gamma^ps = min{ 2V(1 - prod(1 - eta_k alpha))/alpha,
                        (2V/B)(1 - prod(1 - eta_k (alpha - L)))/(alpha - L) },

    which is <= theta * Gamma with theta = min(1, alpha/((alpha - L) B)) (so never looser
    than the planned Table 2 value 2V theta/alpha).

    gamma = max_i p_i * Gamma; noise_std and target_noise_std as
    :meth:`RoundRecord.hidden_noise_stds` for a coalition of ``colluders`` participants
    (0 = an outside observer: both are sigma sqrt(sum_i p_i^2)).
    """
    if not isinstance(record, RoundRecord):
        raise ValueError(f"record must be a RoundRecord, got {type(record).__name__}")
    L = nonnegative("smoothness", smoothness)
    etas = np.asarray(record.step_sizes, dtype=float)
    V = float(record.clip_norm)
    per_sample = record.clipping == "per-sample"

    if record.algorithm == "fedprox":
        alpha = float(record.prox_alpha)  # validated > 0 by RoundRecord
        if not alpha > L:
            raise ValueError(
                f"prox_alpha must be > smoothness L = {L!r} for fedprox, got {record.prox_alpha!r}"
            )
        max_eta = float(np.max(etas))
        if max_eta > 1.0 / alpha:
            raise ValueError(
                f"step_sizes must all be <= 1/prox_alpha = {1.0 / alpha!r} for fedprox "
                f"(the FedProx sensitivity bound needs it), got a step size {max_eta!r}"
            )
        gap = alpha - L
        frac_alpha, frac_gap = _fedprox_parts(etas, alpha, L)
        client = 2.0 * V * frac_alpha / alpha
        if per_sample:
            client = min(client, (2.0 * V / record.batch_size) * frac_gap / gap)
        log_rho = math.log1p(L / gap)
    else:
        sum_eta = math.fsum(record.step_sizes)
        client = 2.0 * V * sum_eta
        log_rho = _sum_log1p(etas * L) if L > 0 else 0.0
        if per_sample:
            kappa = _kappa_from(log_rho, L * sum_eta) if L > 0 else 1.0
            client *= per_sample_theta(kappa, record.batch_size)

    s_min, s_target = record.hidden_noise_stds(colluders)
    return RoundTerms(
        log_rho=float(log_rho),
        gamma=record.max_weight * client,
        client_sensitivity=float(client),
        noise_std=s_min,
        sigma=float(record.sigma),
        target_noise_std=s_target,
    )


# ---------------------------------------------------------------- planned (Table 2) terms


def planned_theta(config: AccountantConfig) -> float:
    """Schedule-level per-sample factor theta = min(1, kappa_0/B) (docs/MATH.md §13 table); 1 per batch.

    kappa_0 is the drift factor of the round t = 0, which dominates every later round:
    C/SD ((1 + lr L)^K - 1)/(K lr L); CD/ID (prod_n(1 + lr L/n) - 1)/(lr L H_K);
    FedProx alpha/(alpha - L).
    """
    if config.clipping != "per-sample":
        return 1.0
    L = float(config.smoothness)
    K = config.local_steps
    lr = float(config.lr)
    if config.algorithm == "fedprox":
        alpha = float(config.prox_alpha)
        kappa = alpha / (alpha - L)
    elif L == 0.0:
        kappa = 1.0
    elif config.schedule in ("constant", "stage"):
        kappa = _kappa_from(K * math.log1p(lr * L), K * lr * L)
    else:  # cyclic, iterative: t = 0 steps are lr/(k+1)
        a = 0.0
        parts = []
        for start in range(1, K + 1, _CHUNK):
            n = np.arange(start, min(K, start + _CHUNK - 1) + 1, dtype=float)
            parts.append(float(np.sum(np.log1p(lr * L / n))))
        a = math.fsum(parts)
        kappa = _kappa_from(a, lr * L * harmonic(K))
    return per_sample_theta(kappa, config.batch_size)


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


def _planned_fedprox_terms(config: AccountantConfig, T: int) -> tuple[np.ndarray, np.ndarray]:
    """Exact per-round FedProx terms of the planned rounds (what :func:`round_terms` gives them)."""
    alpha, L, V, m = float(config.prox_alpha), float(config.smoothness), float(config.clip_norm), config.clients
    log_rho = np.full(T, math.log1p(L / (alpha - L)))
    client = 2.0 * V * -np.expm1(_log_prod_one_minus(config, T, alpha)) / alpha
    if config.clipping == "per-sample":
        gap = alpha - L
        client = np.minimum(client, (2.0 * V / config.batch_size) * -np.expm1(_log_prod_one_minus(config, T, gap)) / gap)
    return log_rho, client / m


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
        alpha = float(config.prox_alpha)
        log_rho = np.full(T, math.log1p(L / (alpha - L)))
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


def bound_terms(config: AccountantConfig, rounds: int) -> tuple[np.ndarray, np.ndarray]:
    """The terms the planner's sound bounds (composition, final model, local DP) use.

    FedAvg: :func:`planned_terms`. FedProx: the exact telescoped sensitivity of each planned
    round's own step sizes, 2V (1 - prod_k(1 - eta_k alpha)) / (m alpha) (with the per-sample
    minimum of docs/MATH.md §13), i.e. what the accountant's :func:`round_terms` gives those
    rounds, instead of the paper's 2V/(m alpha), which ignores lr and K (at lr 0.05, K 5,
    alpha 2 it is 2.4 times larger).
    """
    T = int_at_least("rounds", rounds, 1)
    if config.algorithm == "fedprox":
        return _planned_fedprox_terms(config, T)
    return planned_terms(config, T)

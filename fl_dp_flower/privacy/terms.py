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
- :func:`planned_terms.planned_terms` (module :mod:`planned_terms`) gives the Table 2 terms of
  docs/MATH.md §4 for a planned schedule (with ``lr`` restored in CD/ID gamma, ``c = c_K``/``z = z_K``
  by default, and the schedule-level per-sample factor theta of docs/MATH.md §13), the companions
  of the closed forms in :mod:`closed_forms`.

Only ``math``, ``numpy`` and ``scipy`` are used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Iterable

import numpy as np

from .records import AccountantConfig, RoundRecord
from .validate import int_at_least, nonnegative, positive

__all__ = [
    "EULER_GAMMA",
    "RoundTerms",
    "default_cyclic_c",
    "default_iterative_z",
    "drift_bound_allowed",
    "drift_kappa",
    "harmonic",
    "per_sample_theta",
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
    """Privacy terms of one round (docs/MATH.md §14.1), under replace-one and add/remove-one.

    - ``log_rho``: log of the model-sensitivity factor rho_t (dimensionless, >= 0).
    - ``gamma``: aggregate data sensitivity gamma_t = max_i p_i * Gamma_t (parameter units).
    - ``client_sensitivity``: Gamma_t, sensitivity of one client's upload (parameter units).
    - ``noise_std``: aggregate noise std s_t the coalition of c colluding participants cannot
      subtract, least over every coalition and target (docs/MATH.md §14.2a; c = 0:
      sigma * sqrt(sum_i p_i^2)); the final-model bound pairs it with ``gamma``.
    - ``target_noise_std``: the noise hiding the largest-weight client from the worst
      coalition (>= ``noise_std``; equal for uniform weights); composition uses it.
    - ``sigma``: per-client noise std of the round.
    - ``client_sensitivity_add_remove`` / ``gamma_add_remove``: the same sensitivities under
      add/remove-one with the zero-substitution convention (docs/MATH.md §16), <= the
      replace-one values.
    - ``uses_smoothness``: whether the sensitivities above may rest on the L-smoothness
      assertion (per-sample clipping, K >= 2, ``assume_smooth_losses``: the drift bound is
      used); then composition and local DP are reported as conditional on L-smooth losses.

    Per-round GDP contributions: gamma/target_noise_std (central), client_sensitivity/sigma (local).
    """

    log_rho: float
    gamma: float
    client_sensitivity: float
    noise_std: float
    sigma: float
    target_noise_std: float
    client_sensitivity_add_remove: float = math.nan
    gamma_add_remove: float = math.nan
    uses_smoothness: bool = False


def fedprox_log_rho(alpha: float, L: float) -> float:
    """FedProx's log rho_t = log(alpha / (alpha - L)) (docs/MATH.md §3); ``inf`` when alpha <= L: the
    L-dependent bounds (paper, final-model, per-sample drift) then say nothing, while the clipping-only
    sensitivity 2V(1 - prod(1 - eta alpha))/alpha, which needs only eta alpha <= 1, still holds."""
    return math.log1p(L / (alpha - L)) if alpha > L else math.inf


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


def drift_bound_allowed(clipping: str, local_steps: int, assume_smooth_losses: bool) -> bool:
    """Whether per-sample clipping may use the L-dependent drift bound theta < 1 (docs/MATH.md §13).

    Only with per-sample clipping, K >= 2 and the operator's explicit assertion that every
    per-sample loss is L-smooth. Without it the clipping-only sensitivity 2V sum eta holds
    (theta = 1). K = 1 needs no L: one step from a common point, theta = 1/B exactly.
    """
    return clipping == "per-sample" and local_steps >= 2 and bool(assume_smooth_losses)


def _first_step_sensitivity(clipping: str, batch_size: int | None, clip_norm: float) -> tuple[float, float]:
    """(replace-one, add/remove-one) bound on the change of one local step's gradient at a common
    point caused by the differing sample (docs/MATH.md §13, §16), in gradient units.

    Per-sample: 2V/B and V/B (the removed sample's clipped gradient becomes zero). Per-batch:
    2V and, only for B = 1 (the step's gradient is that one sample's), V; per-batch with B > 1
    (or B unknown) keeps 2V under add/remove, since clip_V(a) and clip_V(a - g/B) can differ by 2V.
    """
    V = float(clip_norm)
    if clipping == "per-sample":
        return 2.0 * V / (batch_size or 1), V / (batch_size or 1)
    if batch_size == 1:
        return 2.0 * V, V
    return 2.0 * V, 2.0 * V


def round_terms(record: RoundRecord, smoothness: float, colluders: int = 0,
                assume_smooth_losses: bool = False) -> RoundTerms:
    """Exact per-round terms of docs/MATH.md §14.1 from the step sizes the round actually used.

    FedAvg (Lemmas 7, 8): Gamma = 2V sum_k eta_k, log rho = sum_k log1p(eta_k L).
    Per-sample clipping: K = 1 gives Gamma = 2V eta/B (theta = 1/B, no L needed). With K >= 2
    Gamma is the clipping-only 2V sum eta unless ``assume_smooth_losses``; then
    Gamma *= theta_t = min(1, kappa_t/B), kappa_t = drift_kappa of this round's own steps
    (docs/MATH.md §13).

    FedProx (Lemmas 9, 10; needs every eta_k <= 1/alpha, else ValueError; alpha <= L: rho = inf, no drift bound):
    Gamma = 2V(1 - prod_k(1 - eta_k alpha))/alpha (telescoped, <= 2V/alpha) and the
    paper's log rho = log(alpha/(alpha - L)) = log1p(L/(alpha - L)). Per-sample clipping
    (K = 1: divided by B; K >= 2 only with ``assume_smooth_losses``) uses the sound
    telescoped min of docs/MATH.md §13,

        Gamma^ps = min{ 2V(1 - prod(1 - eta_k alpha))/alpha,
                        (2V/B)(1 - prod(1 - eta_k (alpha - L)))/(alpha - L) }.

    Add/remove-one (docs/MATH.md §16): the step that first uses the differing sample moves
    by the first-step bound d1 of :func:`_first_step_sensitivity`, every later step by 2V
    (FedAvg: Gamma^ar = eta_0 d1 + 2V sum_{k>=1} eta_k; FedProx K >= 2: the replace-one
    value); the drift bound (when allowed) is halved exactly.

    gamma = max_i p_i * Gamma; noise_std and target_noise_std as
    :meth:`RoundRecord.hidden_noise_stds` for a coalition of ``colluders`` participants
    (0 = an outside observer: both are sigma sqrt(sum_i p_i^2)).
    """
    if not isinstance(record, RoundRecord):
        raise ValueError(f"record must be a RoundRecord, got {type(record).__name__}")
    L = nonnegative("smoothness", smoothness)
    etas = np.asarray(record.step_sizes, dtype=float)
    V = float(record.clip_norm)
    K = record.local_steps
    drift = drift_bound_allowed(record.clipping, K, assume_smooth_losses)
    first_ro, first_ar = _first_step_sensitivity(record.clipping, record.batch_size, V)

    if record.algorithm == "fedprox":
        if record.prox_alpha is None:  # RoundRecord validates prox_alpha > 0 for fedprox; never None here
            raise ValueError("a fedprox round needs prox_alpha (> 0)")
        alpha = float(record.prox_alpha)
        max_eta = float(np.max(etas))
        if max_eta > 1.0 / alpha:
            raise ValueError(
                f"step_sizes must all be <= 1/prox_alpha = {1.0 / alpha!r} for fedprox "
                f"(the FedProx sensitivity bound needs it), got a step size {max_eta!r}"
            )
        gap = alpha - L
        frac_alpha, frac_gap = _fedprox_parts(etas, alpha, L)
        client = 2.0 * V * frac_alpha / alpha
        client_ar = client
        if K == 1:  # one step from w_t: the prox term is common, eta times the first-step bound
            client, client_ar = etas[0] * first_ro, etas[0] * first_ar
        elif drift and gap > 0:
            smooth = (2.0 * V / (record.batch_size or 1)) * frac_gap / gap
            client, client_ar = min(client, smooth), min(client_ar, smooth / 2.0)
        log_rho = fedprox_log_rho(alpha, L)
    else:
        sum_eta = math.fsum(record.step_sizes)
        clip_only = 2.0 * V * sum_eta
        log_rho = _sum_log1p(etas * L) if L > 0 else 0.0
        client = float(etas[0]) * first_ro if K == 1 else clip_only
        client_ar = float(etas[0]) * first_ar + 2.0 * V * (sum_eta - float(etas[0]))
        client_ar = min(client_ar, client)
        if drift:
            kappa = _kappa_from(log_rho, L * sum_eta) if L > 0 else 1.0
            smooth = (2.0 * V / (record.batch_size or 1)) * kappa * sum_eta if math.isfinite(kappa) else math.inf
            client = clip_only * per_sample_theta(kappa, record.batch_size or 1)
            client_ar = min(client_ar, smooth / 2.0)

    if not record.weights:  # a sampled round nothing entered: no aggregate noise, no data term (§19)
        s_min = s_target = float(record.sigma)
    else:
        s_min, s_target = record.hidden_noise_stds(colluders)
    return RoundTerms(
        log_rho=float(log_rho),
        gamma=record.max_weight * client,
        client_sensitivity=float(client),
        noise_std=s_min,
        sigma=float(record.sigma),
        client_sensitivity_add_remove=float(client_ar),
        gamma_add_remove=record.max_weight * float(client_ar),
        uses_smoothness=drift,
        target_noise_std=s_target,
    )


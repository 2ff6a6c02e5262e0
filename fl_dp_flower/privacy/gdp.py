"""Gaussian differential privacy (GDP) numerics (docs/MATH.md §9, §10).

A mechanism is mu-GDP when distinguishing neighbouring datasets is at least as hard as
distinguishing N(0, 1) from N(mu, 1). A Gaussian mechanism with L2 sensitivity s and noise
std sigma is exactly (s / sigma)-GDP. All quantities are dimensionless; epsilon is in nats
(natural log), delta is a probability.

- :func:`delta`       delta(epsilon) of a mu-GDP mechanism (Lemma 3), evaluated in log space
- :func:`epsilon`     smallest epsilon >= 0 with delta(epsilon) <= delta (inverse of Lemma 3)
- :func:`mu_for`      largest mu with delta_mu(epsilon) <= delta (calibration)
- :func:`tradeoff`    trade-off curve T_G(mu)(alpha) (Definition 4)
- :func:`rdp`         Renyi-DP curve order * mu^2 / 2 (Lemma 4)
- :func:`rdp_epsilon` epsilon via the improved RDP -> (epsilon, delta) conversion
- :func:`compose`     sqrt(sum mu_i^2) (Lemma 5)

Only math, numpy and scipy are used. Invalid inputs raise ValueError naming the argument.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np
from scipy import optimize, special

__all__ = [
    "DEFAULT_RDP_ORDERS",
    "compose",
    "delta",
    "epsilon",
    "mu_for",
    "rdp",
    "rdp_epsilon",
    "tradeoff",
]

#: dp_accounting's ``RdpAccountant`` default orders (dp_accounting/rdp/rdp_privacy_accountant.py).
DEFAULT_RDP_ORDERS: tuple[float, ...] = tuple(
    [1 + x / 10.0 for x in range(1, 100)]
    + [float(x) for x in range(11, 64)]
    + [128.0, 256.0, 512.0, 1024.0]
)

_GL_NODES, _GL_WEIGHTS = np.polynomial.legendre.leggauss(24)
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_BRENT = {"xtol": 1e-300, "rtol": 8.9e-16, "maxiter": 500}


# ----------------------------------------------------------------------------- validation


def _number(name: str, value: Any, allowed: str, ok: Callable[[float], bool]) -> float:
    """Convert ``value`` to float and check ``ok(x)``; raise ValueError naming ``name``."""
    try:
        if isinstance(value, (bool, np.bool_)):
            raise TypeError
        x = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a real number in {allowed}, got {value!r}") from None
    if math.isnan(x) or not ok(x):
        raise ValueError(f"{name} must be in {allowed}, got {value!r}")
    return x


def _mu(value: Any) -> float:
    return _number("mu", value, "[0, inf]", lambda x: x >= 0)


def _eps(value: Any) -> float:
    return _number("epsilon", value, "[0, inf]", lambda x: x >= 0)


def _delta(value: Any) -> float:
    return _number("delta", value, "(0, 1]", lambda x: 0 < x <= 1)


# ----------------------------------------------------------------------------- Lemma 3


def _log_delta(mu: float, eps: float) -> float:
    """log delta_mu(eps) for finite mu > 0 and finite eps >= 0 (docs/MATH.md §9.1).

    With c = -eps/mu and h = mu/2, delta = Phi(c+h) - e^eps Phi(c-h), so
    log delta = log Phi(c+h) + log(-expm1(eps - D)),  D = log Phi(c+h) - log Phi(c-h) > eps.
    For h <= 1, D = integral of phi/Phi over (c-h, c+h), by 24-point Gauss-Legendre with nodes
    c + h*s (the rounded endpoints c +- h are never differenced).
    """
    c, h = -eps / mu, mu / 2.0
    if h <= 1.0:
        x = c + h * _GL_NODES
        d = h * float(np.dot(_GL_WEIGHTS, _SQRT_2_OVER_PI / special.erfcx(-x / math.sqrt(2.0))))
    else:
        d = float(special.log_ndtr(c + h) - special.log_ndtr(c - h))
    tail = -math.expm1(eps - d)
    if tail <= 0.0:  # only reachable by rounding when delta underflows relative to Phi(c+h)
        return -math.inf
    return float(special.log_ndtr(c + h)) + math.log(tail)


def delta(mu: float, epsilon: float) -> float:
    """delta(epsilon) of a mu-GDP mechanism (Lemma 3).

    delta = Phi(-epsilon/mu + mu/2) - e^epsilon Phi(-epsilon/mu - mu/2), evaluated in log space
    without forming e^epsilon (no overflow for epsilon in the thousands, no cancellation for
    tiny mu). delta(0) = erf(mu / (2 sqrt 2)); mu = 0 gives 0; mu = inf gives 1;
    epsilon = inf gives 0 for finite mu. Relative accuracy about 1e-13 (docs/MATH.md §9.1).

    Args:
        mu: GDP parameter in [0, inf].
        epsilon: privacy loss in nats, in [0, inf].
    """
    mu, eps = _mu(mu), _eps(epsilon)
    if mu == 0.0:
        return 0.0
    if math.isinf(mu):
        return 1.0
    if math.isinf(eps):
        return 0.0
    if eps == 0.0:
        return math.erf(mu / (2.0 * math.sqrt(2.0)))
    return math.exp(_log_delta(mu, eps))


def epsilon(mu: float, delta: float) -> float:
    """Smallest epsilon >= 0 with delta_mu(epsilon) <= ``delta`` (inverse of Lemma 3, docs/MATH.md §9.2).

    Returns 0 when delta >= delta_mu(0) = erf(mu / (2 sqrt 2)) (this includes mu = 0 and
    delta = 1) and inf for mu = inf. Otherwise Brent's method on log delta(eps) - log delta over
    the guaranteed bracket [0, mu^2/2 - mu Phi^{-1}(delta)]; relative accuracy ~1e-15.

    Args:
        mu: GDP parameter in [0, inf].
        delta: target delta in (0, 1].
    """
    mu, target = _mu(mu), _delta(delta)
    if target >= 1.0 or mu == 0.0:
        return 0.0
    if math.isinf(mu):
        return math.inf
    if target >= math.erf(mu / (2.0 * math.sqrt(2.0))):
        return 0.0
    log_target = math.log(target)
    hi = mu * mu / 2.0 - mu * float(special.ndtri(target))

    def f(eps: float) -> float:
        return _log_delta(mu, eps) - log_target

    if f(hi) >= 0.0:  # bracket end is a root up to rounding
        return hi
    if f(0.0) <= 0.0:
        return 0.0
    return float(optimize.brentq(f, 0.0, hi, **_BRENT))


def mu_for(epsilon: float, delta: float) -> float:
    """Largest mu such that a mu-GDP mechanism is (epsilon, delta)-DP (docs/MATH.md §9.2).

    delta_mu(epsilon) increases with mu, so this is the root of log delta_mu(epsilon) = log delta.
    Lower bracket: mu_lo = z + sqrt(z^2 + 2 epsilon), z = Phi^{-1}(delta), where the upper
    bound Phi(-epsilon/mu + mu/2) of delta_mu(epsilon) equals delta; upper bracket by doubling;
    then Brent. epsilon = 0 has the closed form 2 sqrt(2) erfinv(delta). Returns inf when
    delta = 1 or epsilon = inf. Calibration: sigma = sensitivity / mu_for(epsilon, delta).

    Args:
        epsilon: target epsilon in nats, in [0, inf].
        delta: target delta in (0, 1].
    """
    eps, target = _eps(epsilon), _delta(delta)
    if target >= 1.0 or math.isinf(eps):
        return math.inf
    if eps == 0.0:
        return 2.0 * math.sqrt(2.0) * float(special.erfinv(target))
    log_target = math.log(target)

    def g(mu: float) -> float:
        return _log_delta(mu, eps) - log_target

    z = float(special.ndtri(target))
    lo = z + math.sqrt(z * z + 2.0 * eps) if z > 0 else 2.0 * eps / (math.sqrt(z * z + 2.0 * eps) - z)
    if g(lo) >= 0.0:
        return lo
    hi = 2.0 * lo
    while g(hi) < 0.0:
        lo, hi = hi, 2.0 * hi
    return float(optimize.brentq(g, lo, hi, **_BRENT))


# ----------------------------------------------------------------------------- other conversions


def tradeoff(mu: float, alpha: Any) -> Any:
    """Trade-off curve T_G(mu)(alpha) = Phi(-Phi^{-1}(alpha) - mu) (Definition 4, docs/MATH.md §9.3).

    The smallest type-II error of a test with type-I error alpha. Evaluated without forming
    1 - alpha. T_G(0)(alpha) = 1 - alpha; T_G(inf) = 0. ``alpha`` may be a scalar (returns a
    float) or an array (returns an ndarray), with values in [0, 1].
    """
    mu = _mu(mu)
    a = np.asarray(alpha, dtype=float)
    if np.any(np.isnan(a)) or np.any((a < 0) | (a > 1)):
        raise ValueError(f"alpha must be in [0, 1], got {alpha!r}")
    if math.isinf(mu):
        out = np.zeros_like(a)
    else:
        with np.errstate(invalid="ignore"):
            out = np.where(a == 0.0, 1.0, special.ndtr(-special.ndtri(a) - mu))
    return float(out) if out.ndim == 0 else out


def rdp(mu: float, order: float) -> float:
    """Renyi-DP of a mu-GDP mechanism at order zeta: zeta * mu^2 / 2 (Lemma 4), in nats.

    Args:
        mu: GDP parameter in [0, inf].
        order: Renyi order zeta, finite and > 1.
    """
    mu = _mu(mu)
    zeta = _number("order", order, "(1, inf)", lambda x: 1 < x < math.inf)
    return zeta * mu * mu / 2.0


def compose(mus: Iterable[float]) -> float:
    """Composition of mu_i-GDP mechanisms: sqrt(sum mu_i^2) (Lemma 5).

    Scaled by max mu_i and summed with math.fsum (no overflow or underflow of the squares).
    Empty input gives 0; any inf gives inf.
    """
    values = [_number("mus[%d]" % i, m, "[0, inf]", lambda x: x >= 0) for i, m in enumerate(mus)]
    top = max(values, default=0.0)
    if top == 0.0 or math.isinf(top):
        return top
    return top * math.sqrt(math.fsum((v / top) ** 2 for v in values))


def rdp_epsilon(
    mu: float, delta: float, orders: Sequence[float] = DEFAULT_RDP_ORDERS
) -> tuple[float, float]:
    """(epsilon, best order) from the RDP curve zeta mu^2/2 of a mu-GDP mechanism (docs/MATH.md §9.4).

    Improved conversion (Canonne-Kamath-Steinke Prop. 12 / Asoodeh et al.):
    epsilon = min over zeta of r + log1p(-1/zeta) - (ln delta + ln zeta)/(zeta - 1), r = zeta mu^2/2,
    with dp_accounting's shortcut epsilon = 0 at orders where delta^2 > 1 - e^{-r} (then
    delta >= TV distance by Bretagnolle-Huber, since KL <= r), clamped at 0. Always >= the exact
    :func:`epsilon`. Matches dp_accounting's RdpAccountant on the same orders.

    Args:
        mu: GDP parameter in [0, inf].
        delta: target delta in (0, 1].
        orders: Renyi orders, each finite and > 1 (default: dp_accounting's defaults).
    """
    mu, target = _mu(mu), _delta(delta)
    zeta = np.array(
        [_number("orders[%d]" % i, z, "(1, inf)", lambda x: 1 < x < math.inf) for i, z in enumerate(orders)]
    )
    if zeta.size == 0:
        raise ValueError("orders must contain at least one order in (1, inf), got an empty sequence")
    r = zeta * (mu * mu / 2.0)
    with np.errstate(invalid="ignore"):
        eps = r + np.log1p(-1.0 / zeta) - (math.log(target) + np.log(zeta)) / (zeta - 1.0)
        eps = np.where(target * target + np.expm1(-r) > 0.0, 0.0, eps)
    best = int(np.argmin(eps))
    return max(0.0, float(eps[best])), float(zeta[best])

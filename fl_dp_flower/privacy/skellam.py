"""The Skellam accountant: distributed DP of an integer secure sum (docs/MATH.md §20.4; issue 20).

Mechanism (one round t). Each client i rounds its CLEAN update Delta_i (parameter units) to the grid of step s
(nearest rounding, deterministic): a_i = round(Delta_i / s) (grid units, integers), adds its own integer noise
Sk(lam) = Poisson(lam) - Poisson(lam) with lam = sigma^2 / (2 s^2) (variance 2 lam = sigma^2 / s^2 grid units^2,
i.e. sigma^2 in parameter units), clamps to [-2^29, 2^29) (:data:`CLIENT_HALF_RANGE`; the accountant charges the
clamp's probability to delta, :func:`log_clamp_bound`) and uploads it offset by 2^29; SecAgg+ sums mod 2^32. The
server learns (sum_i a_i + sum_i Sk_i) mod 2^32: a post-processing of the exact integer sum. A sum of independent Skellams is
Skellam exactly, so against the server and a coalition of c participants (which subtracts its own values) round t
is the multi-dimensional Skellam mechanism with per-coordinate variance (grid units^2)

    V_t = honest_t * sigma_t^2 / s^2,   honest_t = m_t - c_eff,  c_eff = min(c, m_t - 1),

L2 sensitivity D2 = Gamma_t / s + sqrt(d) and L1 sensitivity D1 = sqrt(d) * D2 (grid units; Gamma_t is one
client's sensitivity in parameter units, :func:`terms.round_terms`; nearest rounding moves every coordinate by at
most 1/2, so two rounded vectors differ by at most 1 more per coordinate than the real ones, divided by s).

RDP (Agarwal, Kairouz, Liu, NeurIPS 2021, "The Skellam Mechanism for Differentially Private Federated Learning",
Theorem 3.5 / Corollary 3.6, written with mu = the per-coordinate VARIANCE), integer orders alpha > 1:

    eps(alpha) <= alpha D2^2 / (2 V) + min(((2 alpha - 1) D2^2 + 6 D1) / (4 V^2), 3 D1 / (2 V)).

Rounds compose (adaptively) by adding RDP; (eps, delta) comes from the conversion dp-accounting and Opacus use
(Balle et al. 2020; Canonne-Kamath-Steinke 2020, Prop. 12):
eps = min_alpha rdp(alpha) + log((alpha - 1)/alpha) - (log delta + log alpha) / (alpha - 1).
Adjacency: replacing one sample of one honest client (as Gamma_t). Epsilon is in nats, delta a probability.

Main job (Gamma 4, sigma 0.55, m 4000, c 0, 60 rounds, d 61706, s = 2^-16, delta 1e-5): eps 4.147 at order 6,
against 3.8303 for the real-valued sum's exact GDP (docs/MATH.md §20.2): +8.3 %, of which the RDP conversion is
8.1 % (Gaussian RDP at the same orders: 4.142) and rounding + Skellam 0.1 %.

:func:`grid_plan` chooses s so that the integer sum wraps modulo Q = 2^modulus_bits (2^32 for SecAgg+) with a
stated small probability. A wrap is post-processing of the integer sum: it cannot weaken the guarantee above,
only the model's utility.

Only math, numpy and scipy are used.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from .skellam_tails import (CLIENT_HALF_RANGE, CLAMP_PLAN_LOG_BOUND, log_clamp_bound, log_skellam_tail_bound,
                            skellam_tail_bound)
from .validate import int_at_least, nonnegative, positive

__all__ = [
    "CLIENT_HALF_RANGE",
    "ORDERS",
    "GridPlan",
    "SkellamRound",
    "composed_rdp",
    "epsilon_from_rdp",
    "grid_plan",
    "honest_clients",
    "log_clamp_bound",
    "log_skellam_tail_bound",
    "rounded_sensitivity",
    "skellam_assumption",
    "skellam_epsilon",
    "skellam_rdp",
    "skellam_tail_bound",
    "wrap_bound",
]

#: integer Renyi orders (the theorem needs integers > 1): every order to 256, then coarser to 2^14. The chosen
#: order stays below the largest for eps down to 0.003 at delta 1e-5 (Gaussian curves: order 2560 at eps 0.0023).
#: Above eps ~21 (delta 1e-5) the smallest order 2 wins: orders in (1, 2) are not covered by the theorem, and with
#: the only bound there, r(alpha) <= r(2), would not help (the -log(delta)/(alpha - 1) term only grows).
ORDERS: tuple[int, ...] = tuple(range(2, 257)) + tuple(range(288, 1025, 32)) + (
    1280, 1536, 1792, 2048, 2560, 3072, 3584, 4096, 5120, 6144, 7168, 8192, 10240, 12288, 14336, 16384)

#: SecAgg+ sums modulo 2^32, so the modulus Q = 2^modulus_bits must divide it
MAX_MODULUS_BITS = 32


def skellam_assumption(colluders: int) -> str:
    """The assumptions behind a Skellam bound, to print next to it."""
    c = int_at_least("colluders", colluders, 0)
    return (f"Skellam secure sum: every client rounds its clean update to the grid (nearest) and adds its own "
            f"integer Skellam noise on its device before masking; an honest-but-curious server that sees only "
            f"the sum modulo 2^32; at most c = {c} colluding participants, fewer than SecAgg+'s reconstruction "
            "threshold; RDP of Agarwal-Kairouz-Liu 2021 (Thm 3.5) converted at integer orders (docs/MATH.md §20)")


# ----------------------------------------------------------------------------- one round


def honest_clients(clients: int, colluders: int) -> int:
    """m_t - c_eff with c_eff = min(c, m_t - 1): the clients whose noise the coalition cannot remove (>= 1)."""
    m = int_at_least("clients", clients, 1)
    c = int_at_least("colluders", colluders, 0)
    return m - min(c, m - 1)


def rounded_sensitivity(client_sensitivity: float, step: float, dimension: int) -> tuple[float, float]:
    """(L2, L1) sensitivity in grid units of one client's rounded update.

    L2 = Gamma / s + sqrt(d), L1 = sqrt(d) * L2 (nearest rounding adds at most 1 per coordinate to the gap).

    Args:
        client_sensitivity: Gamma, one client's L2 sensitivity in parameter units, >= 0.
        step: grid step s in parameter units, > 0.
        dimension: d, the number of values summed, >= 1.
    """
    gamma = nonnegative("client_sensitivity", client_sensitivity)
    s = positive("step", step)
    d = int_at_least("dimension", dimension, 1)
    l2 = gamma / s + math.sqrt(d)
    return l2, math.sqrt(d) * l2


def _order(name: str, value: object) -> int:
    """An integer Renyi order >= 2 (numpy integers included; floats, even integral ones, refused)."""
    if isinstance(value, np.integer):
        value = int(value)
    return int_at_least(name, value, 2)


def skellam_rdp(order: int, l2: float, l1: float, variance: float) -> float:
    """RDP at integer ``order`` of the Skellam mechanism (Agarwal-Kairouz-Liu 2021, Thm 3.5), in nats.

    alpha D2^2 / (2 V) + min(((2 alpha - 1) D2^2 + 6 D1) / (4 V^2), 3 D1 / (2 V)).

    Args:
        order: alpha, an integer >= 2.
        l2: D2, the L2 sensitivity in grid units, >= 0.
        l1: D1, the L1 sensitivity in grid units, >= l2 (an L1 norm is never below the L2 norm).
        variance: V, the per-coordinate variance of the Skellam noise in grid units^2, > 0.
    """
    a = _order("order", order)
    d2 = nonnegative("l2", l2)
    d1 = nonnegative("l1", l1)
    if d1 < d2:
        raise ValueError(f"l1 must be >= l2 = {d2!r} (an L1 norm is never below the L2 norm), got {l1!r}")
    v = positive("variance", variance)
    return a * d2 * d2 / (2.0 * v) + min(((2 * a - 1) * d2 * d2 + 6.0 * d1) / (4.0 * v * v), 3.0 * d1 / (2.0 * v))


def _orders(orders: Iterable[object]) -> np.ndarray:
    values = [_order(f"orders[{i}]", o) for i, o in enumerate(orders)]
    if not values:
        raise ValueError("orders must contain at least one integer order >= 2, got an empty sequence")
    return np.array(values, dtype=float)


@dataclass(frozen=True)
class SkellamRound:
    """One round of the Skellam secure sum, as the server + coalition see it.

    Attributes:
        client_sensitivity: Gamma_t, one client's L2 sensitivity in parameter units (>= 0).
        sigma: per-client noise std in parameter units (> 0); each client's Skellam has variance sigma^2 / s^2.
        honest: m_t - c_eff, the clients whose noise the coalition cannot remove (>= 1; :func:`honest_clients`).
        step: grid step s in parameter units (> 0).
        dimension: d, the number of values summed (>= 1).
    """

    client_sensitivity: float
    sigma: float
    honest: int
    step: float
    dimension: int

    def __post_init__(self) -> None:
        nonnegative("client_sensitivity", self.client_sensitivity)
        positive("sigma", self.sigma)
        int_at_least("honest", self.honest, 1)
        positive("step", self.step)
        int_at_least("dimension", self.dimension, 1)

    @property
    def variance(self) -> float:
        """V_t = honest * sigma^2 / s^2, per coordinate, in grid units^2."""
        return self.honest * (self.sigma / self.step) ** 2

    @property
    def sensitivity(self) -> tuple[float, float]:
        """(D2, D1) in grid units (:func:`rounded_sensitivity`)."""
        return rounded_sensitivity(self.client_sensitivity, self.step, self.dimension)

    def rdp(self, orders: Iterable[object] = ORDERS) -> np.ndarray:
        """The round's RDP bound at each integer order (nats)."""
        return self._curve(_orders(orders))

    def _curve(self, a: np.ndarray) -> np.ndarray:
        d2, d1 = self.sensitivity
        v = self.variance
        return a * d2 * d2 / (2.0 * v) + np.minimum(((2.0 * a - 1.0) * d2 * d2 + 6.0 * d1) / (4.0 * v * v),
                                                    3.0 * d1 / (2.0 * v))


# ----------------------------------------------------------------------------- composition and conversion


def composed_rdp(rounds: Iterable[SkellamRound], orders: Iterable[object] = ORDERS) -> np.ndarray:
    """Sum of the rounds' RDP curves (adaptive composition), at each order; zeros for no rounds."""
    a = _orders(orders)
    total = np.zeros_like(a)
    for i, r in enumerate(rounds):
        if not isinstance(r, SkellamRound):
            raise ValueError(f"rounds[{i}] must be a SkellamRound, got {type(r).__name__}")
        total = total + r._curve(a)
    return total


def epsilon_from_rdp(rdp: Sequence[float] | np.ndarray, orders: Sequence[Any], delta: float) -> tuple[float, int]:
    """(epsilon, order) from an RDP curve, as dp_accounting's ``compute_epsilon`` does.

    eps = min over alpha of r + log1p(-1/alpha) - (log delta + log alpha)/(alpha - 1) (Balle et al. 2020 /
    Canonne-Kamath-Steinke Prop. 12), with its shortcut eps = 0 at an order where delta^2 > 1 - e^{-r}
    (Bretagnolle-Huber: KL <= r bounds the TV distance below delta), clamped at 0.

    Args:
        rdp: RDP values in nats (finite, >= 0), one per order.
        orders: integer orders >= 2, as many as ``rdp``.
        delta: target delta in (0, 1).
    """
    a = _orders(orders)
    r = np.asarray(rdp, dtype=float)
    if r.shape != a.shape:
        raise ValueError(f"rdp must have one value per order ({a.size}), got shape {r.shape}")
    if not np.all(np.isfinite(r)) or np.any(r < 0):
        raise ValueError(f"rdp must be finite numbers >= 0, got {rdp!r}")
    if isinstance(delta, bool) or not isinstance(delta, numbers.Real) or not 0.0 < float(delta) < 1.0:
        raise ValueError(f"delta must be a number in (0, 1), got {delta!r}")
    log_delta = math.log(float(delta))
    eps = r + np.log1p(-1.0 / a) - (log_delta + np.log(a)) / (a - 1.0)
    eps = np.where(float(delta) ** 2 + np.expm1(-r) > 0.0, 0.0, eps)
    best = int(np.argmin(eps))
    return max(0.0, float(eps[best])), int(a[best])


def skellam_epsilon(rounds: Iterable[SkellamRound], delta: float, orders: Sequence[Any] = ORDERS) -> float:
    """Epsilon (nats) at ``delta`` of the composed Skellam rounds (:func:`composed_rdp`, :func:`epsilon_from_rdp`)."""
    return epsilon_from_rdp(composed_rdp(rounds, orders), orders, delta)[0]


# ----------------------------------------------------------------------------- the grid


def _plan_inputs(sigma: float, update_bound: float, clients: int, dimension: int, rounds: int,
                 modulus_bits: int) -> tuple[float, float, int, int, int, int]:
    bits = int_at_least("modulus_bits", modulus_bits, 2)
    if bits > MAX_MODULUS_BITS:
        raise ValueError(f"modulus_bits must be an integer in [2, {MAX_MODULUS_BITS}] (SecAgg+ sums modulo 2^32), "
                         f"got {modulus_bits!r}")
    return (positive("sigma", sigma), positive("update_bound", update_bound), int_at_least("clients", clients, 1),
            int_at_least("dimension", dimension, 1), int_at_least("rounds", rounds, 1), bits)


def wrap_bound(step: float, sigma: float, update_bound: float, clients: int, dimension: int, rounds: int,
               modulus_bits: int = 30) -> float:
    """Upper bound on P(some coordinate of some round's integer sum leaves (-Q/2, Q/2)), Q = 2^modulus_bits.

    A coordinate's sum is A + Sk with |A| = |sum_i round(Delta_ij / s)| <= m (B / s + 1/2) and Sk the sum of the
    m clients' Skellams (rate m sigma^2 / (2 s^2) each side). It leaves the interval only if
    |Sk| >= Q/2 - m (B/s + 1/2): two tails of :func:`skellam_tail_bound` (Chernoff), union bound over
    dimension x rounds values; capped at 1.

    Args:
        step: s in parameter units, > 0.
        sigma: per-client noise std in parameter units, > 0.
        update_bound: B >= |Delta_ij| for every value of a clean update (e.g. its L2 bound), parameter units, > 0.
        clients: m, the most clients in one sum, >= 1.
        dimension: d, values per update, >= 1.
        rounds: rounds of the run, >= 1.
        modulus_bits: log2 Q, an integer in [2, 32].
    """
    s = positive("step", step)
    sig, b, m, d, t, bits = _plan_inputs(sigma, update_bound, clients, dimension, rounds, modulus_bits)
    margin = 2.0 ** (bits - 1) - m * (b / s + 0.5)
    if margin <= 0:
        return 1.0
    rate = m * sig * sig / (2.0 * s * s)
    tail = skellam_tail_bound(margin, rate)
    if tail == 0.0:
        return 0.0
    return min(1.0, math.exp(math.log(2.0 * d * t) + math.log(tail)))


@dataclass(frozen=True)
class GridPlan:
    """The grid of a Skellam secure sum (:func:`grid_plan`).

    Attributes:
        step: s, a power of two, parameter units per grid unit.
        modulus: Q = 2^modulus_bits; the server decodes the sum modulo Q into [-Q/2, Q/2).
        poisson_rate: lam = sigma^2 / (2 s^2), each client's rate of each of its two Poissons.
        wrap_bound: the bound achieved on P(any value of any round wraps) (:func:`wrap_bound`, <= wrap_probability).
        sigma, update_bound, clients, dimension, rounds, wrap_probability: the inputs.
    """

    step: float
    modulus: int
    poisson_rate: float
    wrap_bound: float
    sigma: float
    update_bound: float
    clients: int
    dimension: int
    rounds: int
    wrap_probability: float

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def grid_plan(sigma: float, update_bound: float, clients: int, dimension: int, rounds: int,
              wrap_probability: float, modulus_bits: int = 32, members_per_upload: int = 1) -> GridPlan:
    """The smallest power-of-two step s (finest grid) whose wrap bound is at most ``wrap_probability``.

    A power of two keeps float arithmetic on grid values exact. The bound (:func:`wrap_bound`) is a Chernoff bound
    on the Skellam tail and a union bound over dimension x rounds values, for the worst clean sum m (B/s + 1/2).
    Steps coarser than sigma are not considered (each client's noise would be under one grid unit): no such plan
    raises ValueError. A wrap is post-processing of the integer sum: it never weakens the privacy guarantee, only
    the utility of that round's model.

    The step is also coarse enough that no upload is clamped (:func:`log_clamp_bound` with ``members_per_upload``
    clients summed per upload, over all rounds, at most e^:data:`CLAMP_PLAN_LOG_BOUND`): a clamp costs privacy.

    Args: as :func:`wrap_bound`, wrap_probability in (0, 1), and members_per_upload >= 1 (a cohort node's members).
    """
    k = int_at_least("members_per_upload", members_per_upload, 1)
    sig, b, m, d, t, bits = _plan_inputs(sigma, update_bound, clients, dimension, rounds, modulus_bits)
    if isinstance(wrap_probability, bool) or not isinstance(wrap_probability, numbers.Real) \
            or not 0.0 < float(wrap_probability) < 1.0:
        raise ValueError(f"wrap_probability must be a number in (0, 1), got {wrap_probability!r}")
    p = float(wrap_probability)
    half = 2.0 ** (bits - 1)
    if half <= m / 2.0:
        raise ValueError(f"modulus_bits = {bits} is too small for clients = {m}: 2^(modulus_bits - 1) must exceed "
                         "clients / 2 (the rounding of m values alone can reach m/2)")
    # margin > 0 needs s > m B / (Q/2 - m/2): start one power of two below it
    exponent = math.floor(math.log2(m * b / (half - m / 2.0))) - 1
    top = math.floor(math.log2(sig))
    # lam = sigma^2 / (2 s^2) < 2^31: numpy's Poisson sampler loses accuracy at larger rates (float64
    # cancellation in its acceptance test: variance 3 % low at 1.7e14), so the grid is never finer than sigma/2^16
    exponent = max(exponent, top - 15)
    while exponent <= top:
        s = math.ldexp(1.0, exponent)
        bound = wrap_bound(s, sig, b, m, d, t, bits)
        if bound <= p and math.log(t) + log_clamp_bound(s, sig, b, m, d, k) <= CLAMP_PLAN_LOG_BOUND:
            return GridPlan(step=s, modulus=2 ** bits, poisson_rate=sig * sig / (2.0 * s * s), wrap_bound=bound,
                            sigma=sig, update_bound=b, clients=m, dimension=d, rounds=t, wrap_probability=p)
        exponent += 1
    raise ValueError(f"no power-of-two step <= sigma = {sig} keeps the wrap probability <= {p} with "
                     f"modulus_bits = {bits}, clients = {m}, update_bound = {b} (and every upload of up to {k} clients "
                     "in range): raise modulus_bits or wrap_probability, or sum fewer clients per upload")

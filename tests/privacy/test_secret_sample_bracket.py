"""An independent reference for the ``sampled_secret`` composition (issue 31 review P31A): the symmetric pair with
trade-off C_p(G_mu) written down from its densities (not from the privacy profile the package discretises), its
privacy loss histogrammed on a grid by integrating P's density between the loss levels, composed T times by numpy
FFT (no dp-accounting), and epsilon at delta read from the exact hockey-stick sum. Rounding every loss up gives
an upper bracket, down a lower one; the package's epsilon must lie between them (and near their midpoint)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import optimize, special
from scipy.signal import fftconvolve

from fl_dp_flower.privacy.client_sampling import conditioned_epsilon

H = 2e-5  # grid (nats)


def _one_round(p: float, mu: float) -> tuple[np.ndarray, int, float]:
    """P's law of the loss, rounded up to the grid: on {y >= mu/2} (copy A) the loss log(1 - p + p e^{mu y - mu^2/2})
    >= 0 under P = (1 - p) N(0, 1) + p N(mu, 1); its mirror (copy B, P = N(0, 1)) the negated loss; the common atom
    0. Returns (pmf, index of loss 0, P-mass beyond 12 sd put at infinite loss)."""
    top = math.log1p(p * math.expm1(mu * (mu + 12.0) - mu * mu / 2))
    kmax = math.ceil(top / H)
    edges = (np.log1p(np.expm1(np.arange(kmax + 1) * H) / p) + mu * mu / 2) / mu  # y at loss k H
    edges[0] = mu / 2
    tail_a = (1 - p) * special.ndtr(-edges) + p * special.ndtr(mu - edges)  # P(Y >= y) on A
    tail_b = special.ndtr(-edges)  # P(Y >= y) on B
    pmf = np.zeros(2 * kmax + 1)
    pmf[kmax + 1:] += tail_a[:-1] - tail_a[1:]  # loss in ((k-1)H, kH] -> kH
    pmf[kmax - np.arange(1, kmax + 1) + 1] += tail_b[:-1] - tail_b[1:]  # loss in [-kH, -(k-1)H) -> -(k-1)H
    pmf[1] += tail_b[-1]
    pmf[kmax] += 1.0 - tail_a[0] - tail_b[0]
    return pmf, kmax, float(tail_a[-1])


def _epsilon(pmf: np.ndarray, zero: int, inf: float, delta: float) -> float:
    loss = (np.arange(len(pmf)) - zero) * H

    def excess(eps: float) -> float:
        above = loss > eps
        return inf + float(np.sum(pmf[above] * -np.expm1(eps - loss[above]))) - delta

    return 0.0 if excess(0.0) <= 0 else optimize.brentq(excess, 0.0, float(loss.max()))


def _compose(pmf: np.ndarray, zero: int, inf: float, rounds: int) -> tuple[np.ndarray, int, float]:
    """``rounds`` self-convolutions by repeated squaring (FFT); mass below 1e-30 at the bottom lumped up."""
    out: tuple[np.ndarray, int, float] | None = None
    base = (pmf, zero, inf)
    while rounds:
        if rounds & 1:
            out = base if out is None else (np.maximum(fftconvolve(out[0], base[0]), 0.0), out[1] + base[1],
                                            1 - (1 - out[2]) * (1 - base[2]))
        rounds >>= 1
        if rounds:
            sq = np.maximum(fftconvolve(base[0], base[0]), 0.0)
            lo = int(np.argmax(sq > 1e-30))
            sq[lo] += sq[:lo].sum()  # rounded up: pessimistic
            base = (sq[lo:], 2 * base[1] - lo, 1 - (1 - base[2]) ** 2)
    assert out is not None
    return out


@pytest.mark.parametrize("p, mu, rounds", [(0.25, 0.0877, 120), (0.05, 1.0, 20), (0.5, 0.3, 10)])
def test_the_conditioned_epsilon_lies_in_an_independent_bracket(p, mu, rounds):
    out, off, out_inf = _compose(*_one_round(p, mu), rounds)
    upper = _epsilon(out, off, out_inf, 1e-5)
    lower = _epsilon(out, off + rounds, out_inf, 1e-5)  # every round's loss one grid step lower
    ours = conditioned_epsilon([(p, mu)] * rounds, 1e-5)
    assert lower - 1e-9 <= ours <= upper + 1e-9, (lower, ours, upper)
    assert ours == pytest.approx((lower + upper) / 2, rel=1e-3)

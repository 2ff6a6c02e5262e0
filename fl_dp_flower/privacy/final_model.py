"""The final-model (shifted-interpolation) bound: the exact optimum of the paper's relaxed problem
with 0 <= lambda <= 1, via PAVA (docs/MATH.md §7, §14.3), sound when only w_T is released, and
the paper's unconstrained Cauchy-Schwarz formula (a reference, NOT a certified bound).

Inputs are the per-round terms of :mod:`terms` (``log_rho``, ``gamma``, ``noise_std``); every
function returns a GDP parameter mu (dimensionless).

Only ``math``, ``numpy`` and ``scipy`` are used.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
from scipy.special import logsumexp

from .bounds import (
    _NEG_INF,
    _array,
    _log_rho_array,
    _prefix_sums,
    _same_length,
    log_add_exp,
)

__all__ = [
    "OnlineFinalModel",
    "cauchy_schwarz_mu",
    "final_model_mu",
]


class OnlineFinalModel:
    """Incremental exact final-model bound with per-round noise (docs/MATH.md §7.2, §14.3).

    mu_final^2 = sum over PAVA blocks J of (sum_J p_t gamma_t)^2 / sum_J p_t^2 s_t^2, the
    blocks being those of the weighted isotonic (non-decreasing) regression of
    y_t = gamma_t/(p_t s_t^2) with weights p_t^2 s_t^2, where p_t = 1/prod_{j=1}^t rho_j
    (prefix normalization: rho of the first round never enters, nothing depends on T).

    Implementation: a stack of blocks in log space. Each block J = [u..v] stores its sums
    relative to the p of its own first round u (log sum_J (p_t/p_u) gamma_t and
    log sum_J (p_t/p_u)^2 s_t^2 -- the common factor cancels in every block value and every
    comparison), log rho_u, the sum of log rho_j over j = u+1..v, and the cumulative sum of
    block values up to and including itself (so the total needs no subtraction). A push
    appends a singleton and merges backward (logaddexp) while the non-decreasing order is
    violated; amortized O(1), and :attr:`mu` is O(1). With rho_t >= 1 the terms of a merged
    block decay from its first round, so block-start references keep every log near the
    dominant terms and accuracy does not degrade with the number of rounds.
    """

    __slots__ = ("_count", "_cum", "_first", "_inner", "_ld", "_ln", "_unbounded")

    def __init__(self) -> None:
        self._count = 0
        self._ln: list[float] = []  # log sum_J (p_t/p_u) gamma_t
        self._ld: list[float] = []  # log sum_J (p_t/p_u)^2 s_t^2
        self._first: list[float] = []  # log rho_u of the block's first round
        self._inner: list[float] = []  # sum_{j=u+1}^{v} log rho_j
        self._cum: list[float] = []  # cumulative block values (mu^2 so far)
        #: a round with log rho = inf (FedProx with alpha <= L): the bound says nothing from then on
        self._unbounded = False

    def __len__(self) -> int:
        return self._count

    @property
    def mu(self) -> float:
        """mu_final after the rounds pushed so far (0.0 before the first round; inf after a round
        with log rho = inf)."""
        if self._unbounded:
            return math.inf
        return math.sqrt(self._cum[-1]) if self._cum else 0.0

    @property
    def blocks(self) -> int:
        """Number of PAVA blocks (1 = the Cauchy-Schwarz solution is feasible)."""
        return len(self._cum)

    def push(self, log_rho: float, gamma: float, noise_std: float) -> None:
        """Add one round: log rho_t (finite, or +inf: no model-sensitivity bound, mu = inf from then
        on), gamma_t >= 0, s_t > 0 (finite)."""
        log_rho = float(log_rho)
        g = float(gamma)
        s = float(noise_std)
        if log_rho == math.inf:
            self._unbounded = True
            self._count += 1
            return
        if not math.isfinite(log_rho):
            raise ValueError(f"log_rho must be finite or +inf, got {log_rho!r}")
        if not (math.isfinite(g) and g >= 0.0):
            raise ValueError(f"gamma must be a finite number >= 0, got {gamma!r}")
        if not (math.isfinite(s) and s > 0.0):
            raise ValueError(f"noise_std must be a finite number > 0, got {noise_std!r}")
        r = float(np.float64(g) / np.float64(s))
        self._extend([log_rho], [math.log(g) if g > 0.0 else _NEG_INF], [2.0 * math.log(s)], [r * r])

    def peek(self, log_rho: float, gamma: float, noise_std: float) -> float:
        """mu_final after pushing this round, without pushing it (the stack is only read).

        Mirrors :meth:`_extend` step for step, so ``peek`` then ``push`` give the same mu bit
        for bit. Costs as many block merges as the push would do.
        """
        if self._unbounded or float(log_rho) == math.inf:
            return math.inf
        g, s = float(gamma), float(noise_std)
        first, ln, ld = float(log_rho), (math.log(g) if g > 0.0 else _NEG_INF), 2.0 * math.log(s)
        r = float(np.float64(g) / np.float64(s))
        value = r * r
        ln_stack, ld_stack, first_stack, inner_stack, cum_stack = (
            self._ln, self._ld, self._first, self._inner, self._cum
        )
        top = len(ln_stack) - 1
        cum = cum_stack[top] if top >= 0 else 0.0
        if top >= 0 and ln_stack[top] - ld_stack[top] - (inner_stack[top] + first) > ln - ld:
            while True:
                shift = inner_stack[top] + first
                first = first_stack[top]
                ln = log_add_exp(ln_stack[top], ln - shift)
                ld = log_add_exp(ld_stack[top], ld - 2.0 * shift)
                top -= 1
                if not (top >= 0 and ln_stack[top] - ld_stack[top] - (inner_stack[top] + first) > ln - ld):
                    break
            value = math.exp(2.0 * ln - ld) if ln != _NEG_INF else 0.0
            cum = cum_stack[top] if top >= 0 else 0.0
        return math.sqrt(cum + value)

    def _extend_arrays(
        self, log_rhos: np.ndarray, gammas: np.ndarray, noise_stds: np.ndarray, out: np.ndarray | None = None
    ) -> None:
        """Push validated rounds given as arrays (vectorized preparation, then the PAVA pass); from
        the first log rho = inf on, the bound is unbounded (``out`` holds inf there)."""
        infinite = np.flatnonzero(np.isposinf(log_rhos))
        if infinite.size:
            k = int(infinite[0])
            if k:
                self._extend_arrays(log_rhos[:k], gammas[:k], noise_stds[:k], None if out is None else out[:k])
            if out is not None:
                out[k:] = math.inf
            self._unbounded, self._count = True, self._count + len(log_rhos) - k
            return
        # math.log (not np.log) so that the result is bit-identical to push() round by round
        log = math.log
        g_list = gammas.tolist()
        self._extend(
            log_rhos.tolist(),
            [log(g) if g > 0.0 else _NEG_INF for g in g_list],
            [2.0 * log(x) for x in noise_stds.tolist()],
            [r * r for r in (gammas / noise_stds).tolist()],
            out,
        )

    def _extend(
        self,
        shifts: Sequence[float],
        log_nums: Sequence[float],
        log_dens: Sequence[float],
        values: Sequence[float],
        out: np.ndarray | None = None,
    ) -> None:
        """The PAVA pass over prepared rounds: log rho_t, log gamma_t, 2 log s_t, (gamma_t/s_t)^2.

        Optionally stores mu^2 after each round in ``out``.
        """
        ln_stack, ld_stack, first_stack, inner_stack, cum_stack = (
            self._ln, self._ld, self._first, self._inner, self._cum
        )
        ln_push, ld_push, first_push, inner_push, cum_push = (
            ln_stack.append, ld_stack.append, first_stack.append, inner_stack.append, cum_stack.append
        )
        exp = math.exp
        neg_inf = _NEG_INF
        cum = cum_stack[-1] if cum_stack else 0.0
        i = 0
        for first, ln, ld, value in zip(shifts, log_nums, log_dens, values):
            inner = 0.0
            # previous block A = [u..v], current [v+1..]: log(p_u / p_{v+1}) = inner_A + first
            if ln_stack and ln_stack[-1] - ld_stack[-1] - (inner_stack[-1] + first) > ln - ld:
                while True:
                    shift = inner_stack.pop() + first
                    first = first_stack.pop()
                    inner += shift
                    cum_stack.pop()
                    # merge the current block into A, in its normalisation (p_u instead of p_{v+1})
                    ln = log_add_exp(ln_stack.pop(), ln - shift)
                    ld = log_add_exp(ld_stack.pop(), ld - 2.0 * shift)
                    if not (
                        ln_stack and ln_stack[-1] - ld_stack[-1] - (inner_stack[-1] + first) > ln - ld
                    ):
                        break
                value = exp(2.0 * ln - ld) if ln != neg_inf else 0.0
                cum = cum_stack[-1] if cum_stack else 0.0
            ln_push(ln)
            ld_push(ld)
            first_push(first)
            inner_push(inner)
            cum += value
            cum_push(cum)
            if out is not None:
                out[i] = cum
            i += 1
        self._count += i


def final_model_mu(
    log_rhos: Sequence[float], gammas: Sequence[float], noise_stds: Sequence[float]
) -> float:
    """Exact final-model mu (docs/MATH.md §14.3): batch wrapper of :class:`OnlineFinalModel`.

    Sound for an adversary who sees only the final model w_T (given the paper's Lemmas
    6-8); always <= :func:`composition_mu` of the same terms.
    """
    log_rho = _log_rho_array(log_rhos)
    g = _array("gammas", gammas, positive=False)
    s = _array("noise_stds", noise_stds, positive=True)
    _same_length(log_rhos=log_rho, gammas=g, noise_stds=s)
    model = OnlineFinalModel()
    model._extend_arrays(log_rho, g, s)
    return model.mu


def cauchy_schwarz_mu(
    log_rhos: Sequence[float], gammas: Sequence[float], noise_stds: Sequence[float]
) -> float:
    """The paper's general (unconstrained) value sqrt((sum p_t gamma_t)^2 / sum p_t^2 s_t^2).

    docs/MATH.md §2 item 4 / §14.3: p_t = 1/prod_{j=1}^t rho_j, evaluated in log space. This is the
    exact GDP of an abstract linear system but NOT a certified bound (its interpolation
    weights can leave [0, 1], docs/MATH.md §7.1); with s_t = sigma/sqrt(m) it equals
    sqrt(m H_0)/sigma, which the closed forms of Theorems 3(a),(b), 4 reproduce.
    """
    log_rho = _log_rho_array(log_rhos)
    g = _array("gammas", gammas, positive=False)
    s = _array("noise_stds", noise_stds, positive=True)
    _same_length(log_rhos=log_rho, gammas=g, noise_stds=s)
    if log_rho.size == 0:
        return 0.0
    log_p = np.empty(log_rho.size)
    log_p[0] = 0.0
    log_p[1:] = -_prefix_sums(log_rho[1:])
    with np.errstate(divide="ignore"):
        log_num = logsumexp(log_p + np.log(g))
    log_den = logsumexp(2.0 * (log_p + np.log(s)))
    if log_num == _NEG_INF:
        return 0.0
    return math.exp(log_num - 0.5 * log_den)

"""The four Gaussian-DP bounds: the paper's closed forms, composition, the final-model
(shifted-interpolation) optimum, and local DP (docs/MATH.md §5, §7, §8, §14).

Every function returns a GDP parameter mu (dimensionless; T(w; w') >= T_G(mu)).
Inputs are the per-round terms of :mod:`terms`: ``log_rho`` (log of the model-sensitivity
factor rho_t), ``gamma`` (aggregate data sensitivity, parameter units), ``noise_std``
(aggregate noise std s_t, same units), ``client_sensitivity``/``sigma`` for local DP.

Soundness (docs/MATH.md §7.3): the paper's Theorem 3(a),(b) (constant, cyclic) and Theorem 4
(FedProx) are **not** valid bounds (a linear-loss instance beats them for every T >= 2);
Theorem 3(c),(d) (stage, iterative) are, because they dominate composition.
:func:`composition_mu` (all rounds visible), :func:`final_model_mu` (only w_T released;
exact optimum of the paper's relaxed problem with 0 <= lambda <= 1, via PAVA) and
:func:`local_dp_mu` (curious server) are sound. :func:`cauchy_schwarz_mu` is the paper's
unconstrained general formula, kept only as a reference: it is NOT a certified bound.

Only ``math``, ``numpy`` and ``scipy`` are used.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
from scipy.special import logsumexp, zeta

from .records import ALGORITHMS, BOUND_NAMES, AccountantConfig
from .schedules import SCHEDULES
from .terms import (bound_terms, exact_rounds_limit, planned_terms, planned_theta, resolve_cyclic_c,
                    resolve_iterative_z)
from .validate import int_at_least, positive

__all__ = [
    "BOUND_KEYS",
    "CONDITIONAL_LABEL",
    "FINAL_MODEL_EXACT_ROUNDS",
    "RELATION",
    "BoundValue",
    "OnlineFinalModel",
    "add_remove_certified",
    "bound_assumptions",
    "cauchy_schwarz_mu",
    "certifiable",
    "certified_bound",
    "composition_mu",
    "final_model_mu",
    "hidden_clients",
    "local_dp_mu",
    "paper_is_sound",
    "paper_mu",
    "planned_bounds",
    "planned_curve",
    "smoothness_assumption",
    "tanh_ratio",
]

BOUND_KEYS: tuple[str, ...] = ("paper", "composition", "final_model", "local_dp")

#: planned_bounds runs the exact O(T) PAVA for stage/iterative up to this many rounds;
#: beyond it the final-model value is a sound upper bound (see planned_bounds).
FINAL_MODEL_EXACT_ROUNDS = 1 << 20
# Sums of 1/n^2 and ln^2(1+1/n) are evaluated term by term up to this n, and with
# Hurwitz-zeta differences of the series beyond it (docs/MATH.md §8.1).
_DIRECT_SUM_MAX = 1 << 20
_NEG_INF = -math.inf


# ---------------------------------------------------------------- validation helpers


def _rounds(value: object) -> int:
    return int_at_least("rounds", value, 1)


def _array(name: str, values: object, *, positive: bool) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=float)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"{name} must be a 1-D sequence of numbers: {exc}") from None
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1:
        raise ValueError(f"{name} must be 1-D, got shape {arr.shape}")
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite")
    if positive and not np.all(arr > 0):
        raise ValueError(f"{name} must all be > 0")
    if not positive and not np.all(arr >= 0):
        raise ValueError(f"{name} must all be >= 0")
    return arr


def _log_rho_array(values: object) -> np.ndarray:
    try:
        arr = np.asarray(values, dtype=float)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"log_rhos must be a 1-D sequence of numbers: {exc}") from None
    if arr.ndim == 0:
        arr = arr.reshape(1)
    if arr.ndim != 1 or not np.all(np.isfinite(arr)):
        raise ValueError("log_rhos must be a 1-D sequence of finite numbers")
    return arr


def _same_length(**arrays: np.ndarray) -> None:
    lengths = {name: a.size for name, a in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ValueError(f"sequences must have equal lengths, got {lengths}")


def log_add_exp(a: float, b: float) -> float:
    """log(e^a + e^b) for floats, exact for -inf arguments (the PAVA merge, docs/MATH.md §7.2)."""
    if a < b:
        a, b = b, a
    if b == _NEG_INF:
        return a
    return a + math.log1p(math.exp(b - a))


def _sqrt_sum_sq(ratios: np.ndarray) -> float:
    """sqrt(sum r^2) without overflow/underflow (r >= 0)."""
    if ratios.size == 0:
        return 0.0
    top = float(np.max(ratios))
    if top == 0.0 or not math.isfinite(top):
        return top
    return top * math.sqrt(float(np.sum(np.square(ratios / top))))


def _prefix_sums(x: np.ndarray, block: int = 1024) -> np.ndarray:
    """Inclusive cumulative sums with a two-level blocked scheme (error ~(block + n/block) eps)."""
    n = x.size
    if n <= block:
        return np.cumsum(x)
    nb = -(-n // block)
    padded = np.zeros(nb * block)
    padded[:n] = x
    inner = np.cumsum(padded.reshape(nb, block), axis=1)
    offsets = np.concatenate(([0.0], np.cumsum(inner[:, -1])[:-1]))
    return (inner + offsets[:, None]).ravel()[:n]


# ---------------------------------------------------------------- the paper's closed forms


def hidden_clients(clients: int, colluders: int) -> int:
    """m - c_eff, c_eff = min(c, m - 1): the clients (target included) whose noise a coalition of
    ``colluders`` participants cannot subtract (docs/MATH.md §14.2a). Uniform weights: the
    aggregate noise it sees is sigma * sqrt(m - c_eff)/m; 1 means local DP for the round."""
    return clients - min(colluders, clients - 1)


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
        alpha = float(config.prox_alpha)
        return "tanh", 2.0 * V / alpha * pref, math.log1p(L / (alpha - L))
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


def paper_is_sound(algorithm: str, schedule: str) -> bool:
    """Whether the paper's closed form is a valid bound (docs/MATH.md §7.3).

    True only for FedAvg with the stage-wise or iterative schedule (Theorem 3(c),(d)
    dominate composition); False for FedAvg constant/cyclic and for FedProx.
    """
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    return algorithm == "fedavg" and schedule in ("stage", "iterative")


# ---------------------------------------------------------------- composition, local DP


def composition_mu(gammas: Sequence[float], noise_stds: Sequence[float]) -> float:
    """Central composition mu = sqrt(sum_t (gamma_t / s_t)^2) (docs/MATH.md §8.1, §14.2).

    Sound when every broadcast model is visible (hence also for w_T alone).
    """
    g = _array("gammas", gammas, positive=False)
    s = _array("noise_stds", noise_stds, positive=True)
    _same_length(gammas=g, noise_stds=s)
    return _sqrt_sum_sq(g / s)


def local_dp_mu(client_sensitivities: Sequence[float], sigmas: Sequence[float]) -> float:
    """Local DP (curious server) mu = sqrt(sum_t (Gamma_t / sigma_t)^2) (docs/MATH.md §8.2, §14.2)."""
    g = _array("client_sensitivities", client_sensitivities, positive=False)
    s = _array("sigmas", sigmas, positive=True)
    _same_length(client_sensitivities=g, sigmas=s)
    return _sqrt_sum_sq(g / s)


# ---------------------------------------------------------------- final model (PAVA)


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

    __slots__ = ("_count", "_ln", "_ld", "_first", "_inner", "_cum")

    def __init__(self) -> None:
        self._count = 0
        self._ln: list[float] = []  # log sum_J (p_t/p_u) gamma_t
        self._ld: list[float] = []  # log sum_J (p_t/p_u)^2 s_t^2
        self._first: list[float] = []  # log rho_u of the block's first round
        self._inner: list[float] = []  # sum_{j=u+1}^{v} log rho_j
        self._cum: list[float] = []  # cumulative block values (mu^2 so far)

    def __len__(self) -> int:
        return self._count

    @property
    def mu(self) -> float:
        """mu_final after the rounds pushed so far (0.0 before the first round)."""
        return math.sqrt(self._cum[-1]) if self._cum else 0.0

    @property
    def blocks(self) -> int:
        """Number of PAVA blocks (1 = the Cauchy-Schwarz solution is feasible)."""
        return len(self._cum)

    def push(self, log_rho: float, gamma: float, noise_std: float) -> None:
        """Add one round: log rho_t (finite), gamma_t >= 0, s_t > 0 (all finite)."""
        log_rho = float(log_rho)
        g = float(gamma)
        s = float(noise_std)
        if not math.isfinite(log_rho):
            raise ValueError(f"log_rho must be finite, got {log_rho!r}")
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
        """Push validated rounds given as arrays (vectorized preparation, then the PAVA pass)."""
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


# ---------------------------------------------------------------- values and the certified rule


@dataclass(frozen=True)
class BoundValue:
    """A Gaussian-DP parameter mu, its epsilon at the report's delta, whether it is sound, and
    what it assumes beyond clipping and the noise (e.g. "L-smooth losses (L = 1)"; empty for a
    clipping-only bound). A bound with assumptions certifies only when they are asserted."""

    mu: float
    epsilon: float
    sound: bool
    assumes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"mu": self.mu, "epsilon": self.epsilon, "sound": self.sound, "assumes": list(self.assumes)}


#: the neighbouring relation every bound is stated for; the add/remove-one guarantee is reported beside it
RELATION = "replace-one"
#: the words printed next to a bound that rests on L-smooth losses
CONDITIONAL_LABEL = "conditional on L-smooth losses"


def smoothness_assumption(smoothness: float) -> str:
    """The assumption a bound that uses L states, e.g. "L-smooth losses (L = 1)"."""
    return f"L-smooth losses (L = {float(smoothness):g})"


def bound_assumptions(smoothness: float, sensitivity_uses_smoothness: bool) -> dict[str, tuple[str, ...]]:
    """What each bound assumes (docs/MATH.md §13, §15): final_model and paper always rest on
    L-smooth losses (rho_t); composition and local_dp only when their sensitivity used the
    per-sample drift bound theta < 1."""
    smooth = (smoothness_assumption(smoothness),)
    clip = smooth if sensitivity_uses_smoothness else ()
    return {"paper": smooth, "composition": clip, "final_model": smooth, "local_dp": clip}


#: threat model -> the bounds that answer its adversary (docs/MATH.md §15)
ADMISSIBLE: dict[str, tuple[str, ...]] = {
    "all-rounds": ("composition",),
    "final-model": ("final_model", "composition", "paper"),
    "curious-server": ("local_dp",),
}


def certifiable(value: BoundValue, assume_smooth_losses: bool) -> bool:
    """Whether a bound may certify: sound, and its assumptions asserted (only L-smoothness exists)."""
    return value.sound and (assume_smooth_losses or not value.assumes)


def certified_bound(threat_model: str, bounds: dict[str, BoundValue], assume_smooth_losses: bool) -> str:
    """The smallest certifiable bound the threat model admits (ties: the first in ``BOUND_NAMES``).

    Without ``assume_smooth_losses`` no bound that rests on L may certify (final_model, paper,
    a per-sample theta < 1); a clipping-only composition / local_dp is always there.
    The one rule the accountant, the planner and the budget all use.
    """
    candidates = [name for name in ADMISSIBLE[threat_model] if certifiable(bounds[name], assume_smooth_losses)]
    return min(candidates, key=lambda name: (bounds[name].mu, BOUND_NAMES.index(name)))


def add_remove_certified(threat_model: str, mus: dict[str, float], assumes: dict[str, tuple[str, ...]],
                         assume_smooth_losses: bool) -> str:
    """The certified bound under add/remove-one: the same rule over the bounds computed with the
    add/remove sensitivities (composition, final_model, local_dp; the paper's forms are replace-one only)."""
    candidates = [name for name in ADMISSIBLE[threat_model]
                  if name in mus and (assume_smooth_losses or not assumes[name])]
    return min(candidates, key=lambda name: (mus[name], BOUND_NAMES.index(name)))


# ---------------------------------------------------------------- planned (homogeneous) bounds


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

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

This module holds the shared numeric helpers, composition and local DP, and the certified-bound
rule; the other bounds live by theme in :mod:`closed_forms` (the paper's Theorem 3/4 forms),
:mod:`final_model` (the PAVA optimum) and :mod:`planned_bounds` (bounds of a planned run).

Only ``math``, ``numpy`` and ``scipy`` are used.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from .records import ALGORITHMS, BOUND_NAMES
from .schedules import SCHEDULES
from .validate import int_at_least

__all__ = [
    "BOUND_KEYS",
    "CONDITIONAL_LABEL",
    "FINAL_ITERATE_ASSUMPTION",
    "RELATION",
    "BoundValue",
    "add_remove_certified",
    "bound_assumptions",
    "certifiable",
    "certified_bound",
    "composition_mu",
    "hidden_clients",
    "local_dp_mu",
    "log_add_exp",
    "paper_is_sound",
    "rests_on_smoothness",
    "smoothness_assumption",
]

BOUND_KEYS: tuple[str, ...] = ("paper", "composition", "final_model", "local_dp")

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


# ---------------------------------------------------------------- shared: colluders


def hidden_clients(clients: int, colluders: int) -> int:
    """m - c_eff, c_eff = min(c, m - 1): the clients (target included) whose noise a coalition of
    ``colluders`` participants cannot subtract (docs/MATH.md §14.2a). Uniform weights: the
    aggregate noise it sees is sigma * sqrt(m - c_eff)/m; 1 means local DP for the round."""
    return clients - min(colluders, clients - 1)


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
#: the add/remove-one guarantee's relation, named with its convention (docs/MATH.md §16): a removed
#: sample contributes a zero clipped gradient; batch indices, B and the aggregation weights stay fixed
#: (so it does not describe weighting = "examples", where a removal changes every weight)
ADD_REMOVE_RELATION = "add/remove-one (zero substitution)"
#: the words printed next to a bound that rests on L-smooth losses
CONDITIONAL_LABEL = "conditional on L-smooth losses"


def smoothness_assumption(smoothness: float) -> str:
    """The assumption a bound that uses L states, e.g. "L-smooth losses (L = 1)"."""
    return f"L-smooth losses (L = {float(smoothness):g})"


#: what the final-model bounds (final_model, paper) assume of the released model; printed with them wherever the
#: run does not enforce it (under threat model "final-model" the package refuses a server optimizer and an averaged
#: release, so there it holds by construction)
FINAL_ITERATE_ASSUMPTION = "the released model is the last noisy-GD iterate (no server optimizer, no averaged release)"


def bound_assumptions(smoothness: float, sensitivity_uses_smoothness: bool,
                      threat_model: str) -> dict[str, tuple[str, ...]]:
    """What each bound assumes (docs/MATH.md §13, §15): final_model and paper always rest on
    L-smooth losses (rho_t) and, outside the final-model threat model (which refuses server
    post-processing), on the released model being the last noisy-GD iterate; composition and local_dp
    only when their sensitivity used the per-sample drift bound theta < 1."""
    smooth = (smoothness_assumption(smoothness),)
    clip = smooth if sensitivity_uses_smoothness else ()
    final = smooth if threat_model == "final-model" else (*smooth, FINAL_ITERATE_ASSUMPTION)
    return {"paper": final, "composition": clip, "final_model": final, "local_dp": clip}


#: threat model -> the bounds that answer its adversary (docs/MATH.md §15); "sampled" (the amplified
#: composition of Poisson client sampling, docs/MATH.md §19) exists only in runs that sample that way,
#: "sampled_secret" (the bound conditioned on the count for a secret sample, docs/MATH.md §22) only with
#: sample_secrecy "secret", "secure_aggregation" (docs/MATH.md §20) only under its threat model
ADMISSIBLE: dict[str, tuple[str, ...]] = {
    "all-rounds": ("composition", "sampled", "sampled_secret", "batch_sampled"),
    "final-model": ("final_model", "composition", "paper"),
    "curious-server": ("local_dp", "batch_sampled"),
    "secure-aggregation": ("secure_aggregation",),  # composition against the server (docs/MATH.md §20)
}
_ORDER = (*BOUND_NAMES, "sampled", "sampled_secret", "secure_aggregation", "batch_sampled")  # tie-break order of the certified rule


def rests_on_smoothness(assumes: Sequence[str]) -> bool:
    """Whether a bound's assumptions include L-smooth losses (which certify only when asserted)."""
    return any(a.startswith("L-smooth losses") for a in assumes)


def certifiable(value: BoundValue, assume_smooth_losses: bool) -> bool:
    """Whether a bound may certify: sound, and L-smoothness asserted when it rests on it (the
    sampler assumption of the ``sampled`` bound is stated, not asserted: it is the server's own)."""
    return value.sound and (assume_smooth_losses or not rests_on_smoothness(value.assumes))


def certified_bound(threat_model: str, bounds: dict[str, BoundValue], assume_smooth_losses: bool) -> str:
    """The certifiable bound with the smallest epsilon the threat model admits (ties: smaller mu,
    then the first in ``BOUND_NAMES``). For Gaussian-DP bounds epsilon grows with mu, so this is
    the smallest mu; the ``sampled`` bound's epsilon comes from its PLD.

    Without ``assume_smooth_losses`` no bound that rests on L may certify (final_model, paper,
    a per-sample theta < 1); a clipping-only composition / local_dp is always there.
    The one rule the accountant, the planner and the budget all use.
    """
    candidates = [name for name in ADMISSIBLE[threat_model]
                  if name in bounds and certifiable(bounds[name], assume_smooth_losses)]
    return min(candidates, key=lambda name: (bounds[name].epsilon, bounds[name].mu, _ORDER.index(name)))


def add_remove_certified(threat_model: str, mus: dict[str, float], assumes: dict[str, tuple[str, ...]],
                         assume_smooth_losses: bool) -> str:
    """The certified bound under add/remove-one: the same rule over the bounds computed with the
    add/remove sensitivities (composition, final_model, local_dp; the paper's forms are replace-one only)."""
    candidates = [name for name in ADMISSIBLE[threat_model]
                  if name in mus and (assume_smooth_losses or not rests_on_smoothness(assumes[name]))]
    return min(candidates, key=lambda name: (mus[name], _ORDER.index(name)))



"""The delta charged for screening drops (docs/MATH.md §17.1): the server's residual-noise and
update-magnitude checks drop an honest reply with a probability that depends on its data (its residual
energy is noncentral chi-square with noncentrality ||Delta||^2 / sigma^2), and a drop is visible.

Coupling (as for the Skellam clamp, §20.4): the run as it ran differs from the run whose checks never drop
an honest reply only on the event that some round drops the target's reply, of probability at most
P = sum_t p_t, p_t = noise-check-alpha + update-bound-alpha (each check drops an honest reply with at most
its level, whatever the data). If the ideal run is (eps, delta)-DP, the real one is
(eps, delta + (1 + e^eps) P)-DP. The per-round p_t is in each round record (``screening_drop``).

The charge applies where the adversary does not see the screened upload itself: the all-rounds and
final-model threat models. The curious server sees each upload, and a drop is a function of it
(post-processing, covered by local DP); under secure aggregation the per-upload checks do not run.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["CHARGED_THREAT_MODELS", "DEFAULT_CHECK_LEVEL", "MAX_PLANNED_CHARGE_SHARE", "NOTED_CHARGE_SHARE",
           "budget_charge_problems", "fitting_level", "planned_charge", "screening_charge"]

#: default noise-check-alpha and update-bound-alpha: the main job's charge, (1 + e^3.825) x 100 x 2e-12 =
#: 9.4e-9, is 0.09 % of its delta 1e-5 (at 1e-9 each it was 9.4e-6, almost doubling delta)
DEFAULT_CHECK_LEVEL = 1e-12

#: the threat models whose certificate a screening drop can leak past (docs/MATH.md §17.1)
CHARGED_THREAT_MODELS = ("all-rounds", "final-model")

#: the largest screening charge a budgeted run may plan, as a share of its delta: the guarantee it reaches,
#: (target epsilon, delta + charge), then stays within 10 % of the budget's delta (docs/MATH.md §17.1)
MAX_PLANNED_CHARGE_SHARE = 0.1
#: the planned charge above which the preflight warns (a run without a budget), as a share of delta
NOTED_CHARGE_SHARE = 0.01


def planned_charge(levels: float, rounds: int, epsilon: float) -> float:
    """The charge (1 + e^eps) x rounds x levels (levels: noise_check_alpha + update_bound_alpha a round) at
    ``epsilon``, uncapped (so that a warning can say by how much it swamps delta; inf past e^700)."""
    return math.inf if epsilon > 700.0 else (1.0 + math.exp(epsilon)) * rounds * levels


def fitting_level(share: float, delta: float, rounds: int, epsilon: float) -> float:
    """The largest power of ten each of the two levels may take so that the charge at ``epsilon`` over ``rounds`` is
    at most ``share`` x delta (0 past e^700: no level helps; 0 turns a check off)."""
    each = share * delta / (2.0 * planned_charge(1.0, rounds, epsilon))
    return 0.0 if each <= 0.0 or not math.isfinite(each) else 10.0 ** math.floor(math.log10(each))


def budget_charge_problems(noise_check_alpha: float, update_bound_alpha: float, rounds: int, epsilon: float,
                           delta: float, threat_model: str) -> list[str]:
    """What a budget of (``epsilon``, ``delta``) over ``rounds`` asks of the screening levels: the charge at the
    budget's epsilon, :func:`planned_charge`, at most :data:`MAX_PLANNED_CHARGE_SHARE` x delta (the run stops
    before its certified epsilon passes the budget's, so this bounds the charge it reaches; every round counts, as
    under Poisson sampling). At the default levels a budget of epsilon 20 or more over tens of rounds exceeds it:
    a certificate of (20, 1e-5 + 0.1) is no (20, 1e-5) one."""
    levels = noise_check_alpha + update_bound_alpha
    if threat_model not in CHARGED_THREAT_MODELS or levels <= 0.0:
        return []
    charge = planned_charge(levels, rounds, epsilon)
    if charge <= MAX_PLANNED_CHARGE_SHARE * delta:
        return []
    level = fitting_level(MAX_PLANNED_CHARGE_SHARE, delta, rounds, epsilon)
    fix = (f"set noise_check_alpha and update_bound_alpha <= {level:g} each (smaller levels loosen the checks, 0 turns "
           "one off: docs/MATH.md §17)" if level > 0 else "no positive level fits at this epsilon: turn both checks "
           "off (0: docs/MATH.md §17)")
    return [f"at the budget's epsilon {epsilon:g}, noise_check_alpha + update_bound_alpha = {levels:.3g} over {rounds} "
            f"rounds add (1 + e^eps) x {rounds} x {levels:.3g} = {charge:.3g} to delta for screening drops "
            f"(docs/MATH.md §17.1), more than {MAX_PLANNED_CHARGE_SHARE:g} x delta = "
            f"{MAX_PLANNED_CHARGE_SHARE * delta:.3g}: {fix} or plan a smaller epsilon"]


def screening_charge(drop_probability: float, epsilon: float, delta: float, threat_model: str,
                     add_remove_epsilon: Any = None) -> dict[str, Any]:
    """The report's ``screening`` entry: {} when nothing is charged, else the summed drop probability P,
    the charge (1 + e^eps) P, and delta_total = delta + charge (the delta the certified epsilon holds at,
    drops included); the same for the add/remove-one epsilon when given. An infinite epsilon gives an
    infinite charge (no claim), capped at 1."""
    if drop_probability <= 0.0 or threat_model not in CHARGED_THREAT_MODELS:
        return {}
    out: dict[str, Any] = {"drop_probability": drop_probability, "delta": _charge(drop_probability, epsilon)}
    out["delta_total"] = min(1.0, delta + out["delta"])
    if add_remove_epsilon is not None:
        charge = _charge(drop_probability, float(add_remove_epsilon))
        out["add_remove_delta_total"] = min(1.0, delta + charge)
    return out


def _charge(drop_probability: float, epsilon: float) -> float:
    if not math.isfinite(epsilon) or epsilon > 700.0:
        return 1.0
    return min(1.0, (1.0 + math.exp(epsilon)) * drop_probability)

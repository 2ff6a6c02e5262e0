"""Planning before a run: the guarantee of a planned configuration, and the sigma
that meets a target (epsilon, delta) after T rounds.

Planning evaluates T identical planned rounds. The certified bounds (composition, final model,
local DP) use the exact per-round terms the accountant computes for those rounds
(:func:`terms.bound_terms`), so the planner and the accountant agree on a run that goes as
planned; the paper's closed form keeps its Table 2 terms (docs/MATH.md §4, §13). Every bound here is proportional to 1/sigma, so calibration
is exact: sigma = sigma_0 * mu(sigma_0) / mu*, with mu* the largest mu meeting the
target (docs/MATH.md §9.2).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from . import gdp
from .bounds import (
    RELATION,
    BoundValue,
    add_remove_certified,
    bound_assumptions,
    certified_bound,
    paper_is_sound,
    planned_bounds,
)
from .records import BOUND_CHOICES, BOUND_NAMES, AccountantConfig, BoundChoice
from .terms import drift_bound_allowed
from .validate import int_at_least


@dataclass(frozen=True)
class Plan:
    """All four bounds after ``rounds`` planned rounds, the certified one, and the certified
    guarantee under add/remove-one (``add_remove``: bound, mu, epsilon)."""

    rounds: int
    delta: float
    bounds: dict[str, BoundValue]
    certified_bound: str
    add_remove: dict[str, Any] = dataclasses.field(default_factory=dict)

    @property
    def certified(self) -> BoundValue:
        return self.bounds[self.certified_bound]

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "delta": self.delta,
            "relation": RELATION,
            "bounds": {k: v.to_dict() for k, v in self.bounds.items()},
            "certified": {"bound": self.certified_bound, "mu": self.certified.mu,
                          "epsilon": self.certified.epsilon, "assumes": list(self.certified.assumes)},
            "add_remove": dict(self.add_remove),
        }


@dataclass(frozen=True)
class Calibration:
    sigma: float
    bound: str
    mu: float
    epsilon: float
    sound: bool
    assumes: tuple[str, ...] = ()

    def to_dict(self) -> dict:
        return {"sigma": self.sigma, "bound": self.bound, "mu": self.mu, "epsilon": self.epsilon,
                "sound": self.sound, "assumes": list(self.assumes), "relation": RELATION}


def plan(config: AccountantConfig, rounds: int) -> Plan:
    """Every bound after ``rounds`` identical planned rounds, at ``config.delta``."""
    int_at_least("rounds", rounds, 1)
    mus = planned_bounds(config, rounds)
    sound = {name: paper_is_sound(config.algorithm, config.schedule) if name == "paper" else True
             for name in BOUND_NAMES}
    uses_l = drift_bound_allowed(config.clipping, config.local_steps, config.assume_smooth_losses)
    assumes = bound_assumptions(config.smoothness, uses_l)
    bounds = {name: BoundValue(mu=mus[name], epsilon=gdp.epsilon(mus[name], config.delta), sound=sound[name],
                               assumes=assumes[name]) for name in BOUND_NAMES}
    ar_mus = planned_bounds(config, rounds, add_remove=True)
    ar_name = add_remove_certified(config.threat_model, ar_mus, assumes, config.assume_smooth_losses)
    add_remove = {"bound": ar_name, "mu": ar_mus[ar_name], "epsilon": gdp.epsilon(ar_mus[ar_name], config.delta)}
    return Plan(rounds=rounds, delta=config.delta, bounds=bounds, add_remove=add_remove,
                certified_bound=certified_bound(config.threat_model, bounds, config.assume_smooth_losses))


def calibrate(config: AccountantConfig, rounds: int, target_epsilon: float,
              bound: BoundChoice = "certified") -> Calibration:
    """The sigma at which ``bound`` equals ``target_epsilon`` at ``config.delta`` after ``rounds``.

    ``bound="paper"`` is allowed for comparison; the result then carries
    ``sound=False`` where the paper's closed form is not a valid guarantee.
    """
    int_at_least("rounds", rounds, 1)
    if not (isinstance(target_epsilon, (int, float)) and math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    if bound not in BOUND_CHOICES:
        raise ValueError(f"bound must be one of {BOUND_CHOICES}, got {bound!r}")
    reference = plan(config, rounds)
    name = reference.certified_bound if bound == "certified" else bound
    mu_ref = reference.bounds[name].mu
    mu_star = gdp.mu_for(target_epsilon, config.delta)
    sigma = config.sigma * mu_ref / mu_star
    calibrated = plan(dataclasses.replace(config, sigma=sigma), rounds)
    if bound == "certified" and calibrated.certified_bound != name:
        # With a different sigma the minimum could in principle switch bound; recalibrate on it.
        name = calibrated.certified_bound
        sigma = config.sigma * reference.bounds[name].mu / mu_star
        calibrated = plan(dataclasses.replace(config, sigma=sigma), rounds)
    value = calibrated.bounds[name]
    return Calibration(sigma=sigma, bound=name, mu=value.mu, epsilon=value.epsilon, sound=value.sound,
                       assumes=value.assumes)

"""Planning before a run: the guarantee of a planned configuration, and the sigma
that meets a target (epsilon, delta) after T rounds.

Planning uses the Table 2 terms (docs/MATH.md §4, with c_K, z_K and the per-sample factor
theta of §13) for T identical rounds, so its numbers are the companions of the
paper's closed forms. Every bound here is proportional to 1/sigma, so calibration
is exact: sigma = sigma_0 * mu(sigma_0) / mu*, with mu* the largest mu meeting the
target (docs/MATH.md §9.2).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from . import gdp
from .bounds import BoundValue, certified_bound, paper_is_sound, planned_bounds
from .records import BOUND_CHOICES, BOUND_NAMES, AccountantConfig, BoundChoice
from .validate import int_at_least


@dataclass(frozen=True)
class Plan:
    """All four bounds after ``rounds`` planned rounds, and the certified one."""

    rounds: int
    delta: float
    bounds: dict[str, BoundValue]
    certified_bound: str

    @property
    def certified(self) -> BoundValue:
        return self.bounds[self.certified_bound]

    def to_dict(self) -> dict:
        return {
            "rounds": self.rounds,
            "delta": self.delta,
            "bounds": {k: dataclasses.asdict(v) for k, v in self.bounds.items()},
            "certified": {"bound": self.certified_bound, **{
                k: v for k, v in dataclasses.asdict(self.certified).items() if k != "sound"}},
        }


@dataclass(frozen=True)
class Calibration:
    sigma: float
    bound: str
    mu: float
    epsilon: float
    sound: bool

    def to_dict(self) -> dict:
        return {"sigma": self.sigma, "bound": self.bound, "mu": self.mu, "epsilon": self.epsilon,
                "sound": self.sound}


def plan(config: AccountantConfig, rounds: int) -> Plan:
    """Every bound after ``rounds`` identical planned rounds, at ``config.delta``."""
    int_at_least("rounds", rounds, 1)
    mus = planned_bounds(config, rounds)
    sound = {name: paper_is_sound(config.algorithm, config.schedule) if name == "paper" else True
             for name in BOUND_NAMES}
    bounds = {name: BoundValue(mu=mus[name], epsilon=gdp.epsilon(mus[name], config.delta), sound=sound[name])
              for name in BOUND_NAMES}
    return Plan(rounds=rounds, delta=config.delta, bounds=bounds,
                certified_bound=certified_bound(config.threat_model, mus, sound))


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
    return Calibration(sigma=sigma, bound=name, mu=value.mu, epsilon=value.epsilon, sound=value.sound)

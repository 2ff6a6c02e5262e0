"""Planning before a run: the guarantee of a planned configuration, and the sigma
that meets a target (epsilon, delta) after T rounds.

Planning evaluates T identical planned rounds. The certified bounds (composition, final model,
local DP) use the exact per-round terms the accountant computes for those rounds
(:func:`planned_terms.bound_terms`), so the planner and the accountant agree on a run that goes as
planned; the paper's closed form keeps its Table 2 terms (docs/MATH.md §4, §13). Every bound here is proportional to 1/sigma, so calibration
is exact: sigma = sigma_0 * mu(sigma_0) / mu*, with mu* the largest mu meeting the
target (docs/MATH.md §9.2).

:func:`planned_run` replays the planned rounds through the run's own accountant
(:class:`~.accountant.PrivacyAccountant`, fed ``AccountantConfig.planned_round``) with the
budget rule the strategy applies when every sampled client replies, so its per-round curve is
the run's by construction. :func:`calibrate_sigma` picks sigma for ``target-epsilon``
(``sigma = "auto"`` in the run config; the Opacus user's ``make_private_with_epsilon``).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import Any, Callable

from . import gdp
from .accountant import Budget, PrivacyAccountant, PrivacyReport
from .bounds import (
    RELATION,
    BoundValue,
    add_remove_certified,
    bound_assumptions,
    certified_bound,
    paper_is_sound,
)
from .planned_bounds import planned_bounds
from .records import BOUND_CHOICES, BOUND_NAMES, AccountantConfig, BoundChoice
from .client_sampling import CONDITIONED_BOUND, SecretSampleAccount, conditioned_epsilon
from .sampled import SAMPLED_BOUND, SampledAccount, composed_pairs_epsilon, round_mu
from .sample_sampling import BATCH_SAMPLED_BOUND, batch_sampled_sigma
from .secure_aggregation import amend_secure_aggregation
from .terms import drift_bound_allowed, round_terms
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

    def to_dict(self) -> dict[str, Any]:
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

    def to_dict(self) -> dict[str, Any]:
        return {"sigma": self.sigma, "bound": self.bound, "mu": self.mu, "epsilon": self.epsilon,
                "sound": self.sound, "assumes": list(self.assumes), "relation": RELATION}


def _replays(config: AccountantConfig) -> bool:
    """Whether the plan is the accountant's replay of the planned rounds (not a closed form)."""
    return (config.sampling_rate is not None or config.sum_grid_step is not None or config.sample_secrecy == "secret"
            or config.batch_rate is not None)


def _report_plan(report: PrivacyReport, rounds: int, delta: float) -> Plan:
    return Plan(rounds=rounds, delta=delta, bounds=dict(report.bounds), certified_bound=report.certified_bound,
                add_remove=dict(report.add_remove))


def _replayed_plan(config: AccountantConfig, rounds: int) -> Plan:
    """The plan of a Poisson-sampled run: the accountant's own report after the planned rounds (the
    expected count floor(q N) each), the amplified ``sampled`` bound included (docs/MATH.md §19.5)."""
    accountant = PrivacyAccountant(config)
    accountant.extend(config.planned_round(t) for t in range(1, rounds + 1))
    return _report_plan(accountant.report(), rounds, config.delta)


@functools.lru_cache(maxsize=32)  # calibrate and calibrate_sigma search the same plan (the CLI asks both)
def _sampled_sigma(config: AccountantConfig, rounds: int, target_epsilon: float) -> float:
    """The smallest sigma (to 1e-6 relative, rounded up) at which the ``sampled`` bound of ``rounds``
    planned rounds is <= ``target_epsilon``: mu_t is proportional to 1/sigma, epsilon decreases in sigma."""
    unit = dataclasses.replace(config, sigma=1.0)
    account = SampledAccount(float(config.sampling_rate or 1.0), unit.colluders)  # the accountant's own rate p_t
    pairs = []
    for t in range(1, rounds + 1):
        record = unit.planned_round(t)
        terms = round_terms(record, unit.smoothness, unit.colluders, unit.assume_smooth_losses)
        pairs.append((account.rate(record), round_mu(terms.client_sensitivity, 1.0, record.clients, unit.colluders)))
    mus = [m for _, m in pairs]

    def fits(sigma: float) -> bool:
        return composed_pairs_epsilon([(p, m / sigma) for p, m in pairs], config.delta) <= target_epsilon

    return _search_sigma(fits, math.sqrt(math.fsum(m * m for m in mus)) / gdp.mu_for(target_epsilon, config.delta))


@functools.lru_cache(maxsize=32)
def _secret_sigma(config: AccountantConfig, rounds: int, target_epsilon: float) -> float:
    """The smallest sigma (1e-6 relative, rounded up) at which the ``sampled_secret`` bound of the planned rounds
    (p = clients / population each) is <= ``target_epsilon``: every mu_t is proportional to 1/sigma."""
    unit = dataclasses.replace(config, sigma=1.0)
    account = SecretSampleAccount(unit.colluders)
    pairs = [account.round(r, round_terms(r, unit.smoothness, unit.colluders, unit.assume_smooth_losses))
             for r in (unit.planned_round(t) for t in range(1, rounds + 1))]

    def fits(sigma: float) -> bool:
        return conditioned_epsilon([(p, m / sigma) for p, m in pairs], config.delta) <= target_epsilon

    return _search_sigma(fits, math.sqrt(math.fsum(m * m for _, m in pairs)) / gdp.mu_for(target_epsilon, config.delta))


def _search_sigma(fits: Any, hi: float) -> float:
    """Bisection (geometric, 1e-6 relative) for the smallest sigma that ``fits``, from a first guess ``hi``."""
    for _ in range(64):
        if fits(hi):
            break
        hi *= 2.0
    lo = hi / 2.0
    for _ in range(64):
        if not fits(lo):
            break
        lo /= 2.0
    while hi - lo > 1e-6 * hi:
        mid = math.sqrt(lo * hi)
        lo, hi = (lo, mid) if fits(mid) else (mid, hi)
    return hi


def plan(config: AccountantConfig, rounds: int) -> Plan:
    """Every bound after ``rounds`` identical planned rounds, at ``config.delta``."""
    int_at_least("rounds", rounds, 1)
    if _replays(config):
        return _replayed_plan(config, rounds)
    mus = planned_bounds(config, rounds)
    sound = {name: paper_is_sound(config.algorithm, config.schedule) if name == "paper" else True
             for name in BOUND_NAMES}
    uses_l = drift_bound_allowed(config.clipping, config.local_steps, config.assume_smooth_losses)
    assumes = bound_assumptions(config.smoothness, uses_l, config.threat_model)
    bounds = {name: BoundValue(mu=mus[name], epsilon=gdp.epsilon(mus[name], config.delta), sound=sound[name],
                               assumes=assumes[name]) for name in BOUND_NAMES}
    ar_mus = planned_bounds(config, rounds, add_remove=True)
    amend_secure_aggregation(config.threat_model, config.colluders, bounds, assumes, ar_mus)
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
    if config.sum_grid_step is not None:
        raise ValueError("calibrate does not take an integer secure sum (sum_grid_step): its grid is planned from sigma "
                         "(training.secure_sum.plan_grid), so calibrate the plan without it, plan the grid for that "
                         "sigma and check the result with plan()")
    if name in (SAMPLED_BOUND, CONDITIONED_BOUND, BATCH_SAMPLED_BOUND):  # epsilon not a function of one mu: search sigma
        search: dict[str, Callable[[AccountantConfig, int, float], float]] = {
            SAMPLED_BOUND: _sampled_sigma, CONDITIONED_BOUND: _secret_sigma, BATCH_SAMPLED_BOUND: batch_sampled_sigma}
        sigma = search[name](config, rounds, target_epsilon)
        value = plan(dataclasses.replace(config, sigma=sigma), rounds).bounds[name]
        return Calibration(sigma=sigma, bound=name, mu=value.mu, epsilon=value.epsilon, sound=value.sound,
                           assumes=value.assumes)
    mu_ref = reference.bounds[name].mu
    mu_star = gdp.mu_for(target_epsilon, config.delta)
    sigma = config.sigma * mu_ref / mu_star
    calibrated = plan(dataclasses.replace(config, sigma=sigma), rounds)
    if bound == "certified" and calibrated.certified_bound != name:
        # With a different sigma the minimum could in principle switch bound; recalibrate on it.
        name = calibrated.certified_bound
        sigma = config.sigma * reference.bounds[name].mu / mu_star
        calibrated = plan(dataclasses.replace(config, sigma=sigma), rounds)
    for _ in range(64):  # sigma * mu_ref / mu* can land a rounding error above the target: step sigma up
        if calibrated.bounds[name].epsilon <= target_epsilon:
            break
        sigma = math.nextafter(sigma * (1.0 + 1e-15), math.inf)
        calibrated = plan(dataclasses.replace(config, sigma=sigma), rounds)
    value = calibrated.bounds[name]
    return Calibration(sigma=sigma, bound=name, mu=value.mu, epsilon=value.epsilon, sound=value.sound,
                       assumes=value.assumes)


@dataclass(frozen=True)
class PlannedRun:
    """The planned rounds as the run's accountant accounts them, one report per round.

    ``reports[t - 1]`` is the report after round t (certified epsilon at the config's delta);
    only the rounds that train are listed: with a budget, the run stops before the first round
    that would push the certified epsilon past ``target_epsilon`` (``stopped_by_budget``).
    """

    rounds_planned: int
    target_epsilon: float | None
    reports: tuple[PrivacyReport, ...]

    @property
    def rounds_trained(self) -> int:
        return len(self.reports)

    @property
    def stopped_by_budget(self) -> bool:
        return self.rounds_trained < self.rounds_planned

    def certified_epsilons(self) -> list[float]:
        """Certified epsilon after each round that trains (dimensionless, at the config's delta)."""
        return [r.certified.epsilon for r in self.reports]


def planned_run(config: AccountantConfig, rounds: int, target_epsilon: float | None = None) -> PlannedRun:
    """Replay ``rounds`` planned rounds (all ``clients`` replying, uniform weights) through the
    accountant, stopping as the strategy's budget rule does (docs/MATH.md §15). O(rounds)."""
    int_at_least("rounds", rounds, 1)
    budget = Budget(target_epsilon, config.delta) if target_epsilon else None
    accountant = PrivacyAccountant(config)
    reports = []
    for t in range(1, rounds + 1):
        record = config.planned_round(t)
        if budget is None:
            reports.append(accountant.step(record))
            continue
        after = accountant.peek(record)  # what would_exceed checks, and bit for bit what step returns
        if budget.exceeded_by(after):
            break
        accountant.extend([record])
        reports.append(after)
    return PlannedRun(rounds_planned=rounds, target_epsilon=target_epsilon, reports=tuple(reports))


def plan_and_run(config: AccountantConfig, rounds: int, target_epsilon: float | None = None) -> tuple[Plan, PlannedRun]:
    """:func:`plan` and :func:`planned_run` of the same rounds with one replay: where the plan is the accountant's
    replay and every planned round trains, it is the run's last report (the same accountant on the same records)."""
    run = planned_run(config, rounds, target_epsilon)
    if _replays(config) and not run.stopped_by_budget:
        return _report_plan(run.reports[-1], rounds, config.delta), run
    return plan(config, rounds), run


#: Significant digits of a calibrated sigma (rounded up: the planned epsilon stays <= the target).
SIGMA_DIGITS = 4


def _round_up(x: float, digits: int = SIGMA_DIGITS) -> float:
    """The smallest number of ``digits`` significant digits that is >= x (x > 0, finite)."""
    scale = 10.0 ** (digits - 1 - math.floor(math.log10(x)))
    up = math.ceil(x * scale * (1 - 1e-15)) / scale
    return up if up >= x else math.nextafter(up, math.inf)


@dataclass(frozen=True)
class SigmaCalibration:
    """The sigma chosen for a target epsilon and the planned run at that sigma.

    ``sigma``: per-client noise standard deviation (same units as the model's values),
    rounded up to :data:`SIGMA_DIGITS` significant digits; ``run``: the planned run at that
    sigma (every one of ``rounds`` rounds trains; its last report is the planned guarantee).
    """

    sigma: float
    target_epsilon: float
    run: PlannedRun

    @property
    def report(self) -> PrivacyReport:
        """The accountant's report after the last planned round."""
        return self.run.reports[-1]

    def to_dict(self) -> dict[str, Any]:
        return {"sigma": self.sigma, "target_epsilon": self.target_epsilon, "rounds": self.run.rounds_planned,
                "report": self.report.to_dict()}


@functools.lru_cache(maxsize=32)
def calibrate_sigma(config: AccountantConfig, rounds: int, target_epsilon: float) -> SigmaCalibration:
    """The sigma at which all ``rounds`` planned rounds fit ``target_epsilon`` at ``config.delta``
    under the certified bound of ``config.threat_model`` (``config.sigma`` is ignored).

    Every bound is proportional to 1/sigma, so sigma = max_t mu_t(sigma = 1) / mu* is exact, with
    mu_t the certified mu after round t of the accountant's replay of the planned rounds
    (:func:`planned_run`; the budget is checked after every round) and mu* the largest mu meeting
    the target (docs/MATH.md §9.2); it is then rounded up to :data:`SIGMA_DIGITS` digits and
    checked with the run's budget rule.
    Raises ValueError naming the limit when no sigma can meet the target. Cached: every
    validation of the same run config (server, each client message) computes it once.
    """
    int_at_least("rounds", rounds, 1)
    if not (isinstance(target_epsilon, (int, float)) and math.isfinite(target_epsilon) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be a finite number > 0, got {target_epsilon!r}")
    mu_star = gdp.mu_for(target_epsilon, config.delta)
    # The budget is checked after every round, and the final-model bound can shrink as rounds are
    # added: sigma must fit the largest certified mu over the rounds, not only the last one's.
    if config.sampling_rate is not None or config.sample_secrecy == "secret":  # the last round is the largest
        sigma = plan(dataclasses.replace(config, sigma=1.0), rounds).certified.mu / mu_star
        if config.threat_model == "all-rounds" and config.sampling_rate is not None:  # the smaller epsilon wins
            sigma = min(sigma, _sampled_sigma(config, rounds, target_epsilon))
        if config.sample_secrecy == "secret":
            sigma = min(sigma, _secret_sigma(config, rounds, target_epsilon))
        if config.batch_rate is not None:  # and Poisson batches: batch_sampled may be the smallest (§23.4)
            sigma = min(sigma, batch_sampled_sigma(config, rounds, target_epsilon))
    elif config.batch_rate is not None:  # certified = the smaller of the unamplified bound and batch_sampled (§23)
        sigma = min(plan(dataclasses.replace(config, sigma=1.0), rounds).bounds[
            "composition" if config.threat_model == "all-rounds" else "local_dp"].mu / mu_star,
            batch_sampled_sigma(config, rounds, target_epsilon))
    else:
        unit = planned_run(dataclasses.replace(config, sigma=1.0), rounds)
        sigma = max(r.certified.mu for r in unit.reports) / mu_star
    for _ in range(3):  # normally once: rounding up keeps the replay within the target
        if not (math.isfinite(sigma) and sigma > 0):
            break
        sigma = _round_up(sigma)
        run = planned_run(dataclasses.replace(config, sigma=sigma), rounds, target_epsilon)
        if not run.stopped_by_budget:
            return SigmaCalibration(sigma=sigma, target_epsilon=float(target_epsilon), run=run)
        sigma = math.nextafter(sigma * (1 + 10.0 ** -SIGMA_DIGITS), math.inf)
    raise ValueError(
        f"target_epsilon {target_epsilon!r} at delta {config.delta!r} cannot be met in {rounds} rounds by any "
        f"finite sigma (calibration gave {sigma!r}); lower the rounds or raise the target")

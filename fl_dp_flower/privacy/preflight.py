"""What a planned run will do, said before round 1: the library's preflight (the strategy logs it when it
starts; the reference app's ``fl_dp_flower.app.preflight`` words the same numbers for its run-config keys).

- a budget that stops the run early: after which round, and the sigma that would train every round
  (:func:`budget_plan`); a budget that no round fits;
- a noise level that drowns the learning signal (:func:`noise_to_signal`, a heuristic).

Numbers only (the accountant's own replay, :func:`~fl_dp_flower.privacy.planning.planned_run`); no torch.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from .records import AccountantConfig
from .schedules import step_sizes
from .validate import int_at_least, positive

__all__ = ["MIN_SIGNAL_TO_NOISE", "NO_ROUND_FITS", "BudgetPlan", "budget_plan", "noise_to_signal", "preflight_notes"]

#: the words of the note of a budget that fits no round (the library's strategy refuses such a run before round 1)
NO_ROUND_FITS = "fits no round"

#: Below this signal-to-noise ratio (:func:`noise_to_signal`) the preflight warns that learning is unlikely.
MIN_SIGNAL_TO_NOISE = 0.25


@dataclass(frozen=True)
class BudgetPlan:
    """How a budget meets the planned rounds (all clients replying, as planned)."""

    rounds_planned: int
    rounds_trained: int  # rounds that fit the budget (0: none)
    epsilon_trained: float  # the certified epsilon after them (the first round's when none fits)
    sigma_needed: float  # the sigma at which every planned round fits

    @property
    def stops_early(self) -> bool:
        return self.rounds_trained < self.rounds_planned


def budget_plan(config: AccountantConfig, rounds: int, target_epsilon: float) -> BudgetPlan | None:
    """The budget's effect on ``rounds`` planned rounds; None when every round fits."""
    from .planning import calibrate_sigma, planned_run

    run = planned_run(config, rounds, target_epsilon)
    if not run.stopped_by_budget:
        return None
    need = calibrate_sigma(dataclasses.replace(config, sigma=1.0), rounds, target_epsilon).sigma
    eps = (run.reports[-1] if run.reports else planned_run(config, 1).reports[0]).certified.epsilon
    return BudgetPlan(rounds, run.rounds_trained, eps, need)


def noise_to_signal(config: AccountantConfig, rounds: int, dimension: int) -> tuple[float, float]:
    """(largest total update norm, expected total noise norm) of the global model over ``rounds`` rounds
    of ``dimension`` values.

    Each round moves the global model by at most sum_k eta_{k,t} * V (K clipped steps; FedProx's
    proximal term only shrinks it), and adds aggregate noise of norm about sigma * sqrt(d / m) (d values,
    m clients averaged uniformly). Over T rounds the updates add up to at most the sum of the per-round
    bounds, the independent noise to about sqrt(T) * sigma * sqrt(d / m). A heuristic: it cannot know the
    data, only that when the noise is several times the largest possible signal the model cannot learn much.
    """
    int_at_least("rounds", rounds, 1)
    int_at_least("dimension", dimension, 1)
    signal = sum(math.fsum(step_sizes(config.schedule, config.lr, t, config.local_steps)) * config.clip_norm
                 for t in range(rounds))
    noise = math.sqrt(rounds) * config.sigma * math.sqrt(dimension / config.clients)
    return signal, noise


def preflight_notes(config: AccountantConfig, rounds: int, *, target_epsilon: float | None = None,
                    dimension: int | None = None) -> list[str]:
    """Lines to say before round 1 of a run of ``rounds`` rounds planned as ``config``: an early budget
    stop (or a budget no round fits) with the sigma that would fit, and the noise-drowns-signal warning
    (``dimension``: the model's number of values). Warnings start with ``"warning:"``."""
    int_at_least("rounds", rounds, 1)
    notes: list[str] = []
    if target_epsilon is not None:
        positive("target_epsilon", target_epsilon)
        budget = budget_plan(config, rounds, target_epsilon)
        if budget is not None and budget.rounds_trained == 0:
            notes.append(f"warning: budget epsilon {target_epsilon:g} {NO_ROUND_FITS}: the first planned round alone "
                         f"certifies epsilon {budget.epsilon_trained:.4g} at sigma {config.sigma:g} (delta "
                         f"{config.delta:g}), so nothing will be trained; sigma >= {budget.sigma_needed:g} trains all "
                         f"{rounds} rounds")
        elif budget is not None:
            notes.append(f"warning: budget epsilon {target_epsilon:g} stops the run after round {budget.rounds_trained} "
                         f"of {rounds} (planned certified epsilon {budget.epsilon_trained:.4g}); sigma >= "
                         f"{budget.sigma_needed:g} trains all {rounds} rounds")
    if dimension is not None:
        signal, noise = noise_to_signal(config, rounds, dimension)
        if signal < MIN_SIGNAL_TO_NOISE * noise:
            notes.append(f"warning: the planned noise drowns the learning signal: over {rounds} rounds the updates "
                         f"add up to at most {signal:.4g} (norm) against noise of norm about {noise:.4g} (sigma "
                         f"{config.sigma:g}, {config.clients} clients per round, {dimension} values); expect accuracy "
                         "near chance (a heuristic: more clients per round, more rounds or a larger lr x clip-norm "
                         "help; a smaller sigma costs privacy)")
    return notes

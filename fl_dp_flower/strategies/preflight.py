"""The strategy's checks and notes before round 1 in library use (the reference app has its own,
``fl_dp_flower.app.preflight``, from its run config): the budget's delta, the planned run's preflight notes
(early budget stop and the sigma that would fit, noise that drowns the signal; privacy/preflight.py),
and the failure of a run that accounted nothing."""

from __future__ import annotations

import logging

from flwr.app import ArrayRecord

from fl_dp_flower.privacy.accountant import Budget, PrivacyAccountant
from fl_dp_flower.privacy.preflight import NO_ROUND_FITS, preflight_notes
from fl_dp_flower.privacy.records import AccountantConfig
from fl_dp_flower.privacy.screening_charge import budget_charge_problems
from fl_dp_flower.reply_checks import ReplyChecks

from .pending import BudgetFitsNoRound, NothingAccounted

__all__ = ["check_budget", "check_budget_delta", "check_final_model_outputs", "log_preflight", "nothing_accounted"]


def check_budget_delta(budget: Budget | None, config: AccountantConfig) -> None:
    """A budget at another delta than the accountant's is refused (the certified epsilon is at the accountant's)."""
    if budget is not None and budget.delta != config.delta:
        raise ValueError(f"budget delta {budget.delta!r} != the accountant's delta {config.delta!r}: the certified "
                         "epsilon is reported at the accountant's delta; plan the accountant with the budget's delta "
                         "(accountant_config(..., delta=...)) or give Budget that delta")


def check_budget(budget: Budget | None, config: AccountantConfig, rounds: int, reply_checks: object) -> None:
    """A budget the run cannot honour is refused before round 1: another delta than the accountant's
    (:func:`check_budget_delta`), or screening levels whose charge to delta at the budget's epsilon over ``rounds``
    rounds passes a tenth of delta (privacy.screening_charge.budget_charge_problems; docs/MATH.md §17.1)."""
    check_budget_delta(budget, config)
    checks = ReplyChecks() if reply_checks is None else reply_checks
    if budget is None or not isinstance(checks, ReplyChecks):  # a wrong type is refused by the strategy
        return
    problems = budget_charge_problems(checks.noise_check_alpha, checks.update_bound_alpha, rounds, budget.epsilon,
                                      config.delta, config.threat_model)
    if problems:
        raise ValueError("; ".join(problems) + " (ReplyChecks(noise_check_alpha=..., update_bound_alpha=...))")


def check_final_model_outputs(threat_model: str, fraction_evaluate: float, evaluate_fn: object) -> None:
    """Under the final-model threat model nothing derived from an intermediate global model may be published
    (docs/MATH.md §15): its bound covers the released model only, and a per-round evaluation (``evaluate_fn``: its
    metrics go into every round line, the Result and the sinks) or a federated evaluation (``fraction_evaluate`` > 0:
    every round's model broadcast for evaluation, its clients' metrics aggregated) publishes a function of each
    iterate, which only the all-rounds composition describes. The reference app evaluates such a run once, at the
    end (app/threat.py); library use is refused the same way (review R2: before, accepted without a word)."""
    if threat_model != "final-model":
        return
    if fraction_evaluate > 0:
        raise ValueError(f"fraction_evaluate = {fraction_evaluate!r} must be 0 under threat_model 'final-model': a "
                         "federated evaluation of every round's model publishes what its bound assumes hidden (use "
                         "'all-rounds', or evaluate the released model once after the run)")
    if evaluate_fn is not None:
        raise ValueError("evaluate_fn must be None under threat_model 'final-model': a per-round evaluation publishes "
                         "a function of every intermediate model (in each round line and the Result), which its bound "
                         "assumes hidden (use 'all-rounds', or evaluate the released model once after the run)")


def log_preflight(accountant: PrivacyAccountant, budget: Budget | None, initial_arrays: ArrayRecord, rounds: int,
                  log: logging.Logger) -> list[str]:
    """Log (and return) the preflight notes of a fresh run of ``rounds`` planned rounds, before round 1."""
    if rounds < 1 or accountant.num_releases > 0:  # a resumed run was planned (and told) when it began
        return []
    dimension = sum(int(a.numpy().size) for a in initial_arrays.values())
    notes = preflight_notes(accountant.config, rounds, target_epsilon=budget.epsilon if budget else None,
                            dimension=dimension)
    for note in notes:
        if NO_ROUND_FITS in note:  # the run would start, train nothing and stop: refused instead
            raise BudgetFitsNoRound(note.removeprefix("warning: "))
        log.warning("preflight: %s", note)
    return notes


def nothing_accounted(num_rounds: int) -> None:
    """Raise :class:`NothingAccounted` when ``num_rounds`` > 0 rounds ran and none was accounted."""
    if num_rounds > 0:
        raise NothingAccounted(f"{num_rounds} round(s) ran but none was accounted: no usable reply arrived (every "
                               "node refused, failed or timed out; the log names each node's reason, e.g. a data_fn "
                               "error). Nothing was trained.")

"""The strategy's checks and notes before round 1 in library use (the reference app has its own,
``fl_dp_flower.app.preflight``, from its run config): the budget's delta, the planned run's preflight notes
(early budget stop and the sigma that would fit, noise that drowns the signal; privacy/preflight.py),
and the failure of a run that accounted nothing."""

from __future__ import annotations

import logging

from flwr.app import ArrayRecord

from fl_dp_flower.privacy.accountant import Budget, PrivacyAccountant
from fl_dp_flower.privacy.preflight import preflight_notes
from fl_dp_flower.privacy.records import AccountantConfig

from .pending import NothingAccounted

__all__ = ["check_budget_delta", "log_preflight", "nothing_accounted"]


def check_budget_delta(budget: Budget | None, config: AccountantConfig) -> None:
    """A budget at another delta than the accountant's is refused (the certified epsilon is at the accountant's)."""
    if budget is not None and budget.delta != config.delta:
        raise ValueError(f"budget delta {budget.delta!r} != the accountant's delta {config.delta!r}: the certified "
                         "epsilon is reported at the accountant's delta; plan the accountant with the budget's delta "
                         "(accountant_config(..., delta=...)) or give Budget that delta")


def log_preflight(accountant: PrivacyAccountant, budget: Budget | None, initial_arrays: ArrayRecord, rounds: int,
                  log: logging.Logger) -> list[str]:
    """Log (and return) the preflight notes of a fresh run of ``rounds`` planned rounds, before round 1."""
    if rounds < 1 or accountant.num_releases > 0:  # a resumed run was planned (and told) when it began
        return []
    dimension = sum(int(a.numpy().size) for a in initial_arrays.values())
    notes = preflight_notes(accountant.config, rounds, target_epsilon=budget.epsilon if budget else None,
                            dimension=dimension)
    for note in notes:
        log.warning("preflight: %s", note)
    return notes


def nothing_accounted(num_rounds: int) -> None:
    """Raise :class:`NothingAccounted` when ``num_rounds`` > 0 rounds ran and none was accounted."""
    if num_rounds > 0:
        raise NothingAccounted(f"{num_rounds} round(s) ran but none was accounted: no usable reply arrived (every "
                               "node refused, failed or timed out; the log names each node's reason, e.g. a data_fn "
                               "error). Nothing was trained.")

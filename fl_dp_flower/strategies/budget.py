"""Privacy-budget stop rule: a dry run of the next round before it is broadcast.

Before round t+1 is configured the strategy asks the accountant whether accounting that
round could push the certified epsilon past ``target-epsilon``. The dry-run record is the
planned round under the worst aggregation the strategy can still perform:

- ``weighting = "uniform"``: ``min-replies`` clients with weights 1/m (a round aggregates
  at least ``min-replies`` replies; fewer clients = larger max weight and less noise
  averaging, so the smallest m is the worst case);
- ``weighting = "examples"``: one client with weight 1 (sample counts can make one client
  dominate; max_i p_i / sqrt(sum_i p_i^2) <= 1 with equality for a single client).

An under-quorum round (fewer than ``min-replies`` usable replies, none aggregated) is still
accounted with the clients that replied (their uploads were seen). Such a round can be
accounted with fewer clients than the dry run assumed, so the certified epsilon may then
end above the target; the next dry run stops the run.
"""

from __future__ import annotations

from flwr.serverapp.exception import PrivacyBudgetExhausted

from fl_dp_flower.privacy.accountant import Budget, PrivacyAccountant
from fl_dp_flower.privacy.records import RoundRecord


class BudgetExhausted(PrivacyBudgetExhausted):
    """Raised by ``configure_train`` before a round that could exceed the budget."""

    def __init__(self, reason: str, *, round_index: int, budget: Budget):
        super().__init__(reason)
        self.reason = reason
        self.round_index = round_index
        self.budget = budget


def dry_run_clients(weighting: str, min_replies: int) -> int:
    """Number of (uniformly weighted) clients of the worst-case dry-run record."""
    return min_replies if weighting == "uniform" else 1


def dry_run_record(accountant: PrivacyAccountant, weighting: str, min_replies: int) -> RoundRecord:
    """The next round (``accountant.num_releases + 1``) as planned, with worst-case weights."""
    return accountant.config.planned_round(
        accountant.num_releases + 1, clients=dry_run_clients(weighting, min_replies)
    )


def check_budget(accountant: PrivacyAccountant, budget: Budget, weighting: str, min_replies: int) -> None:
    """Raise :class:`BudgetExhausted` if the next round could exceed ``budget``."""
    record = dry_run_record(accountant, weighting, min_replies)
    if accountant.would_exceed(record, budget):
        spent = accountant.get_privacy_spent(budget.delta)
        reason = (
            f"privacy budget: round {record.round} could exceed target epsilon {budget.epsilon:g} "
            f"at delta {budget.delta:g} (certified epsilon after {accountant.num_releases} rounds: "
            f"{spent.epsilon:.6g}, bound {spent.bound}); stopping before this round is broadcast"
        )
        raise BudgetExhausted(reason, round_index=record.round - 1, budget=budget)

"""Privacy-budget stop rule: when is a round's release checked against ``target-epsilon``?

A budget is sound when no release the adversary of the configured threat model can see pushes
the certified epsilon past the target. *When* a release happens depends on that adversary:

- ``all-rounds`` and ``final-model``: the adversary sees global models, never an individual
  upload. Nothing of a round is released until its aggregate is broadcast (or saved as the final
  model). So the exact decision is taken **after the replies have arrived and before
  aggregation**, with the round record of the replies that really arrived
  (:func:`check_replies`). A round that would exceed the target is discarded: not aggregated,
  not accounted, never broadcast, and the run stops with the last global model that fits.
  Before the broadcast only a cheap pre-check runs (:func:`check_before_broadcast`): if even the
  most private aggregation the strategy can perform (all ``clients-per-round`` clients, uniform
  weights: the smallest max-weight and the smallest sum of squared weights) would exceed the
  target, no set of replies can fit, and the clients are not asked to train at all.
- ``curious-server``: the adversary is the server itself and sees every upload the moment it
  arrives, so a round is spent as soon as it is broadcast. The check therefore runs before the
  broadcast. The certified bound (``local_dp``) depends only on one client's sensitivity and
  sigma, not on how many clients reply or how they are weighted, so the planned round gives the
  exact value (clients that echo less private settings are still accounted as they ran, which
  can end a curious-server run above the target: a client that ignores its instructions cannot
  be stopped by the server).

- ``secure-aggregation``: the server sees the secure sum when it is unmasked (docs/MATH.md §20),
  inside the round's ``send_and_receive`` and before the replies reach the strategy: discarding it
  afterwards would release a round unaccounted. The check therefore runs before the broadcast with
  the costliest sum the protocol can unmask, ``worst_clients`` contributors (the strategy passes
  ``min-replies``; the SecAgg+ bridge never unmasks fewer, strategies/secagg.py) with uniform
  weights, and :func:`check_replies` never discards a secure round.

An under-quorum round (fewer than ``min-replies`` usable replies: no aggregate) is still
accounted with the clients that replied, as not applied: it is charged to composition and local
DP (where a round can only add), and left out of the final-model bound (its noise never reached
the released model, and adding a noisy round can lower that bound, docs/MATH.md §14.3a);
:func:`check_replies` applies to it too.
"""

from __future__ import annotations

from flwr.serverapp.exception import PrivacyBudgetExhausted

from fl_dp_flower.errors import FlDpError
from fl_dp_flower.privacy.accountant import Budget, PrivacyAccountant
from fl_dp_flower.privacy.records import RoundRecord
from fl_dp_flower.privacy.screening_charge import MAX_PLANNED_CHARGE_SHARE

#: Threat models whose adversary sees each upload on arrival (budget checked before broadcast).
UPLOAD_OBSERVING = ("curious-server",)
#: Threat models whose adversary sees the secure sum when it is unmasked, before aggregation (checked
#: before broadcast at the fewest contributors the protocol unmasks).
SUM_OBSERVING = ("secure-aggregation",)


class BudgetExhausted(FlDpError, PrivacyBudgetExhausted):
    """Raised before a round is broadcast, or after its replies arrived and before aggregation,
    when accounting it could exceed the budget. ``discarded_replies`` is the number of replies
    thrown away unused (0 when the round was never broadcast)."""

    def __init__(self, reason: str, *, round_index: int, budget: Budget, discarded_replies: int = 0):
        super().__init__(reason)
        self.reason = reason
        self.round_index = round_index
        self.budget = budget
        self.discarded_replies = discarded_replies


def pre_broadcast_record(accountant: PrivacyAccountant, worst_clients: int | None = None) -> RoundRecord:
    """The next round as planned, with all ``clients`` uniformly weighted.

    For ``curious-server`` this is exact (local DP does not depend on the aggregation); for
    ``all-rounds`` and ``final-model`` it is the most private aggregation possible (a lower bound on
    the round's cost), so exceeding with it means no set of replies can fit. For
    ``secure-aggregation`` it is the costliest sum that can be unmasked: ``worst_clients``
    contributors (1 when not given: local DP), an upper bound on the round's cost.
    """
    config = accountant.config
    clients = None
    if config.threat_model in SUM_OBSERVING:
        clients = min(config.clients, max(1, worst_clients or 1))
    return config.planned_round(accountant.num_releases + 1, clients)


def _spent_text(accountant: PrivacyAccountant, budget: Budget, record: RoundRecord | None = None) -> str:
    spent = accountant.get_privacy_spent(budget.delta)
    text = f"certified epsilon after {accountant.num_releases} rounds: {spent.epsilon:.6g}, bound {spent.bound}"
    after = accountant.peek(record, budget.delta) if record is not None else None
    if after is not None and after.certified.epsilon <= budget.epsilon:  # the delta is what the round passes
        text += (f"; after it epsilon {after.certified.epsilon:.6g} would hold only at delta {after.delta_total:.3g} "
                 f"with the screening drops' charge, past {1.0 + MAX_PLANNED_CHARGE_SHARE:g} x the budget's delta "
                 "(docs/MATH.md §17.1: lower noise-check-alpha / update-bound-alpha)")
    return text


def check_before_broadcast(accountant: PrivacyAccountant, budget: Budget, worst_clients: int | None = None) -> None:
    """Raise :class:`BudgetExhausted` if the next round cannot fit whatever replies arrive (for
    ``secure-aggregation``: if the sum of ``worst_clients`` contributors would not fit)."""
    record = pre_broadcast_record(accountant, worst_clients)
    if accountant.would_exceed(record, budget):
        threat = accountant.config.threat_model
        how = (f" if only {record.clients} contributor(s) enter the secure sum" if threat in SUM_OBSERVING
               else "" if threat in UPLOAD_OBSERVING else f" even with all {record.clients} clients replying")
        reason = (
            f"privacy budget: round {record.round} would exceed target epsilon {budget.epsilon:g} "
            f"at delta {budget.delta:g}{how} ({_spent_text(accountant, budget, record)}); "
            "stopping before this round is broadcast"
        )
        raise BudgetExhausted(reason, round_index=record.round - 1, budget=budget)


def check_replies(accountant: PrivacyAccountant, budget: Budget, record: RoundRecord) -> None:
    """Raise :class:`BudgetExhausted` if accounting ``record`` (the replies that arrived) would
    exceed the budget; the caller then discards the round unaggregated and unaccounted.

    Not used for upload- or sum-observing threat models (their rounds are spent on arrival).
    """
    if accountant.config.threat_model in UPLOAD_OBSERVING + SUM_OBSERVING:
        return
    if accountant.would_exceed(record, budget):
        reason = (
            f"privacy budget: round {record.round} with the {record.clients} replies that arrived would "
            f"exceed target epsilon {budget.epsilon:g} at delta {budget.delta:g} "
            f"({_spent_text(accountant, budget, record)}); its replies were discarded (not aggregated, not "
            "accounted, nothing released) and the run stops with the last global model"
        )
        raise BudgetExhausted(reason, round_index=record.round - 1, budget=budget,
                              discarded_replies=record.clients)

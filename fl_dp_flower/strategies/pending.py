"""The round in flight, and the error that ends a run whose aggregate is not finite."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from flwr.app import ArrayRecord, Message

from fl_dp_flower.errors import FlDpError
from fl_dp_flower.privacy.accountant import PrivacyReport
from fl_dp_flower.privacy.records import RoundRecord

from .echo import Applied


@dataclass
class PendingRound:
    """The round in flight: what was sent, then what was accounted (rounds never overlap)."""

    server_round: int
    planned: Applied  # the settings sent (schedule index t = planned.round_index)
    sent: list[Message]  # instructions; the Grid sets their message ids when pushing
    reference: ArrayRecord  # the broadcast global model
    slots: dict[int, tuple[int, ...]] | None = None  # cohort mode: node -> sampled member slots
    record: RoundRecord | None = None  # set once accounted
    report: PrivacyReport | None = None
    metrics: dict[str, Any] | None = None


class ModelNotFinite(FlDpError, RuntimeError):
    """The aggregated global model has non-finite values: the run cannot continue."""


class BudgetFitsNoRound(FlDpError, ValueError):
    """A library run's budget is exceeded by its first planned round: refused before round 1 (the run would start,
    train nothing and stop), with the sigma that trains every planned round."""


class NothingAccounted(FlDpError, RuntimeError):
    """A library run asked for rounds and accounted none, with no budget stop: every round was void
    (no usable reply: refusals, errors, timeouts). Raised by ``start`` after the ``end`` event, so a
    run that trained nothing never looks like a success."""

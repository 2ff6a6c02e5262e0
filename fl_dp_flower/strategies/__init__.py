"""Flower strategies: Noisy-FedAvg and Noisy-FedProx with the server-side accountant."""

from .budget import BudgetExhausted, check_before_broadcast, check_replies, pre_broadcast_record
from fl_dp_flower.reporting.rounds import RoundOutcome, dp_metrics

from .noisy import ModelNotFinite, NoisyFedAvg, NoisyFedProx, NoisyStrategyMixin, PendingRound
from .pending import NothingAccounted
from .sampling import NodeRefusals, NotEnoughNodes
from .screening import ReplyChecks

__all__ = [
    "BudgetExhausted",
    "ModelNotFinite",
    "NodeRefusals",
    "NoisyFedAvg",
    "NoisyFedProx",
    "NoisyStrategyMixin",
    "NotEnoughNodes",
    "NothingAccounted",
    "PendingRound",
    "ReplyChecks",
    "RoundOutcome",
    "check_before_broadcast",
    "check_replies",
    "dp_metrics",
    "pre_broadcast_record",
]

"""Flower strategies: Noisy-FedAvg and Noisy-FedProx with the server-side accountant."""

from .budget import BudgetExhausted, check_before_broadcast, check_replies, pre_broadcast_record
from .noisy import NodeRefusals, NoisyFedAvg, NoisyFedProx, NoisyStrategyMixin, NotEnoughNodes, dp_metrics, make_strategy

__all__ = [
    "BudgetExhausted",
    "NodeRefusals",
    "NoisyFedAvg",
    "NoisyFedProx",
    "NoisyStrategyMixin",
    "NotEnoughNodes",
    "check_before_broadcast",
    "check_replies",
    "dp_metrics",
    "make_strategy",
    "pre_broadcast_record",
]

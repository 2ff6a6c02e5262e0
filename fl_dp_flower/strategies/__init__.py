"""Flower strategies: Noisy-FedAvg and Noisy-FedProx with the server-side accountant."""

from .budget import BudgetExhausted, check_budget, dry_run_record
from .noisy import NoisyFedAvg, NoisyFedProx, NoisyStrategyMixin, dp_metrics, make_strategy

__all__ = [
    "BudgetExhausted",
    "NoisyFedAvg",
    "NoisyFedProx",
    "NoisyStrategyMixin",
    "check_budget",
    "dp_metrics",
    "dry_run_record",
    "make_strategy",
]

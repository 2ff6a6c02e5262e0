"""The reference app's strategy, built from its run config with the library's public objects."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from fl_dp_flower.app.config import AppConfig
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.reporting.rounds import PrivacySink
from fl_dp_flower.strategies import NoisyFedAvg, NoisyFedProx, NoisyStrategyMixin, ReplyChecks


def reply_checks(config: AppConfig) -> ReplyChecks:
    """The run config's reply-check keys (echo-tolerance, noise-check-alpha, update-bound-alpha,
    examples-cap-ratio) as the library's :class:`ReplyChecks`."""
    return ReplyChecks(echo_tolerance=config.echo_tolerance, noise_check_alpha=config.noise_check_alpha,
                       update_bound_alpha=config.update_bound_alpha, examples_cap_ratio=config.examples_cap_ratio)


def nodes_needed(config: AppConfig) -> int:
    """Connected nodes a round waits for: enough to offer ``clients-per-round`` clients."""
    return config.federation_settings().nodes_needed


def make_strategy(config: AppConfig, accountant: PrivacyAccountant, *, sinks: Sequence[PrivacySink] = (),
                  **kwargs: Any) -> NoisyStrategyMixin:
    """NoisyFedAvg or NoisyFedProx according to ``algorithm``, with the settings, federation, budget and
    reply checks of the run config."""
    cls = NoisyFedProx if config.algorithm == "fedprox" else NoisyFedAvg
    strategy = cls(config.dp_settings(), accountant, federation=config.federation_settings(), budget=config.budget(),
                   sinks=sinks, reply_checks=reply_checks(config), **kwargs)
    strategy.app_managed = True  # the app logs its own preflight (app/preflight.py) and fails an empty run itself
    return strategy

"""Checks of a Noisy strategy's constructor arguments (:class:`~.noisy.NoisyFedAvg`, ``NoisyFedProx``): the
types of its own arguments, and the Flower keywords it sets itself, each refused naming the setting that
owns it (a keyword passed twice would otherwise end in Python's "multiple values for keyword argument")."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fl_dp_flower.privacy.accountant import Budget, PrivacyAccountant
from fl_dp_flower.reporting.rounds import PrivacySink
from fl_dp_flower.settings import DPSettings, FederationSettings

from .screening import ReplyChecks

_NODES = ("the strategy sets it from FederationSettings (nodes_needed: enough nodes to offer clients_per_round "
          "clients): set FederationSettings(clients_per_round=..., clients_per_node=...) instead")

#: FedAvg / FedProx keywords the Noisy strategies set themselves -> where the setting lives instead
OWN_KEYWORDS: dict[str, str] = {
    "fraction_train": "the strategy samples the clients itself, as the accountant planned: set "
                      "FederationSettings(clients_per_round=k) for k clients a round (fixed-size sampling), or "
                      "FederationSettings(client_sampling='poisson', sampling_rate=q, clients_per_round=...) for "
                      "Poisson sampling, and plan the accountant with the same (settings.accountant_config(...))",
    "min_train_nodes": _NODES,
    "min_available_nodes": _NODES,
    "min_evaluate_nodes": "the strategy sets it from fraction_evaluate and FederationSettings (nodes_needed)",
    "train_metrics_aggr_fn": "the strategy aggregates the train replies itself (screened, weighted as the accountant "
                             "planned: FederationSettings(weighting=...)) and averages their metrics with them; Flower's "
                             "function would never be called",
    "proximal_mu": "NoisyFedProx sends proximal-mu = DPSettings.prox_alpha (the accounted FedProx term): set "
                   "DPSettings(algorithm='fedprox', prox_alpha=...) instead",
}


def check_flower_keywords(owner: str, kwargs: Mapping[str, Any]) -> None:
    """Refuse a keyword of Flower's FedAvg/FedProx that ``owner`` sets itself, naming where it is set."""
    for key in kwargs:
        if key in OWN_KEYWORDS:
            raise TypeError(f"{owner}(..., {key}=...) is not accepted: {OWN_KEYWORDS[key]}")


def check_arguments(settings: DPSettings, accountant: PrivacyAccountant, federation: FederationSettings,
                    budget: Budget | None, sinks: Sequence[PrivacySink], reply_checks: ReplyChecks | None) -> None:
    """TypeError naming the argument unless each is of its type."""
    if not isinstance(settings, DPSettings):
        raise TypeError(f"settings must be a DPSettings, got {type(settings).__name__}")
    if not isinstance(federation, FederationSettings):
        raise TypeError(f"federation must be a FederationSettings, got {type(federation).__name__}")
    if not isinstance(accountant, PrivacyAccountant):
        raise TypeError(f"accountant must be a fl_dp_flower PrivacyAccountant, got {type(accountant).__name__}")
    if budget is not None and not isinstance(budget, Budget):
        raise TypeError(f"budget must be a Budget or None, got {type(budget).__name__}")
    for sink in sinks:
        if not isinstance(sink, PrivacySink):
            raise TypeError(f"sink {sink!r} lacks on_event(kind, data) / on_round(outcome) (PrivacySink)")
    if reply_checks is not None and not isinstance(reply_checks, ReplyChecks):
        raise TypeError(f"reply_checks must be a ReplyChecks or None, got {type(reply_checks).__name__}")

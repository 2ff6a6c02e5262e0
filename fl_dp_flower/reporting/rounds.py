"""What a finished round hands to its reporters, and the reporters themselves (no torch, no flwr).

The strategy closes a round into one :class:`RoundOutcome` (the accounted record, the privacy
report, the merged metrics and the new global model) and passes it to each reporter in order.
:class:`RoundSink` is the ServerApp's reporter: ledger line (fsync) -> checkpoint -> log line ->
Prometheus. It receives everything it reports; the model is saved through a callable the
ServerApp provides, so this module needs neither torch nor flwr.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .console import format_round_line
from .ledger import PrivacyLedger
from .prometheus import PrivacyMetricsExporter

#: metric keys of the ``dp-*`` family kept in the ledger (the bounds are in the report already)
LEDGER_DP_KEYS = ("dp-aggregated", "dp-dropped", "dp-echo-mismatch", "dp-unfinished-accounted",
                  "dp-epsilon-increase", "dp-expected-epsilon-increase")


@dataclass(frozen=True)
class RoundOutcome:
    """One accounted round, as its reporters see it."""

    round: int  # 1-based global round number (the record's)
    record: Any  # privacy.records.RoundRecord
    report: Any  # privacy.accountant.PrivacyReport
    metrics: dict[str, Any]  # aggregated client metrics, dp-* numbers, central evaluation
    arrays: Any  # the global model after the round (flwr ArrayRecord)


def dp_metrics(report: Any) -> dict[str, float | int]:
    """Flat ``dp-*`` metrics of a ``PrivacyReport`` (MetricRecord-compatible: ints and floats only)."""
    b = report.bounds
    return {
        "dp-round": report.round,
        "dp-rounds": report.rounds,
        "dp-clients": report.clients,
        "dp-certified-mu": report.certified.mu,
        "dp-certified-epsilon": report.certified.epsilon,
        "dp-paper-mu": b["paper"].mu,
        "dp-paper-epsilon": b["paper"].epsilon,
        "dp-paper-sound": int(b["paper"].sound),
        "dp-composition-mu": b["composition"].mu,
        "dp-composition-epsilon": b["composition"].epsilon,
        "dp-final-model-mu": b["final_model"].mu,
        "dp-final-model-epsilon": b["final_model"].epsilon,
        "dp-local-mu": b["local_dp"].mu,
        "dp-local-epsilon": b["local_dp"].epsilon,
        "dp-delta": report.delta,
    }


class RoundSink:
    """The ServerApp's reporter: ledger line, checkpoint, log line, Prometheus (in this order)."""

    def __init__(self, ledger: PrivacyLedger, save_checkpoint: Callable[[int, Any], None],
                 log: logging.Logger, exporter: PrivacyMetricsExporter | None = None,
                 budget_epsilon: float | None = None) -> None:
        self.ledger, self.save_checkpoint, self.log = ledger, save_checkpoint, log
        self.exporter, self.budget_epsilon = exporter, budget_epsilon

    def __call__(self, outcome: RoundOutcome) -> None:
        report_d = outcome.report.to_dict()
        kept = {k: v for k, v in outcome.metrics.items() if not k.startswith("dp-") or k in LEDGER_DP_KEYS}
        self.ledger.append_round(round=outcome.round, record=outcome.record.to_dict(), report=report_d, metrics=kept)
        self.save_checkpoint(outcome.round, outcome.arrays)
        accuracy = outcome.metrics.get("accuracy")
        self.log.info(format_round_line(report_d, accuracy=accuracy, clients=outcome.record.clients))
        if self.exporter is not None:
            self.exporter.update(report_d, clients=outcome.record.clients, accuracy=accuracy,
                                 budget_epsilon=self.budget_epsilon,
                                 epsilon_increase=outcome.metrics.get("dp-epsilon-increase"),
                                 expected_increase=outcome.metrics.get("dp-expected-epsilon-increase"))
            self.exporter.set_ledger_head(self.ledger.head_line_hash)

"""Sinks: what the strategy tells the outside world, through one protocol (no torch, no flwr).

The strategy hands every sink, in order, two kinds of news (:class:`PrivacySink`):

- ``on_event(kind, data)``: ledger events (``round-open`` before a broadcast, write-ahead;
  ``round-void``, ``node-excluded``, ...);
- ``on_round(outcome)``: one closed, accounted round as a :class:`RoundOutcome` (the accounted
  record, the privacy report, the merged metrics and the new global model).

Sinks shipped here: :class:`LedgerSink` (the fsynced privacy ledger), :class:`ConsoleSink` (the
round log line), :class:`PrometheusSink` (the metrics endpoint), :class:`CheckpointSink` (saves the
model through a callable). The ServerApp's :class:`RoundSink` runs them in the order the ledger's
guarantees need: ledger line (fsync) -> checkpoint -> log line -> Prometheus. A user's own sink is
any object with these two methods.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.records import AccountantConfig

from .console import format_round_line
from .ledger import PrivacyLedger
from .ledger.writer import refuse_existing
from .ledger.events import FILE_MODE, MEMBERS_EVENT, NODE_ID_EVENTS, RESUME_EVENT
from .prometheus import PrivacyMetricsExporter
from .resume import UnfinishedRound, resume_ledger

#: metric keys of the ``dp-*`` family kept in the ledger (the bounds are in the report already)
LEDGER_DP_KEYS = ("dp-aggregated", "dp-dropped", "dp-capped", "dp-echo-mismatch", "dp-unfinished-accounted",
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
        "dp-delta": report.delta_total,  # delta plus the screening drops' charge (docs/MATH.md §17.1)
    }


def without_dp_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics`` without the ``dp-*`` family: what Flower's own console dumps show (its per-round
    "Aggregated MetricRecord" and final summary); the ledger, the sinks, Prometheus and the strategy's
    ``Result`` keep every number."""
    return {key: value for key, value in metrics.items() if not key.startswith("dp-")}


@runtime_checkable
class PrivacySink(Protocol):
    """Receives the strategy's ledger events and closed rounds (both in strategy order)."""

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        """A ledger event (``round-open`` is write-ahead: it must be durable when this returns)."""

    def on_round(self, outcome: RoundOutcome) -> None:
        """One accounted round, after central evaluation."""


class LedgerSink:
    """Events and round lines into a :class:`PrivacyLedger` (each line fsynced). :func:`open_ledger`
    makes one with its accountant; ``close()`` (or ``with``) when the run ends.

    A new run's sink (:meth:`deferred`) creates its ledger with the run's first line (the ``round-open``
    written ahead of round 1's broadcast, or a ``budget-stop``), header and line in one creation: a run refused
    before that (a strategy refusing its arguments, a budget refused by ``start()``) leaves no file, and the
    corrected run just starts; a file never holds its header alone. Another run that created the same path in
    between is refused at that first line, before anything is broadcast (a ledger is never overwritten)."""

    def __init__(self, ledger: PrivacyLedger) -> None:
        self._ledger: PrivacyLedger | None = ledger
        self._pending: tuple[Path, dict[str, Any], dict[str, Any]] | None = None

    @classmethod
    def deferred(cls, path: str | os.PathLike[str], config: AccountantConfig,
                 run_config: dict[str, Any] | None = None) -> "LedgerSink":
        """The sink of a new ledger at ``path`` (created by the first line, see the class docstring); refuses an
        existing one now (FileExistsError, :func:`~fl_dp_flower.reporting.ledger.writer.refuse_existing`)."""
        path = Path(path)
        refuse_existing(path)
        sink = cls.__new__(cls)
        sink._ledger, sink._pending = None, (path, config.to_dict(), dict(run_config or {}))
        return sink

    @property
    def ledger(self) -> PrivacyLedger:
        """The open ledger (RuntimeError while a new run's ledger is not created yet: no line written)."""
        if self._ledger is None:
            assert self._pending is not None
            raise RuntimeError(f"privacy ledger {self._pending[0]} is not created yet: a new run's ledger is created "
                               "with its first line (round 1's round-open, before its broadcast)")
        return self._ledger

    @property
    def last_round(self) -> int | None:
        """Round of the last round line (None before any)."""
        return self._ledger.last_round if self._ledger is not None else None

    @property
    def head_line_hash(self) -> str | None:
        """The chain's head (None while nothing is written)."""
        return self._ledger.head_line_hash if self._ledger is not None else None

    def close(self) -> None:
        if self._ledger is not None:
            self._ledger.close()

    def __enter__(self) -> "LedgerSink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _create(self, first: dict[str, Any]) -> None:
        assert self._pending is not None
        path, accountant_config, app_config = self._pending
        try:
            self._ledger = PrivacyLedger.create(path, accountant_config=accountant_config, app_config=app_config,
                                                first=first)
        except FileExistsError as err:
            raise FileExistsError(f"{err} It was created after open_ledger checked the path (another run writes the "
                                  "same ledger): this run stops before its first broadcast.") from None
        self._pending = None

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        if kind == MEMBERS_EVENT:  # a secret sample's ids never enter the ledger (MembersSink)
            return
        if self._ledger is None:
            self._create(PrivacyLedger.event_entry(kind, data))
        else:
            self._ledger.append_event(kind, data)

    def on_round(self, outcome: RoundOutcome) -> None:
        kept = {k: v for k, v in outcome.metrics.items() if not k.startswith("dp-") or k in LEDGER_DP_KEYS}
        line = dict(round=outcome.round, record=outcome.record.to_dict(), report=outcome.report.to_dict(), metrics=kept)
        if self._ledger is None:
            self._create(PrivacyLedger.round_entry(**line))
        else:
            self._ledger.append_round(**line)


def open_ledger(path: str | os.PathLike[str], config: AccountantConfig, *, resume: bool = False,
                run_config: dict[str, Any] | None = None, unfinished_round: UnfinishedRound = "refuse",
                checkpoint: Any = None) -> tuple[LedgerSink, PrivacyAccountant]:
    """A ledger sink and its accountant.

    New run (``resume=False``): refuses an existing file now (a ledger is never overwritten); the ledger,
    with ``config`` and ``run_config`` (your settings, for the record) in its header, is created with the
    run's first line (:meth:`LedgerSink.deferred`), so a strategy that refuses its arguments, or a ``start()``
    that refuses before round 1, leaves no file behind and the corrected run needs no clean-up.

    Resume (``resume=True``): checks the header's accountant config against ``config``, rebuilds the
    accountant from the round records, writes a ``resume`` event (what ``fl-dp-flower verify`` expects
    after a finished run) and appends from there (:mod:`fl_dp_flower.reporting.resume`). The model is
    not part of the ledger: pass your ``checkpoint`` (a :class:`~fl_dp_flower.ModelCheckpoint`) and
    start from ``checkpoint.restore(strategy)``. Accounted rounds that the checkpoint does not hold
    (none: every round) stay charged and are marked not applied (out of the final-model bound).
    ``unfinished_round``: a round that was broadcast but never recorded (a killed run) may have been
    spent: ``"refuse"`` (default) raises naming it, nothing written; ``"account"`` charges it as the
    planned round, not applied, at what its ``round-open`` event recorded (under secure aggregation the
    smallest sum that could have been unmasked then, whatever the resumed run's ``min_replies``).
    """
    if checkpoint is not None and not resume and checkpoint.saved_round() > 0:
        raise FileExistsError(f"checkpoint {checkpoint.path} already exists but resume=False: it belongs to an "
                              "earlier run; resume that run (resume=True) or choose another checkpoint path")
    if not resume:
        sink, accountant = LedgerSink.deferred(path, config, run_config), PrivacyAccountant(config)
    else:
        saved = checkpoint.saved_round() if checkpoint is not None else 0
        resumed, accountant, _ = resume_ledger(path, config, checkpoint_round=saved, unfinished=unfinished_round)
        sink = LedgerSink(resumed)
    if checkpoint is not None:
        checkpoint.ledger = sink  # the checkpoint checks that a round's line precedes its save
    return sink, accountant


#: the line a members file gets after a torn fragment (a crash mid-write) before the next line is appended
TORN_MARK = "torn-tail"


class MembersSink:
    """A secret sample's member ids (``round-members`` events: the drawn clients at round-open, the contributors
    at the round's close, and the events that name a node, :func:`member_events`), one fsynced JSON line each, in an owner-only file (mode 0600) beside the ledger.
    Only the server's owner may read it: whoever reads it learns the sample, and the ``sampled_secret``
    bound no longer holds against them. ``fl-dp-flower verify`` does not need it (the ledger's counts
    suffice); it is there to answer who took part (an audit by the owner, a data-subject request)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        if kind != MEMBERS_EVENT:
            return
        self._append(data)

    def mark_resume(self, rounds_accounted: int) -> None:
        """Start a new segment of the file (a resumed ServerApp): ``member_events`` returns the mark as a ``resume``
        event, so partition claims are contested within one segment only, as the ledger's (app/recovery.py)."""
        self._append({"event": RESUME_EVENT, "data": {"rounds_accounted": rounds_accounted}})

    def _append(self, data: dict[str, Any]) -> None:
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, FILE_MODE)
        try:
            os.fchmod(fd, FILE_MODE)
            size = os.fstat(fd).st_size
            torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"  # a crash mid-line: end it, keep the fragment,
            mark = "\n" + json.dumps({"event": TORN_MARK}) + "\n" if torn else ""  # and say so (member_events)
            os.write(fd, (mark + json.dumps(data, sort_keys=True) + "\n").encode())
            os.fsync(fd)
        finally:
            os.close(fd)

    def on_round(self, outcome: RoundOutcome) -> None:
        return None


def member_events(path: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """The node-naming events of a secret-sample run (``node-excluded``, ``node-capped``, ``partition-claimed``)
    from its members file, shaped as ledger events (``{"event": kind, "data": data}``), in file order, with the
    ``resume`` marks between a run's segments (``MembersSink.mark_resume``): what a resume restores (exclusions,
    partition ids contested within a segment). A torn last line (a
    crash mid-write) is skipped, as the ledger reader skips its torn tail; an empty list without the file."""
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    events = []
    for i, line in enumerate(lines):
        try:
            entry = json.loads(line)
        except json.JSONDecodeError:
            if i == len(lines) - 1:
                break
            if lines[i + 1] == json.dumps({"event": TORN_MARK}):  # a fragment the next append ended (MembersSink)
                continue
            raise ValueError(f"{os.fspath(path)}: line {i + 1} is not JSON") from None
        if isinstance(entry, dict) and entry.get("event") in (*NODE_ID_EVENTS, RESUME_EVENT):
            events.append(entry)
    return events


class CheckpointSink:
    """Calls ``save(round, arrays)`` after each round (the ServerApp saves ``model-latest.pt``)."""

    def __init__(self, save: Callable[[int, Any], None]) -> None:
        self.save = save

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        return None

    def on_round(self, outcome: RoundOutcome) -> None:
        self.save(outcome.round, outcome.arrays)


class ConsoleSink:
    """The one-line round summary (certified epsilon, bounds, accuracy) on a logger."""

    def __init__(self, log: logging.Logger | None = None) -> None:
        self.log = log or logging.getLogger("flwr").getChild("fl_dp_flower")

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        return None

    def on_round(self, outcome: RoundOutcome) -> None:
        self.log.info(format_round_line(outcome.report.to_dict(), accuracy=outcome.metrics.get("accuracy"),
                                        clients=outcome.record.clients))


class PrometheusSink:
    """Round reports into a :class:`PrivacyMetricsExporter` (``budget_epsilon``: the target, if any;
    ``ledger``: its head hash is exported after each round)."""

    def __init__(self, exporter: PrivacyMetricsExporter, budget_epsilon: float | None = None,
                 ledger: PrivacyLedger | LedgerSink | None = None) -> None:
        self.exporter, self.budget_epsilon, self.ledger = exporter, budget_epsilon, ledger

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        return None

    def on_round(self, outcome: RoundOutcome) -> None:
        self.exporter.update(outcome.report.to_dict(), clients=outcome.record.clients,
                             accuracy=outcome.metrics.get("accuracy"), budget_epsilon=self.budget_epsilon,
                             epsilon_increase=outcome.metrics.get("dp-epsilon-increase"),
                             expected_increase=outcome.metrics.get("dp-expected-epsilon-increase"))
        if self.ledger is not None:
            self.exporter.set_ledger_head(self.ledger.head_line_hash)


class RoundSink:
    """The ServerApp's sink: ledger (events, round line) -> checkpoint -> log line -> Prometheus."""

    def __init__(self, ledger: PrivacyLedger, save_checkpoint: Callable[[int, Any], None],
                 log: logging.Logger, exporter: PrivacyMetricsExporter | None = None,
                 budget_epsilon: float | None = None, members: str | os.PathLike[str] | None = None) -> None:
        self.ledger = ledger
        self.sinks: list[PrivacySink] = [LedgerSink(ledger), CheckpointSink(save_checkpoint), ConsoleSink(log)]
        if members is not None:  # a secret sample's ids: the owner-only members file
            self.sinks.insert(1, MembersSink(members))
        if exporter is not None:
            self.sinks.append(PrometheusSink(exporter, budget_epsilon, ledger))

    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        for sink in self.sinks:
            sink.on_event(kind, data)

    def on_round(self, outcome: RoundOutcome) -> None:
        self(outcome)

    def __call__(self, outcome: RoundOutcome) -> None:
        for sink in self.sinks:
            sink.on_round(outcome)

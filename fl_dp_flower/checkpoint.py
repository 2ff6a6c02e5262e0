"""Saving and restoring the model (and the server optimizer's state) beside the privacy ledger, so a
library run can be resumed exactly: :class:`ModelCheckpoint`, a sink.

Use (the README's own-app section)::

    checkpoint = ModelCheckpoint("outputs/model-latest.pt")
    ledger, accountant = open_ledger("outputs/ledger.jsonl", plan, resume=resume, checkpoint=checkpoint)
    strategy = NoisyFedAvg(settings, accountant, sinks=[ledger, checkpoint, ConsoleSink()], ...)
    arrays = checkpoint.restore(strategy) or ArrayRecord(Net().state_dict())

The file is ``{"round": t, "state_dict": ..., "server_update": ...}`` (the reference ServerApp's
``model-latest.pt``), written whole or not at all, owner-only, after the round's ledger line is
durable (a round's model is never saved before its privacy is recorded: checked when the sink is
attached to a ledger by :func:`~fl_dp_flower.reporting.rounds.open_ledger`). The round it holds tells
the resume which accounted rounds reached the model; the others stay charged and leave the
final-model bound (docs/MATH.md §14.3a).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
from flwr.app import ArrayRecord

from fl_dp_flower.reporting.durable import atomic_write
from fl_dp_flower.reporting.rounds import LedgerSink, RoundOutcome

__all__ = ["ModelCheckpoint"]


class ModelCheckpoint:
    """A :class:`~fl_dp_flower.PrivacySink` that saves the global model after every accounted round
    (list it after the ledger in ``sinks``) and gives it back on resume (:meth:`restore`)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.ledger: LedgerSink | None = None  # set by open_ledger: the round line must precede the save
        self._strategy: Any = None

    # ---------------------------------------------------------------- reading
    def _load(self) -> dict[str, Any] | None:
        if not self.path.exists():
            return None
        saved = torch.load(self.path, map_location="cpu", weights_only=True)
        if not isinstance(saved, dict) or not isinstance(saved.get("round"), int) or "state_dict" not in saved:
            raise ValueError(f"checkpoint {self.path} is not a fl-dp-flower model checkpoint "
                             "({'round': int, 'state_dict': ..., 'server_update': ...})")
        return saved

    def saved_round(self) -> int:
        """The round whose model the file holds (0: no file, the run starts from the initial model)."""
        saved = self._load()
        return 0 if saved is None else int(saved["round"])

    def saved_model(self) -> ArrayRecord | None:
        """The saved model (None: no file yet). Reads only."""
        saved = self._load()
        return None if saved is None else ArrayRecord(saved["state_dict"])

    def attach(self, strategy: Any) -> None:
        """Save ``strategy``'s server-optimizer state with the model from now on (no restore)."""
        self._strategy = strategy

    def restore(self, strategy: Any) -> ArrayRecord | None:
        """Attach to ``strategy`` (its server optimizer's state is saved with the model from now on),
        restore that state from the file, and return the saved model (None: no file yet, start from
        your initial model)."""
        self.attach(strategy)
        saved = self._load()
        if saved is None:
            return None
        strategy.server_update.restore(saved.get("server_update") or {})
        return ArrayRecord(saved["state_dict"])

    # ---------------------------------------------------------------- PrivacySink
    def on_event(self, kind: str, data: dict[str, Any]) -> None:
        return None

    def on_round(self, outcome: RoundOutcome) -> None:
        if self.ledger is not None and self.ledger.last_round != outcome.round:
            raise RuntimeError(f"ModelCheckpoint: round {outcome.round}'s ledger line is not written yet; list the "
                               "ledger sink before the checkpoint in sinks (a model is saved only after its round "
                               "is recorded)")
        self.save(outcome.round, outcome.arrays)

    def save(self, round_: int, arrays: ArrayRecord) -> None:
        """Write ``arrays`` (and the attached strategy's server-optimizer state) as round ``round_``."""
        update = self._strategy.server_update.state() if self._strategy is not None else {}
        state = {"round": int(round_), "state_dict": arrays.to_torch_state_dict(), "server_update": update}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(self.path, lambda f: torch.save(state, f))

"""A ledger's round records as the accountant replays them: ``rounds-not-applied`` events honoured
(docs/MATH.md §14.3a). The one replay rule of resume, ``verify`` and ``load_round_records``."""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from fl_dp_flower.privacy.records import RoundRecord

from .ledger import NOT_APPLIED_EVENT, LedgerContents, read_ledger


def not_applied_rounds(events: list[dict[str, Any]]) -> set[int]:
    """Rounds that ``rounds-not-applied`` events mark as never applied to the model."""
    marked: set[int] = set()
    for entry in events:
        if entry.get("event") == NOT_APPLIED_EVENT:
            rounds = (entry.get("data") or {}).get("rounds")
            if not isinstance(rounds, list) or not all(isinstance(r, int) and not isinstance(r, bool)
                                                        for r in rounds):
                raise ValueError(f"a {NOT_APPLIED_EVENT} event must list integer rounds, got {rounds!r}")
            marked.update(rounds)
    return marked


def round_records(contents: LedgerContents) -> list[RoundRecord]:
    """The RoundRecords of a parsed ledger, in order, ``rounds-not-applied`` events honoured."""
    marked = not_applied_rounds(contents.events)
    return [replace(r, applied=False) if r.round in marked else r
            for r in (RoundRecord.from_dict(entry["record"]) for entry in contents.rounds)]


def load_round_records(path: str | os.PathLike[str]) -> list[RoundRecord]:
    """The RoundRecords of a ledger, in order (see :func:`round_records`)."""
    return round_records(read_ledger(path))

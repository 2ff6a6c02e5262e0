"""Resuming a run from its privacy ledger: the one rule, for the library (:func:`open_ledger`) and the
reference ServerApp alike (no torch, no flwr).

What a resume writes, after every check has passed (a refused resume writes nothing):

1. a ``resume`` event (``verify`` accepts nothing else after a finished run's ``end``);
2. ``rounds-not-applied`` for the accounted rounds whose model was not saved (the checkpoint is older
   than the ledger, or there is none): they stay charged to composition and local DP and leave the
   final-model bound (docs/MATH.md §14.3a);
3. with ``unfinished_round = "account"``, the open round (broadcast, no round line: its uploads may
   have reached the server) as the planned round, not applied, and an ``unfinished-round-accounted``
   event. With ``"refuse"`` (the default) such a ledger is refused, naming the round and the way on.
"""

from __future__ import annotations

import logging
import os
from dataclasses import replace
from pathlib import Path
from typing import Any, Literal

from fl_dp_flower.errors import FlDpError
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.records import AccountantConfig
from fl_dp_flower.privacy.sample_sampling import unrecorded_round_rate
from fl_dp_flower.privacy.screening_charge import DEFAULT_CHECK_LEVEL

from .ledger import NOT_APPLIED_EVENT, RESUME_EVENT, UNFINISHED_ROUND_EVENT, LedgerContents, PrivacyLedger
from .ledger.writer import open_locked
from .replay import round_records

log = logging.getLogger("flwr").getChild(__name__)  # Flower's handlers when Flower is configured

UnfinishedRound = Literal["refuse", "account"]
UNFINISHED_ROUND_CHOICES = ("refuse", "account")


class ResumeRefused(FlDpError, ValueError):
    """A ledger that cannot be resumed as asked; nothing was written."""


def unfinished_round(path: str | os.PathLike[str], contents: LedgerContents, checkpoint_round: int,
                     policy: UnfinishedRound, option: str = "unfinished_round") -> int | None:
    """The open round to account (``policy = "account"``), None if there is none; raises
    :class:`ResumeRefused` naming the real cause (``"refuse"``, or a checkpoint that does not belong
    to the ledger). ``option``: how the caller spells the policy (named in the message). Reads only."""
    if policy not in UNFINISHED_ROUND_CHOICES:
        raise ValueError(f"{option} must be one of {UNFINISHED_ROUND_CHOICES}, got {policy!r}")
    last, open_round = contents.last_round, contents.open_round
    if open_round is None:
        if checkpoint_round > last:
            raise ResumeRefused(f"cannot resume {path}: checkpoint round {checkpoint_round} is ahead of the ledger's "
                                f"last round {last}, and no round is open in the ledger; the ledger is not the "
                                "one this model was trained under")
        if checkpoint_round < last:
            log.warning("checkpoint is from round %d, ledger has round %d: continuing from the older model "
                        "(the later rounds stay accounted, as not applied)", checkpoint_round, last)
        return None
    how = (f"its round line is torn (line {contents.line_count} was cut mid-write)"
           if contents.torn_tail and contents.torn_round == open_round
           else f"has no round line (opened at line {contents.open_round_line}; the server stopped before "
                "recording it)")
    where = f"; the saved model is from round {checkpoint_round}" if checkpoint_round else ""
    if policy == "refuse":
        raise ResumeRefused(
            f"cannot resume {path}: round {open_round} was broadcast but {how}{where}. Its uploads may have "
            "reached the server, so its privacy may be spent. Nothing was written. To continue, resume "
            f"with {option} = 'account' (the round is charged as planned and marked not "
            "applied: its aggregate was never saved or broadcast); do not edit the ledger or the checkpoint.")
    log.warning("round %d was broadcast but %s%s", open_round, how, where)
    if checkpoint_round >= open_round:  # the model holds the round's aggregate: not applied would under-count
        raise ResumeRefused(f"cannot resume {path}: the checkpoint is from round {checkpoint_round}, so it holds "
                            f"open round {open_round}'s aggregate, which the ledger never recorded; it cannot be "
                            "charged as not applied (docs/MATH.md §14.3a). Nothing was written.")
    return open_round


#: min-replies - colluding-clients >= 4 under secure aggregation since its run path existed
LEGACY_SECURE_FLOOR = 4


def unfinished_contributors(config: AccountantConfig, contents: LedgerContents) -> int | None:
    """How many contributors the open round is charged as a sum of: None (the planned m) outside secure
    aggregation; under it the smallest sum SecAggGrid could have unmasked in that round, the floor recorded
    in its ``round-open`` event (``min_replies``), never the resumed run's (issue 28 item 1: a resume may
    raise min-replies for later rounds, not for a round already broadcast). A ``round-open`` event written
    before the floor was recorded is charged at the smallest floor any version accepted,
    ``colluding-clients`` + 4 (docs/MATH.md §20.5)."""
    if config.threat_model != "secure-aggregation":
        return None
    data = contents.open_round_event or {}
    floor = data.get("min_replies")
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 1:
        floor = config.colluders + LEGACY_SECURE_FLOOR
        log.warning("round %s's round-open event records no contributor floor (a ledger written before it was "
                    "recorded): charged as a sum of %d contributors, the smallest any version allowed",
                    contents.open_round, floor)
    return min(config.clients, floor)


def unfinished_screening_drop(config: AccountantConfig, contents: LedgerContents, legacy_levels: float) -> float:
    """The open round's screening charge (docs/MATH.md §17.1: its replies may have been screened and a drop
    logged before the crash), as recorded in its ``round-open`` event; a ledger written before it was recorded
    gets ``legacy_levels`` (the resumed run's noise-check + update-bound levels; none under secure aggregation,
    whose per-upload checks do not run)."""
    recorded = (contents.open_round_event or {}).get("screening_drop")
    if isinstance(recorded, (int, float)) and not isinstance(recorded, bool) and 0.0 <= recorded <= 1.0:
        return float(recorded)
    return 0.0 if config.threat_model == "secure-aggregation" else legacy_levels


def resume_ledger(path: str | os.PathLike[str], config: AccountantConfig, *, checkpoint_round: int = 0,
                  unfinished: UnfinishedRound = "refuse", plan: dict[str, Any] | None = None,
                  option: str = "unfinished_round",
                  legacy_screening_levels: float = 2 * DEFAULT_CHECK_LEVEL,
                  ) -> tuple[PrivacyLedger, PrivacyAccountant, LedgerContents]:
    """Re-open the ledger at ``path`` for a run continued from round ``checkpoint_round``'s model
    (0: from the initial model) and rebuild its accountant; the module docstring says what is written.

    An unfinished round is charged at what its ``round-open`` event recorded (the secure sum's contributor
    floor, the screening levels), never at the resumed run's settings; ``legacy_screening_levels`` is the
    screening charge of an open round whose event predates that record. ``plan``: recorded in the
    ``resume`` event (``watch`` shows it). Every check runs before the first write.
    """
    path = Path(path)
    lock = [open_locked(path)] if path.exists() else []  # the writer's lock before the ledger is read (review V1)
    try:
        return _resume_locked(path, lock, config, checkpoint_round, unfinished, plan, option, legacy_screening_levels)
    finally:
        for fd in lock:  # still ours: refused before PrivacyLedger.resume took the descriptor over
            os.close(fd)


def _resume_locked(path: Path, lock: list[int], config: AccountantConfig, checkpoint_round: int,
                   unfinished: UnfinishedRound, plan: dict[str, Any] | None, option: str,
                   legacy_screening_levels: float) -> tuple[PrivacyLedger, PrivacyAccountant, LedgerContents]:
    contents = PrivacyLedger.check_resumable(path, accountant_config=config.to_dict())
    records = round_records(contents)
    open_round = unfinished_round(path, contents, checkpoint_round, unfinished, option)
    lost = [r.round for r in records if r.applied and r.round > checkpoint_round]
    records = [replace(r, applied=False) if r.round in lost else r for r in records]
    accountant = PrivacyAccountant.from_records(config, records)
    record = None
    if open_round is not None:
        record = replace(config.planned_round(open_round, unfinished_contributors(config, contents), applied=False),
                         screening_drop=unfinished_screening_drop(config, contents, legacy_screening_levels),
                         batch_rate=unrecorded_round_rate(config))  # the sites' rates were never recorded
    report = accountant.peek(record) if record is not None else None  # raises before any write if it cannot

    fd = lock.pop() if lock else None  # from here the ledger owns (or, refusing, closes) the descriptor
    ledger = PrivacyLedger.resume(path, accountant_config=config.to_dict(), fd=fd)  # the first write
    ledger.append_event(RESUME_EVENT, {"rounds_accounted": len(records) + (record is not None),
                                       "checkpoint_round": checkpoint_round, **({"plan": plan} if plan else {})})
    if lost:  # before any later round: the replay (round_records, verify) honours it from here on
        ledger.append_event(NOT_APPLIED_EVENT, {
            "rounds": lost, "checkpoint_round": checkpoint_round,
            "reason": "round line written, aggregate lost before its checkpoint (training continues from "
                      + (f"round {checkpoint_round}'s model)" if checkpoint_round else "the initial model)")})
        log.warning("round(s) %s were accounted but their model was not saved: they stay charged to composition "
                    "and local DP and leave the final-model bound (not applied)", ", ".join(map(str, lost)))
    if record is not None and report is not None:
        report = accountant.step(record)
        ledger.append_round(round=record.round, record=record.to_dict(), report=report.to_dict(),
                            metrics={"dp-unfinished-accounted": 1})
        ledger.append_event(UNFINISHED_ROUND_EVENT, {
            "round": record.round, "line": contents.open_round_line, "torn": contents.torn_round == record.round,
            "accounted_as": "planned round, not applied (its aggregate was never saved or broadcast)",
            "contributors": record.clients})
        log.warning("round %d had no complete ledger line (line %s): charged as the planned round, not applied "
                    "(its uploads may have reached the server; its aggregate was never saved or broadcast) "
                    "(%s = 'account'); certified epsilon now %.6g",
                    record.round, contents.open_round_line, option, report.certified.epsilon)
    log.info("resuming %s: %d rounds accounted", path, accountant.num_releases)
    return ledger, accountant, contents

"""The ledger writer (append-only, fsynced, hash-chained; the package docstring has the rules)."""

from __future__ import annotations

import fcntl
import json
import logging
import math
import os
import threading
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fl_dp_flower.errors import FlDpError
from fl_dp_flower.privacy.records import AccountantConfig, RoundRecord

from ..durable import create_whole
from ..durable import json_safe as _encode
from .events import SCHEMA, TORN_TAIL_EVENT
from .reader import decode as _decode
from .reader import LedgerContents, line_hash, read_ledger

log = logging.getLogger("flwr").getChild(__name__)  # Flower's handlers: the ServerApp log


def utc_now() -> str:
    """Current UTC time as ISO 8601 (millisecond precision)."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")



def _dumps(entry: dict[str, Any]) -> bytes:
    return (json.dumps(_encode(entry), allow_nan=False, separators=(",", ":")) + "\n").encode()



def _normalize(d: dict[str, Any]) -> dict[str, Any]:
    """The value a dict has after a write/read round trip (tuples -> lists, etc.)."""
    return _decode(json.loads(json.dumps(_encode(d), allow_nan=False)))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b




class LedgerInUse(FlDpError, FileExistsError):
    """Another live run holds the ledger open for writing (its exclusive lock): two writers would both spend
    privacy on one account and break its chain (review V1: two resumes of one ledger both trained round 2)."""


def open_locked(path: str | os.PathLike[str]) -> int:
    """An append descriptor of the ledger at ``path`` holding its exclusive writer's lock (``flock``, released when
    the descriptor is closed or the process ends). Raises :class:`LedgerInUse` when a live run holds it."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise LedgerInUse(f"privacy ledger {path} is open for writing by another live run (it holds the ledger's "
                          "lock): two runs writing one ledger would both spend privacy and break its chain; wait for "
                          "that run to end (or stop it), then resume") from None
    return fd


def held_by_a_run(path: str | os.PathLike[str]) -> bool:
    """Whether a live run holds the ledger at ``path`` open for writing (:func:`open_locked`)."""
    try:
        os.close(open_locked(path))
    except LedgerInUse:
        return True
    except OSError:
        return False
    return False


def records_nothing(path: str | os.PathLike[str]) -> bool:
    """Whether the ledger at ``path`` holds its header alone (no event, no round: no round was ever opened,
    so nothing was broadcast or spent). Only a writer of an older version (or a caller of
    :meth:`PrivacyLedger.create` without ``first``) leaves such a file, possibly still in use by a live run."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return False
    return bool(data) and data.count(b"\n") == 1 and data.endswith(b"\n")


def refuse_existing(path: Path) -> None:
    """FileExistsError for a new ledger at ``path`` when a non-empty file is there (a ledger is never
    overwritten), saying how to continue it, and when it records nothing, that it may be deleted."""
    if not path.exists() or path.stat().st_size == 0:
        return
    hint = ""
    if records_nothing(path):
        hint = (" It holds only its header (no round opened: nothing broadcast or spent) and "
                + ("a live run is writing it (waiting for its nodes?): let it run, or stop it and resume=True."
                   if held_by_a_run(path) else "no live run holds it: resume=True continues it."))
    raise FileExistsError(f"privacy ledger {path} already exists; a ledger is never overwritten. Pass resume=True "
                          f"to continue the run it records, or give the new run another ledger path.{hint}")


class PrivacyLedger:
    """Append-only writer. Use :meth:`create` for a new run and :meth:`resume` to continue."""

    def __init__(self, path: Path, fd: int, header: dict[str, Any], rounds: list[dict[str, Any]],
                 torn_tail: bool = False, head: str | None = None) -> None:
        self.path = path
        self._file = os.fdopen(fd, "ab", buffering=0)
        self._lock = threading.Lock()
        self.header = header
        self.rounds = rounds
        self.torn_tail = torn_tail
        self.schema = header.get("schema", SCHEMA)
        self.head = head  # line_hash of the last line written (the chain's head), None before the header

    @property
    def last_round(self) -> int | None:
        """Round of the last round line, or None when no round was recorded yet."""
        return self.rounds[-1]["round"] if self.rounds else None

    @classmethod
    def create(cls, path: str | os.PathLike[str], *, accountant_config: dict[str, Any],
               app_config: dict[str, Any], first: dict[str, Any] | None = None) -> "PrivacyLedger":
        """Create a new ledger with its header, whole or not at all (:func:`..durable.create_whole`: a full disk
        leaves no ledger, never an empty one). ``first``: the first line after the header (an entry of
        :meth:`event_entry` / :meth:`round_entry`), written with the header in the same creation, so the file
        never holds its header alone (what a deferred creation, :class:`~fl_dp_flower.reporting.rounds.LedgerSink`,
        relies on). Refuses an existing ledger (:func:`refuse_existing`); an existing *empty* one (a creation an
        older version left half done: no header, so no round was ever opened) is replaced, with a WARNING."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        now = utc_now()
        header = {"kind": "header", "schema": SCHEMA, "accountant_config": accountant_config,
                  "app_config": app_config, "created": now, "time": now, "prev": None}
        lines = [_dumps(header)]
        if first is not None:
            lines.append(_dumps({**first, "prev": line_hash(lines[0])}))
        refused: FileExistsError | None = None
        try:
            replaced = create_whole(path, b"".join(lines))
        except FileExistsError as err:
            refused = err
        if refused is not None:
            refuse_existing(path)  # the FileExistsError saying what to do
            raise refused
        if replaced:
            log.warning("privacy ledger %s was empty (0 bytes: its creation was interrupted before its header was "
                        "written, so no round was ever opened or spent): replaced by this run's ledger", path)
        fd = open_locked(path)  # a resume racing this creation holds it first: refused here, nothing broadcast
        rounds = [_normalize(first)] if first is not None and first["kind"] == "round" else []
        return cls(path, fd, _normalize(header), rounds, head=line_hash(lines[-1]))

    @staticmethod
    def event_entry(kind: str, data: dict[str, Any]) -> dict[str, Any]:
        """The line of an event (``"budget-stop"``, ``"resume"``, ...), without its ``prev``."""
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"event kind must be a non-empty string, got {kind!r}")
        return {"kind": "event", "schema": SCHEMA, "event": kind, "data": data, "time": utc_now()}

    @staticmethod
    def round_entry(*, round: int, record: dict[str, Any], report: dict[str, Any], metrics: dict[str, Any],
                    after: int | None = None) -> dict[str, Any]:
        """The line of round ``round`` (validated: after round ``after``, a loadable record), without its ``prev``."""
        if isinstance(round, bool) or not isinstance(round, int) or round < 1:
            raise ValueError(f"round must be an integer >= 1, got {round!r}")
        if after is not None and round <= after:
            raise ValueError(f"round {round} is not after the last recorded round {after} "
                             "(the ledger is append-only, rounds strictly increasing)")
        rec = RoundRecord.from_dict(record)  # the ledger must stay loadable
        if rec.round != round:
            raise ValueError(f"record is for round {rec.round}, not round {round}")
        return {"kind": "round", "schema": SCHEMA, "round": round, "record": record, "report": report,
                "metrics": metrics, "time": utc_now()}

    @staticmethod
    def check_resumable(path: str | os.PathLike[str], *, accountant_config: dict[str, Any]) -> LedgerContents:
        """Read a ledger to resume and check its accountant config; writes nothing.

        Raises FileNotFoundError if the ledger does not exist and ValueError if it is corrupt
        or the header's accountant config differs (the message lists the differing keys).
        """
        path = Path(path)
        if not path.exists():
            raise FileNotFoundError(f"cannot resume: privacy ledger {path} does not exist")
        contents = read_ledger(path)
        stored = contents.header.get("accountant_config", {})
        try:  # a field the header predates reads as the rule it was written under (colluders = 0)
            stored = _normalize(AccountantConfig.from_dict(stored).to_dict())
        except (TypeError, ValueError) as err:
            raise ValueError(f"cannot resume {path}: its header's accountant config is invalid: {err}") from None
        given = _normalize(accountant_config)
        diff = sorted(k for k in set(stored) | set(given) if not _same(stored.get(k), given.get(k)))
        if diff:
            detail = ", ".join(f"{k}: ledger {stored.get(k)!r} != now {given.get(k)!r}" for k in diff)
            hint = (" (a ledger written before 'colluding-clients' existed was certified with c = 0: set "
                    "colluding-clients = 0 to continue it under its own rule, or start a new run)"
                    if "colluders" in diff else "")
            if "assume_smooth_losses" in diff:
                hint += (" (a ledger written before 'assume-smooth-losses' existed took L-smooth losses for "
                         "granted: set assume-smooth-losses = true to continue it under its own rule, or start "
                         "a new run)")
            if records_nothing(path):
                hint += (f" ({path} holds only its header: no round was ever opened, nothing spent; unless a run "
                         "still waiting for its nodes is writing it, it may be deleted to start a new run)")
            raise ValueError(
                f"cannot resume {path}: accountant config differs in key(s) {diff} ({detail}){hint}"
            )
        return contents

    @classmethod
    def resume(cls, path: str | os.PathLike[str], *, accountant_config: dict[str, Any],
               fd: int | None = None) -> "PrivacyLedger":
        """Re-open an existing ledger for appending (checks as :meth:`check_resumable`), holding its writer's lock
        (:func:`open_locked`) from before it is read: ``fd`` when the caller took the lock before reading it itself
        (:func:`~fl_dp_flower.reporting.resume.resume_ledger`); the descriptor is closed if the resume is refused.

        After a torn tail a newline and a ``torn-tail`` event are appended (the fragment is
        kept as it is). Callers that must refuse without writing call
        :meth:`check_resumable` first.
        """
        path = Path(path)
        if fd is None and path.exists():
            fd = open_locked(path)
        try:
            contents = cls.check_resumable(path, accountant_config=accountant_config)
            last_line = path.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)[-1]
        except BaseException:
            if fd is not None:
                os.close(fd)
            raise
        assert fd is not None  # check_resumable refused a missing ledger
        ledger = cls(path, fd, contents.header, list(contents.rounds), contents.torn_tail, line_hash(last_line))
        if not contents.ends_with_newline:
            ledger._write_raw(b"\n")  # the fragment becomes a line of its own; the chain runs through it
            if contents.torn_tail:
                ledger.append_event(TORN_TAIL_EVENT, {"line": contents.line_count, "kind": contents.torn_kind})
        return ledger

    def append_round(self, *, round: int, record: dict[str, Any], report: dict[str, Any],
                     metrics: dict[str, Any]) -> None:
        """Append one round line (fsynced). ``round`` must exceed :attr:`last_round`."""
        entry = {**self.round_entry(round=round, record=record, report=report, metrics=metrics, after=self.last_round),
                 "schema": self.schema}
        self._write(entry)
        self.rounds.append(_normalize(entry))

    def append_event(self, kind: str, data: dict[str, Any]) -> None:
        """Append a non-round line, e.g. ``"budget-stop"``, ``"resume"``, ``"end"`` (fsynced)."""
        self._write({**self.event_entry(kind, data), "schema": self.schema})

    def _write(self, entry: dict[str, Any]) -> None:
        with self._lock:
            if self.schema >= 2:
                entry = {**entry, "prev": self.head}
            line = _dumps(entry)
            self._write_locked(line)
            self.head = line_hash(line)

    @property
    def head_line_hash(self) -> str | None:
        """The chain's head: the hash a verifier must reach at the ledger's last line."""
        return self.head

    def _write_raw(self, line: bytes) -> None:
        with self._lock:
            self._write_locked(line)

    def _write_locked(self, line: bytes) -> None:
        """One whole line with one write loop, then flush + fsync (caller holds the lock)."""
        if self._file.closed:
            raise ValueError(f"privacy ledger {self.path} is closed")
        view = memoryview(line)
        while view:
            view = view[self._file.write(view):]
        self._file.flush()
        os.fsync(self._file.fileno())

    def close(self) -> None:
        """Close the file (every line is already durable)."""
        with self._lock:
            self._file.close()

    def __enter__(self) -> "PrivacyLedger":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""Durable, append-only JSONL privacy ledger.

A privacy ledger is never lost or rewritten:

- the file is only ever opened with ``O_APPEND`` (never truncated, never seek-written);
- every line is written with a single ``write`` of the whole line, then ``flush()`` and
  ``os.fsync()``; the directory is fsynced when the file is created;
- round numbers are strictly increasing, and every round record is validated as a
  :class:`~fl_dp_flower.privacy.records.RoundRecord` before it is written, so the
  accountant can always be rebuilt from the ledger (reporting/replay.py).

Tamper evidence (schema 2): every line carries ``"prev"``, the SHA-256 (hex) of the previous
physical line's bytes (without its newline; ``null`` on the header), so editing, deleting or
inserting any line breaks the chain at the next line; ``fl-dp-flower verify`` checks it and
recomputes every round's privacy (:mod:`fl_dp_flower.reporting.verify`). Ledgers of schema 1
(before the chain) are still read and resumed; they lack the ``prev`` fields, so ``verify`` can
recompute their numbers but cannot detect a deleted or edited line.

Line format (one JSON object per line, ``"schema"`` and UTC ISO-8601 ``"time"`` on each)::

    {"kind": "header", "accountant_config": {...}, "app_config": {...}, "created": iso, ...}
    {"kind": "round", "round": t, "record": {...}, "report": {...}, "metrics": {...}, ...}
    {"kind": "event", "event": "budget-stop", "data": {...}, ...}

Non-finite floats are stored as the strings ``"inf"``, ``"-inf"`` and ``"nan"`` (strict JSON)
and mapped back to floats when reading.

Write-ahead: before a round is broadcast the server appends a ``round-open`` event (round
number, sampled nodes); the round is closed by its ``round`` line, or by a ``round-void`` event
when it released nothing (no usable reply, or replies discarded by the budget before
aggregation). A round that is open at the end of the ledger (:attr:`LedgerContents.open_round`)
was broadcast, so its uploads may have reached the server, but its accounting never became
durable: a crash, or a torn write of its round line. Resuming must not silently drop it (the
ServerApp refuses, or, on the operator's explicit choice, charges it as the planned round, not
applied: its aggregate was never saved or broadcast, since a round line precedes both).

Applied rounds (docs/MATH.md §14.3a): ``"applied": false`` in a record, or a later
``rounds-not-applied`` event (``{"rounds": [...]}``, for a round whose model was lost before its
checkpoint; lines are never rewritten), takes a round out of the final-model bound;
``replay.round_records`` and ``verify`` honour both.

Crash tolerance: a final line without a trailing newline that is not valid JSON is a torn
write (``torn_tail=True``; its kind, as far as the fragment shows, in ``torn_kind``) and is
ignored. :meth:`PrivacyLedger.resume` then appends a newline and a ``torn-tail`` event naming
the fragment's line number, so the fragment stays on its own line and later reads accept it.
Any other invalid line is corruption and raises ``ValueError`` with its line number. A torn
line that is (or may be) a round line leaves that round open, also in ledgers written before
``round-open`` events existed.

Files are created owner-only (mode 0600).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import threading
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from fl_dp_flower.privacy.records import AccountantConfig, RoundRecord
from .durable import fsync_dir as _fsync_dir
from .durable import json_safe as _encode
from .durable import load_json_line

SCHEMA = 2  # written by this version: hash-chained lines
SCHEMAS = (1, 2)  # read: 1 = before the chain
TORN_TAIL_EVENT = "torn-tail"
ROUND_OPEN_EVENT = "round-open"
ROUND_VOID_EVENT = "round-void"
NOT_APPLIED_EVENT = "rounds-not-applied"
FILE_MODE = 0o600  # ledger and run outputs: owner-only
_KIND_PREFIX = re.compile(rb'^\{"kind":"(header|round|event)"')
_ROUND_IN_FRAGMENT = re.compile(rb'"round":(\d+)')
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def utc_now() -> str:
    """Current UTC time as ISO 8601 (millisecond precision)."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")


def _decode(obj: Any) -> Any:
    """Inverse of :func:`_encode` for parsed JSON."""
    if isinstance(obj, str):
        return _NONFINITE.get(obj, obj)
    if isinstance(obj, dict):
        return {k: _decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_decode(v) for v in obj]
    return obj


def _dumps(entry: dict[str, Any]) -> bytes:
    return (json.dumps(_encode(entry), allow_nan=False, separators=(",", ":")) + "\n").encode()


def line_hash(line: bytes) -> str:
    """SHA-256 (hex) of one ledger line's bytes, without its newline: the next line's ``prev``."""
    return hashlib.sha256(line.rstrip(b"\n")).hexdigest()


def _normalize(d: dict[str, Any]) -> dict[str, Any]:
    """The value a dict has after a write/read round trip (tuples -> lists, etc.)."""
    return _decode(json.loads(json.dumps(_encode(d), allow_nan=False)))


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


@dataclass(frozen=True)
class LedgerContents:
    """Parsed ledger. ``torn_tail`` is True when the final line was a torn (ignored) write."""

    header: dict[str, Any]
    rounds: list[dict[str, Any]] = field(default_factory=list)
    events: list[dict[str, Any]] = field(default_factory=list)
    torn_tail: bool = False
    ends_with_newline: bool = True
    line_count: int = 0
    torn_kind: str | None = None  # "header" | "round" | "event" | "unknown" (fragment too short)
    open_round: int | None = None  # a broadcast round with no durable round line (see module doc)
    open_round_line: int | None = None  # the line that opened it (round-open event or torn line)
    torn_round: int | None = None  # the round a torn tail is (or may be) the line of

    @property
    def last_round(self) -> int:
        """Round number of the last complete round line (0 when none)."""
        return self.rounds[-1]["round"] if self.rounds else 0


def _parse_line(raw: bytes) -> dict[str, Any] | None:
    try:
        entry = load_json_line(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return entry if isinstance(entry, dict) and "kind" in entry else None


def read_ledger(path: str | os.PathLike[str]) -> LedgerContents:
    """Read and validate a ledger (see the module docstring for the torn-tail rule)."""
    path = Path(path)
    data = path.read_bytes()
    if not data:
        raise ValueError(f"privacy ledger {path} is empty (its creation was interrupted)")
    ends_with_newline = data.endswith(b"\n")
    lines = data.split(b"\n")
    if ends_with_newline:
        lines.pop()
    parsed = [_parse_line(raw) for raw in lines]
    torn_tail = not ends_with_newline and parsed[-1] is None

    header: dict[str, Any] | None = None
    rounds: list[dict[str, Any]] = []
    events: list[dict[str, Any]] = []
    open_round: int | None = None
    open_line: int | None = None
    torn_kind: str | None = None
    torn_round: int | None = None
    for i, entry in enumerate(parsed):
        lineno = i + 1
        if entry is None:
            if i == len(parsed) - 1 and torn_tail:
                kind_match = _KIND_PREFIX.match(lines[i])
                torn_kind = kind_match.group(1).decode() if kind_match else "unknown"
                if torn_kind in ("round", "unknown") and header is not None:
                    found = _ROUND_IN_FRAGMENT.search(lines[i])
                    last = rounds[-1]["round"] if rounds else 0
                    torn_round = int(found.group(1)) if found and torn_kind == "round" else last + 1
                    if open_round is None or torn_round > open_round:
                        open_round, open_line = torn_round, lineno
                break
            nxt = parsed[i + 1] if i + 1 < len(parsed) else None
            if not (
                nxt is not None
                and nxt.get("kind") == "event"
                and nxt.get("event") == TORN_TAIL_EVENT
                and nxt.get("data", {}).get("line") == lineno
            ):
                raise ValueError(f"privacy ledger {path}: line {lineno} is not a valid ledger entry")
            continue  # a torn write from an earlier crash, recorded by the next line
        entry = _decode(entry)
        expected = header.get("schema") if header is not None else entry.get("schema")
        if entry.get("schema") not in SCHEMAS or entry.get("schema") != expected:
            raise ValueError(
                f"privacy ledger {path}: line {lineno} has schema {entry.get('schema')!r}, "
                f"expected {expected if expected in SCHEMAS else ' or '.join(map(str, SCHEMAS))}"
            )
        kind = entry["kind"]
        if lineno == 1:
            if kind != "header":
                raise ValueError(f"privacy ledger {path}: line 1 is not a header")
            header = entry
        elif kind == "round":
            if isinstance(entry.get("round"), bool) or not isinstance(entry.get("round"), int):
                raise ValueError(f"privacy ledger {path}: line {lineno} has no integer round")
            if rounds and not entry["round"] > rounds[-1]["round"]:
                raise ValueError(
                    f"privacy ledger {path}: line {lineno} has round {entry['round']} after "
                    f"round {rounds[-1]['round']} (rounds must be strictly increasing)"
                )
            rounds.append(entry)
            if open_round is not None and entry["round"] >= open_round:
                open_round = open_line = None
        elif kind == "event":
            events.append(entry)
            data = entry.get("data") if isinstance(entry.get("data"), dict) else {}
            if entry.get("event") == ROUND_OPEN_EVENT and isinstance(data.get("round"), int):
                open_round, open_line = data["round"], lineno
            elif entry.get("event") == ROUND_VOID_EVENT and data.get("round") == open_round:
                open_round = open_line = None
        else:
            raise ValueError(f"privacy ledger {path}: line {lineno} has unknown kind {kind!r}")
    if header is None:
        raise ValueError(f"privacy ledger {path} has no header (its creation was interrupted)")
    return LedgerContents(header, rounds, events, torn_tail, ends_with_newline, len(lines), torn_kind,
                          open_round, open_line, torn_round)


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
               app_config: dict[str, Any]) -> "PrivacyLedger":
        """Create a new ledger and write (and fsync) its header. Refuses an existing file."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_APPEND, FILE_MODE)
        except FileExistsError:
            raise FileExistsError(
                f"privacy ledger {path} already exists; a ledger is never overwritten. "
                "Set resume = true to continue that run, or choose another run-name."
            ) from None
        now = utc_now()
        header = {"kind": "header", "schema": SCHEMA, "accountant_config": accountant_config,
                  "app_config": app_config, "created": now, "time": now}
        ledger = cls(path, fd, _normalize({**header, "prev": None}), [])
        ledger._write(header)
        _fsync_dir(path.parent)
        return ledger

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
            raise ValueError(
                f"cannot resume {path}: accountant config differs in key(s) {diff} ({detail}){hint}"
            )
        return contents

    @classmethod
    def resume(cls, path: str | os.PathLike[str], *,
               accountant_config: dict[str, Any]) -> "PrivacyLedger":
        """Re-open an existing ledger for appending (checks as :meth:`check_resumable`).

        After a torn tail a newline and a ``torn-tail`` event are appended (the fragment is
        kept as it is). Callers that must refuse without writing call
        :meth:`check_resumable` first.
        """
        path = Path(path)
        contents = cls.check_resumable(path, accountant_config=accountant_config)
        last_line = path.read_bytes().rstrip(b"\n").rsplit(b"\n", 1)[-1]
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
        ledger = cls(path, fd, contents.header, list(contents.rounds), contents.torn_tail, line_hash(last_line))
        if not contents.ends_with_newline:
            ledger._write_raw(b"\n")  # the fragment becomes a line of its own; the chain runs through it
            if contents.torn_tail:
                ledger.append_event(TORN_TAIL_EVENT, {"line": contents.line_count, "kind": contents.torn_kind})
        return ledger

    def append_round(self, *, round: int, record: dict[str, Any], report: dict[str, Any],
                     metrics: dict[str, Any]) -> None:
        """Append one round line (fsynced). ``round`` must exceed :attr:`last_round`."""
        if isinstance(round, bool) or not isinstance(round, int) or round < 1:
            raise ValueError(f"round must be an integer >= 1, got {round!r}")
        if self.last_round is not None and round <= self.last_round:
            raise ValueError(
                f"round {round} is not after the last recorded round {self.last_round} "
                f"in {self.path} (the ledger is append-only, rounds strictly increasing)"
            )
        rec = RoundRecord.from_dict(record)  # the ledger must stay loadable
        if rec.round != round:
            raise ValueError(f"record is for round {rec.round}, not round {round}")
        entry = {"kind": "round", "schema": self.schema, "round": round, "record": record,
                 "report": report, "metrics": metrics, "time": utc_now()}
        self._write(entry)
        self.rounds.append(_normalize(entry))

    def append_event(self, kind: str, data: dict[str, Any]) -> None:
        """Append a non-round line, e.g. ``"budget-stop"``, ``"resume"``, ``"end"`` (fsynced)."""
        if not isinstance(kind, str) or not kind:
            raise ValueError(f"event kind must be a non-empty string, got {kind!r}")
        self._write({"kind": "event", "schema": self.schema, "event": kind, "data": data,
                     "time": utc_now()})

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

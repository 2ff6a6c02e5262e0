"""Durable, append-only JSONL privacy ledger: ``events`` (format and event names), ``writer``
(:class:`PrivacyLedger`) and ``reader`` (the one reader every consumer uses).

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

from .events import (BUDGET_STOP_EVENT, CLOSING_EVENTS, END_EVENT, FAILED_EVENT, FILE_MODE, LEDGER_FILE, NODE_EXCLUDED_EVENT,
                     NOT_APPLIED_EVENT, RESUME_EVENT, ROUND_OPEN_EVENT, ROUND_VOID_EVENT, SCHEMA, SCHEMAS,
                     TORN_TAIL_EVENT, UNFINISHED_ROUND_EVENT)
from .reader import LedgerContents, LedgerFollower, decode, line_hash, parse_line, read_ledger, split_lines
from .writer import PrivacyLedger, utc_now

__all__ = ["BUDGET_STOP_EVENT", "CLOSING_EVENTS", "END_EVENT", "FAILED_EVENT", "LEDGER_FILE", "NODE_EXCLUDED_EVENT",
           "RESUME_EVENT", "UNFINISHED_ROUND_EVENT", "FILE_MODE", "NOT_APPLIED_EVENT", "ROUND_OPEN_EVENT", "ROUND_VOID_EVENT", "SCHEMA", "SCHEMAS",
           "TORN_TAIL_EVENT", "LedgerContents", "LedgerFollower", "PrivacyLedger", "decode", "line_hash",
           "parse_line", "read_ledger", "split_lines", "utc_now"]

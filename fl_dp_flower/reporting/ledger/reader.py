"""The one ledger reader: the line parser, the torn-line rule and the whole-file reader
(:func:`read_ledger`, used by resume, replay, plot and Prometheus), the raw lines for the hash
chain (:func:`split_lines` + :func:`parse_line`, used by verify) and the tail follower (watch).
Fields it does not know are kept as they are (newer writers may add them)."""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..durable import load_json_line
from .events import ROUND_OPEN_EVENT, ROUND_VOID_EVENT, SCHEMAS, TORN_TAIL_EVENT

_KIND_PREFIX = re.compile(rb'^\{"kind":"(header|round|event)"')
_ROUND_IN_FRAGMENT = re.compile(rb'"round":(\d+)')
_NONFINITE = {"inf": math.inf, "-inf": -math.inf, "nan": math.nan}


def decode(obj: Any) -> Any:
    """Map the strings "inf", "-inf", "nan" of parsed JSON back to floats (inverse of the writer's encoding)."""
    if isinstance(obj, str):
        return _NONFINITE.get(obj, obj)
    if isinstance(obj, dict):
        return {k: decode(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [decode(v) for v in obj]
    return obj



def line_hash(line: bytes) -> str:
    """SHA-256 (hex) of one ledger line's bytes, without its newline: the next line's ``prev``."""
    return hashlib.sha256(line.rstrip(b"\n")).hexdigest()



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

    @property
    def open_round_event(self) -> dict[str, Any] | None:
        """The data of the ``round-open`` event of :attr:`open_round` (what the server recorded
        before broadcasting it: node ids, contributor floor), None when no round is open or none
        was written for it."""
        if self.open_round is None:
            return None
        for entry in reversed(self.events):
            data = entry.get("data")
            if entry.get("event") == ROUND_OPEN_EVENT and isinstance(data, dict) and data.get("round") == self.open_round:
                return data
        return None


def parse_line(raw: bytes) -> dict[str, Any] | None:
    """One ledger line (bytes, without its newline) -> its entry with non-finite floats decoded, or
    None when it is not a ledger entry (a torn or corrupt write; integers of absurd length count as
    corrupt). The one line parser: read_ledger, verify and watch all use it."""
    try:
        entry = load_json_line(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    return decode(entry) if isinstance(entry, dict) and "kind" in entry else None


def split_lines(data: bytes) -> tuple[list[bytes], bool]:
    """A ledger file's bytes -> (its physical lines without newlines, whether the file ends with a
    newline). A last line without one may be a torn write (module docstring of the package)."""
    ends_with_newline = data.endswith(b"\n")
    lines = data.split(b"\n")
    if ends_with_newline:
        lines.pop()
    return lines, ends_with_newline


def read_ledger(path: str | os.PathLike[str]) -> LedgerContents:
    """Read and validate a ledger (see the module docstring for the torn-tail rule)."""
    path = Path(path)
    data = path.read_bytes()
    if not data:
        raise ValueError(f"privacy ledger {path} is empty (0 bytes: its creation was interrupted before its header "
                         "was written, so no round was ever opened or spent; the ServerApp replaces an empty ledger, "
                         "with resume = true or false)")
    lines, ends_with_newline = split_lines(data)
    parsed = [parse_line(raw) for raw in lines]
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
            event_data: dict[str, Any] = entry["data"] if isinstance(entry.get("data"), dict) else {}
            if entry.get("event") == ROUND_OPEN_EVENT and isinstance(event_data.get("round"), int):
                open_round, open_line = event_data["round"], lineno
            elif entry.get("event") == ROUND_VOID_EVENT and event_data.get("round") == open_round:
                open_round = open_line = None
        else:
            raise ValueError(f"privacy ledger {path}: line {lineno} has unknown kind {kind!r}")
    if header is None:
        raise ValueError(f"privacy ledger {path} has no header (its creation was interrupted)")
    return LedgerContents(header, rounds, events, torn_tail, ends_with_newline, len(lines), torn_kind,
                          open_round, open_line, torn_round)


class LedgerFollower:
    """Incremental reader (``watch``): :meth:`poll` returns the complete entries appended since the
    last call; lines that are not entries (an earlier torn write, recorded by a torn-tail event) are
    skipped, a line still being written waits for its newline."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self._partial = path, 0, b""

    def poll(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return []
        self.offset += len(chunk)
        *lines, self._partial = (self._partial + chunk).split(b"\n")  # the last piece is incomplete (or empty)
        return [entry for entry in map(parse_line, lines) if entry is not None]

    @property
    def pending_bytes(self) -> int:
        """Bytes of a line not yet complete (being written, or torn)."""
        return len(self._partial)

"""``fl-dp-flower verify LEDGER``: check a privacy ledger without trusting the run that wrote it.

What it checks, line by line, and where it stops (the first line that fails is reported):

1. **Header.** Line 1 is a header of a known schema whose accountant configuration parses
   (typed checks, docs/MATH.md §15 for what it configures).
2. **Chain** (schema 2). Every line's ``prev`` is the SHA-256 of the line before it: an edited,
   deleted or inserted line breaks the chain at the next line. The hash of the last line (the
   *head*) is printed; compare it with the head the run logged and wrote to ``summary.json``
   to detect a ledger cut short or rewritten from some line on.
3. **Rounds.** Every round's record is parsed and replayed through a fresh accountant, in order,
   and every number of its report (each bound's mu, epsilon and soundness, the certified bound
   and its epsilon, clients, round counts, the screening charge on delta) must match what was recorded (relative 1e-9).
   Rounds recorded as not applied (``"applied": false``) and rounds named by a
   ``rounds-not-applied`` event (from that event on) leave the final-model bound, as the server
   counted them. A header without ``colluders`` (written before the field) is recomputed with
   c = 0, the rule it was certified under; a round record without ``applied`` as applied.
   A secret sample's ledger (``sample_secrecy`` "secret", docs/MATH.md §22) must hold counts only: a
   round record with ``node_ids`` (the accountant refuses it), a ``round-open`` event with ``node_ids``, or a
   node-naming or ``round-members`` event fails it (its reader would learn the sample the
   ``sampled_secret`` bound takes to be secret).
4. **Structure** (schema 2). Each round line follows its ``round-open`` event (the write-ahead
   line the server appends before broadcasting), and nothing but a ``resume`` follows a run's
   ``end``.
5. **Completeness** (schema 2). The chain proves order, not completeness: a ledger whose last
   lines were deleted still chains. So the head must reach what the run published: every
   ``expected_heads`` value (the operator's copy of the head from the run's log, ``summary.json``
   or Prometheus' ``fl_dp_ledger_head_info``; the CLI adds ``summary.json``'s ``ledger_head`` when
   one lies beside the ledger) must be the hash of one of the ledger's lines (the last one, or an
   earlier one when the run went on after publishing it). Without any published head, a ledger
   that does not end with the run's ``end`` (or ``failed``) event fails unless ``live`` says the
   run is still running (or crashed and awaits its resume): its tail may have been cut. A published head given
   for a ledger without a chain (schema 1) fails (no line of it can match; a downgraded ledger would otherwise
   skip this check), and a closed ledger verified without any published head gets a note that its completeness
   is unproven (a cut ledger closed by a hand-written ``end`` event chains too).
6. **Open round** (a note). A ledger ending with a round that was broadcast and neither recorded nor voided
   (a live run, or one stopped mid-round) certifies without it; under ``curious-server`` and
   ``secure-aggregation`` its uploads may have reached the server, so the note says the run may have spent
   more (``resume-unfinished-round = 'account'`` charges it).

What it does not prove: that clients really added the noise they reported, ran the steps they
echoed, or that the server recorded every client it heard from; it proves that the published
numbers follow from the recorded rounds, and that the recorded lines were not changed after
the fact without rewriting the chain from that line on (which the head hash reveals). A ledger
of schema 1 (before the chain) gets checks 1 and 3 only.
"""

from __future__ import annotations

import math
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.records import AccountantConfig, RoundRecord
from fl_dp_flower.vocabulary import BOUND_NAMES

from .ledger import (
    CLOSING_EVENTS,
    END_EVENT,
    RESUME_EVENT,
    NOT_APPLIED_EVENT,
    ROUND_OPEN_EVENT,
    ROUND_VOID_EVENT,
    SCHEMAS,
    TORN_TAIL_EVENT,
    line_hash,
    parse_line,
    split_lines,
)
from .ledger.events import FAILED_EVENT, MEMBERS_EVENT, NODE_ID_EVENTS
from .replay import not_applied_rounds

REL_TOL = 1e-9


@dataclass
class Verification:
    """The outcome of :func:`verify_ledger` (``ok`` is False on the first failure)."""

    path: str
    ok: bool = True
    schema: int | None = None
    lines: int = 0
    rounds_verified: int = 0
    chained: bool = False
    head: str | None = None
    ended: bool = False
    threat_model: str | None = None
    open_round: int | None = None  # a round broadcast (round-open) with neither a round line nor a round-void after it
    heads_checked: list[str] = field(default_factory=list)
    failure_line: int | None = None
    failure: str | None = None
    notes: list[str] = field(default_factory=list)
    seconds: float = 0.0

    def fail(self, line: int, reason: str) -> "Verification":
        self.ok, self.failure_line, self.failure = False, line, reason
        return self

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


#: round metrics that describe a round's contributors: a secret ledger written before they went to the owner-only
#: members file has them (now none of them is on a secret ledger's round line)
_CONTRIBUTOR_STATS = frozenset({"num-examples", "dp-capped", "dp-echo-mismatch"})
#: a node named in a failure reason ("node 123...")
_NODE_ID = re.compile(r"\bnodes? \[?\d")


def _close(a: Any, b: Any) -> bool:
    if isinstance(a, bool) or isinstance(b, bool):
        return a is b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if math.isinf(a) or math.isinf(b) or math.isnan(a) or math.isnan(b):
            return (a == b) or (math.isnan(a) and math.isnan(b))
        return math.isclose(a, b, rel_tol=REL_TOL, abs_tol=1e-300)
    return a == b


def _report_difference(recorded: Any, recomputed: dict[str, Any]) -> str | None:
    """The first number of ``recomputed`` that ``recorded`` does not match, as text."""
    if not isinstance(recorded, dict):
        return "the round line has no report"
    for key in ("round", "rounds", "clients", "threat_model", "delta", "rounds_applied", "colluders"):
        if key not in recorded and key in ("rounds_applied", "colluders"):
            continue  # written before these fields existed
        if not _close(recorded.get(key), recomputed[key]):
            return f"report {key}: recorded {recorded.get(key)!r}, recomputed {recomputed[key]!r}"
    if "screening" in recorded or recomputed.get("screening"):  # the delta the certified epsilon holds at (§17.1)
        required = {"drop_probability", "delta_total"} & set(recomputed.get("screening") or {})  # later keys: if written
        for key in sorted(set(recorded.get("screening") or {}) | required):
            got, want = (recorded.get("screening") or {}).get(key), (recomputed.get("screening") or {}).get(key)
            if not _close(got, want):
                return f"screening {key}: recorded {got!r}, recomputed {want!r}"
    for key in ("bound", "mu", "epsilon"):
        got = (recorded.get("certified") or {}).get(key)
        if not _close(got, recomputed["certified"][key]):
            return f"certified {key}: recorded {got!r}, recomputed {recomputed['certified'][key]!r}"
    extra = [n for n in recomputed["bounds"] if n not in BOUND_NAMES]  # "sampled": Poisson client sampling
    for name in (*BOUND_NAMES, *extra):
        for key in ("mu", "epsilon", "sound"):
            got = ((recorded.get("bounds") or {}).get(name) or {}).get(key)
            if not _close(got, recomputed["bounds"][name][key]):
                return f"{name} {key}: recorded {got!r}, recomputed {recomputed['bounds'][name][key]!r}"
    if "add_remove" in recorded:  # reports since issue 16 item 10a: the add/remove-one guarantee too
        for key in ("bound", "mu", "epsilon"):
            got = (recorded.get("add_remove") or {}).get(key)
            if not _close(got, recomputed["add_remove"][key]):
                return f"add/remove-one {key}: recorded {got!r}, recomputed {recomputed['add_remove'][key]!r}"
    return None


def _aggregated(entry: dict[str, Any]) -> bool:
    """Whether a round line's metrics say its aggregate was applied (True when they do not say)."""
    metrics = entry.get("metrics") or {}
    return metrics.get("dp-aggregated", 1) != 0 and metrics.get("dp-unfinished-accounted", 0) != 1


def verify_ledger(path: str | Path, *, expected_heads: dict[str, str] | None = None,
                  live: bool = False) -> Verification:
    """Run every check of the module docstring on the ledger at ``path``.

    ``expected_heads``: {where it was published: head hash} (check 5); ``live``: the run is still
    running, so a ledger without an ``end`` event is expected (check 5).
    """
    started = time.perf_counter()
    path = Path(path)
    result = Verification(str(path))
    try:
        _verify(path, path.read_bytes(), result)
        if result.ok and not result.chained and expected_heads:  # review R2: a downgraded ledger skipped the heads
            result.fail(result.lines, "a published head was given but this ledger has no hash chain (schema "
                                      f"{result.schema}): no line of it can match a head (a run that publishes one "
                                      "writes a chained ledger), so lines may have been cut or rewritten unseen")
        elif result.ok and result.chained:
            _check_complete(path.read_bytes(), result, expected_heads or {}, live)
        if result.ok and result.open_round is not None:
            result.notes.append(_open_round_note(result.open_round, result.threat_model))
        return result
    finally:
        result.seconds = time.perf_counter() - started


#: Events after which a run wrote nothing more (until a ``resume``).


def _check_complete(data: bytes, v: Verification, expected_heads: dict[str, str], live: bool) -> None:
    """Check 5: the ledger reaches every published head; without one, it ends with a closing event."""
    hashes: dict[str, int] = {}
    for number, raw in enumerate(data.split(b"\n")[:v.lines], start=1):
        hashes.setdefault(line_hash(raw), number)
    for source, head in expected_heads.items():
        head = head.strip().lower()
        found = hashes.get(head)
        if found is None:
            v.fail(v.lines, f"the head the run published ({source}: {head}) is the hash of no line of this "
                            "ledger: lines were cut from its end (it then under-states the privacy spent), or "
                            "this is not the ledger that run wrote")
            return
        after = v.lines - found
        v.heads_checked.append(f"{source}: line {found}" + (f", {after} line(s) appended after it" if after else ""))
    # completeness needs the end event: a head published mid-run (Prometheus, after a round) may be
    # the last line of a ledger cut right after it
    if v.ended:
        if not expected_heads:  # review R2: the chain has no key, so a cut ledger can be closed by a forged end
            v.notes.append("no published head was checked: the chain has no key and proves order, not completeness "
                           "(a ledger cut after any round, or rewritten from any line on, and re-chained with a "
                           "hand-written end event also passes); compare the head "
                           "printed below with the one the run published (its log, summary.json 'ledger_head', "
                           "Prometheus fl_dp_ledger_head_info) or pass it with --expected-head")
        return
    if live:
        v.notes.append("the ledger has no end event and the run is live (--live): no published head protects "
                       "its last lines yet; verify again against the head the run publishes when it ends")
        return
    if expected_heads:
        v.notes.append("lines follow the published head without an end event: the run went on after it was "
                       "published and is live or crashed (pass --live), or its tail was cut after that head")
    v.fail(v.lines, "the ledger does not end with the run's end event: the run is live or crashed (resume "
                    "closes it), or its last lines were cut, which the hash chain cannot show (it proves order, "
                    "not completeness). Compare with the head the run published: pass --expected-head (from "
                    "its log, summary.json 'ledger_head' or Prometheus fl_dp_ledger_head_info), or --live if "
                    "the run is still running")


def _open_round_note(round_: int, threat_model: str | None) -> str:
    """What a ledger that ends with an open round (broadcast, never recorded nor voided) leaves out (review R2)."""
    seen = threat_model in ("curious-server", "secure-aggregation")
    return (f"round {round_} was broadcast but has no round line (the run is live, or it stopped mid-round): the "
            "numbers above leave it out" + (f"; under {threat_model} its uploads (or their sum) may already have "
                                            "reached the server, so the run may have spent more than certified here:"
                                            if seen else ", and it released nothing to a global-model adversary;")
            + " a resume with resume-unfinished-round = 'account' charges it as planned (docs/MATH.md §14.3a)")


def _verify(path: Path, data: bytes, v: Verification) -> Verification:
    if not data:
        return v.fail(1, "the ledger is empty")
    raw_lines, ends_with_newline = split_lines(data)
    v.lines = len(raw_lines)
    parsed = [parse_line(raw) for raw in raw_lines]  # the ledger's one line parser (None: not an entry)

    header = parsed[0]
    if header is None or header.get("kind") != "header":
        return v.fail(1, "line 1 is not a ledger header")
    v.schema = header.get("schema")
    if v.schema not in SCHEMAS:
        return v.fail(1, f"unknown ledger schema {v.schema!r} (this version reads {SCHEMAS})")
    v.chained = v.schema >= 2
    if v.chained and header.get("prev") is not None:
        return v.fail(1, "the header's prev must be null (it is the first line)")
    try:
        config = AccountantConfig.from_dict(header.get("accountant_config"))
    except (ValueError, TypeError) as err:
        return v.fail(1, f"header accountant_config: {err}")
    if "colluders" not in (header.get("accountant_config") or {}):
        v.notes.append("the header predates 'colluders': recomputed against an outside observer (c = 0), the "
                       "rule it was certified under; a participating client, who knows its own upload, is not "
                       "covered by these numbers (docs/MATH.md §14.2a)")
    if "assume_smooth_losses" not in (header.get("accountant_config") or {}):
        v.notes.append("the header predates 'assume_smooth_losses': recomputed with L-smooth losses taken for "
                       "granted, the rule it was certified under; its final-model, paper and per-sample "
                       "(K >= 2) numbers hold only if every loss is L-smooth (docs/MATH.md §13, §15)")
    if not v.chained:
        v.notes.append("schema 1 ledger (written before the hash chain): edits and deletions of whole "
                       "lines cannot be detected, only numbers that do not follow from the records")

    v.threat_model = config.threat_model
    accountant = PrivacyAccountant(config)
    opened: int | None = None  # round of the last round-open event not yet followed by its round
    ended = False
    for i in range(1, len(raw_lines)):
        lineno, entry = i + 1, parsed[i]
        last_line = i == len(raw_lines) - 1
        if v.chained and entry is not None and entry.get("prev") != line_hash(raw_lines[i - 1]):
            return v.fail(lineno, f"hash chain broken: prev does not match line {i} (line {i} was edited, "
                                  f"or a line was deleted or inserted before line {lineno})")
        if entry is None:
            if last_line and not ends_with_newline:
                v.notes.append(f"line {lineno} is a torn last line (a write cut short); not verified")
                break
            nxt = parsed[i + 1] if i + 1 < len(parsed) else None
            if not (nxt and nxt.get("event") == TORN_TAIL_EVENT and (nxt.get("data") or {}).get("line") == lineno):
                return v.fail(lineno, "not a valid ledger line, and no torn-tail event records it")
            continue
        if entry.get("schema") != v.schema:
            return v.fail(lineno, f"schema {entry.get('schema')!r} differs from the header's {v.schema}")
        kind = entry.get("kind")
        if ended and not (kind == "event" and entry.get("event") in (RESUME_EVENT, TORN_TAIL_EVENT)):
            return v.fail(lineno, "a line after the run's end event that is not a resume")
        if kind == "event":
            event, data_ = entry.get("event"), entry.get("data") or {}
            if config.sample_secrecy == "secret" and event == FAILED_EVENT and _NODE_ID.search(str(data_)):
                v.notes.append(f"line {lineno}: the failed event names a node (a secret ledger written before its "
                               "reason went into counts): its reader may learn that node was drawn")
            if config.sample_secrecy == "secret" and (event in (*NODE_ID_EVENTS, MEMBERS_EVENT) or (
                    event == ROUND_OPEN_EVENT and "node_ids" in data_)):
                return v.fail(lineno, f"a secret sample's ledger names a node ({event} event): whoever reads it learns "
                                      "the sample, so its sampled_secret epsilon does not hold (docs/MATH.md §22)")
            if event == ROUND_OPEN_EVENT:
                opened = data_.get("round")
            elif event == ROUND_VOID_EVENT and data_.get("round") == opened:
                opened = None  # released nothing (no usable reply, or discarded by the budget)
            elif event == NOT_APPLIED_EVENT:
                try:
                    marked = not_applied_rounds([entry])
                except ValueError as err:
                    return v.fail(lineno, str(err))
                accounted = {r.round for r in accountant.records}
                if not marked <= accounted:
                    return v.fail(lineno, f"{NOT_APPLIED_EVENT} names round(s) {sorted(marked - accounted)} "
                                          "that are not accounted before it")
                accountant = PrivacyAccountant.from_records(
                    config, [replace(r, applied=False) if r.round in marked else r for r in accountant.records])
            ended = event == END_EVENT
            v.ended = event in CLOSING_EVENTS
            continue
        if kind != "round":
            return v.fail(lineno, f"unknown line kind {kind!r}")
        try:
            record = RoundRecord.from_dict(entry.get("record"))
        except (ValueError, TypeError) as err:
            return v.fail(lineno, f"round record: {err}")
        if entry.get("round") != record.round:
            return v.fail(lineno, f"round {entry.get('round')!r} but its record is for round {record.round}")
        if v.chained and opened != record.round:
            return v.fail(lineno, f"round {record.round} has no round-open line before it (rounds are opened "
                                  "before they are broadcast; this one was not written by the server)")
        try:
            recomputed = accountant.step(record).to_dict()
        except (ValueError, TypeError) as err:
            return v.fail(lineno, f"round {record.round} cannot be accounted after round "
                                  f"{accountant.num_releases}: {err}")
        if "applied" not in (entry.get("record") or {}) and not _aggregated(entry):
            v.notes.append(f"round {record.round} was not aggregated but its record predates the 'applied' "
                           "field: it was counted in the final-model bound (the old rule, which can "
                           "understate that bound; composition and local DP are unaffected)")
        diff = _report_difference(entry.get("report"), recomputed)
        if diff is not None:
            return v.fail(lineno, f"round {record.round}: {diff}")
        published = sorted(_CONTRIBUTOR_STATS & set(entry.get("metrics") or {}))
        if config.sample_secrecy == "secret" and published and not any("members.jsonl" in n for n in v.notes):
            v.notes.append(f"round {record.round}'s metrics publish the contributors' statistics {published} (a secret "
                           "ledger written before they went to members.jsonl; with share-metrics their averaged "
                           "training metrics too): a reader who knows the clients' data may learn who took part, "
                           "and the sampled_secret epsilon does not hold against them")
        v.rounds_verified += 1
        v.ended = False
        opened = None
    v.open_round = opened if isinstance(opened, int) and not isinstance(opened, bool) else None
    complete = [r for r, e in zip(raw_lines, parsed) if e is not None]
    v.head = line_hash(complete[-1]) if v.chained and complete else None
    return v

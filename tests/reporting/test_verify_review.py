"""``verify`` against a forger who knows the format (review R2): the hash chain has no key, so what protects a ledger
from being cut is the head the run published. Before: a ledger rewritten as schema 1 (no chain) skipped every
published head and passed with its last rounds cut; a cut ledger closed by a hand-written end event passed without a
word on completeness; a report whose screening charge on delta did not follow from its records passed; a ledger
ending with a broadcast, never-recorded curious-server round passed without saying the run may have spent more."""

from __future__ import annotations

import json
from pathlib import Path

from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.records import AccountantConfig, RoundRecord
from fl_dp_flower.reporting import PrivacyLedger
from fl_dp_flower.reporting.ledger import line_hash
from fl_dp_flower.reporting.verify import verify_ledger

CONFIG = AccountantConfig(clients=3, colluders=1, lr=0.1, local_steps=1, sigma=1.0)


def _record(round_: int, screening_drop: float = 0.0) -> RoundRecord:
    return RoundRecord(round=round_, algorithm="fedavg", step_sizes=(0.1,), clip_norm=1.0, sigma=1.0,
                       weights=(1 / 3,) * 3, node_ids=(1, 2, 3), screening_drop=screening_drop)


def _ledger(path: Path, config: AccountantConfig = CONFIG, rounds: int = 3, *, screening_drop: float = 0.0,
            open_last: bool = False, end: bool = True) -> list[bytes]:
    """A ledger as the server writes it: ``rounds`` rounds (each after its round-open event), then (``open_last``)
    one more round opened and never recorded, then (``end``) the end event; its lines."""
    ledger = PrivacyLedger.create(path, accountant_config=config.to_dict(), app_config={})
    accountant = PrivacyAccountant(config)
    for t in range(1, rounds + 1):
        ledger.append_event("round-open", {"round": t, "node_ids": [1, 2, 3], "min_replies": 1})
        record = _record(t, screening_drop)
        ledger.append_round(round=t, record=record.to_dict(), report=accountant.step(record).to_dict(), metrics={})
    if open_last:
        ledger.append_event("round-open", {"round": rounds + 1, "node_ids": [1, 2, 3], "min_replies": 1})
    if end:
        ledger.append_event("end", {"rounds_accounted": rounds})
    ledger.close()
    return path.read_bytes().split(b"\n")[:-1]


def _edit(line: bytes, change) -> bytes:
    entry = json.loads(line)
    change(entry)
    return json.dumps(entry, separators=(",", ":")).encode()


def _rechain(lines: list[bytes]) -> list[bytes]:
    out = [lines[0]]
    for raw in lines[1:]:
        out.append(_edit(raw, lambda e: e.__setitem__("prev", line_hash(out[-1]))))
    return out


def _write(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _cut_last_round(lines: list[bytes]) -> list[bytes]:
    """Without the last round-open and everything after it, closed again by a copy of the end event."""
    last_open = max(i for i, raw in enumerate(lines) if b'"event":"round-open"' in raw)
    return [*lines[:last_open], lines[-1]]


def test_a_ledger_downgraded_to_schema_1_does_not_skip_the_published_head(tmp_path):
    lines = _ledger(tmp_path / "full.jsonl")
    head = line_hash(lines[-1])
    assert verify_ledger(tmp_path / "full.jsonl", expected_heads={"summary.json": head}).ok
    unchained = [_edit(raw, lambda e: (e.pop("prev", None), e.__setitem__("schema", 1))) for raw in _cut_last_round(lines)]
    path = _write(tmp_path / "ledger.jsonl", unchained)
    result = verify_ledger(path, expected_heads={"summary.json": head})
    assert not result.ok and result.rounds_verified == 2, result  # before: ok, 2 of the run's 3 rounds certified
    assert "has no hash chain" in result.failure
    assert verify_ledger(path).ok  # a schema-1 ledger alone is still read (with its note), as before


def test_a_cut_ledger_closed_by_a_forged_end_event_says_its_completeness_is_unproven(tmp_path):
    lines = _ledger(tmp_path / "full.jsonl")
    path = _write(tmp_path / "ledger.jsonl", _rechain(_cut_last_round(lines)))
    result = verify_ledger(path)
    assert result.ok and result.rounds_verified == 2  # the chain cannot show the cut ...
    assert any("no published head was checked" in n for n in result.notes), result.notes  # ... and verify says so
    caught = verify_ledger(path, expected_heads={"summary.json": line_hash(lines[-1])})
    assert not caught.ok and "is the hash of no line" in caught.failure
    full = verify_ledger(tmp_path / "full.jsonl", expected_heads={"summary.json": line_hash(lines[-1])})
    assert full.ok and not any("no published head" in n for n in full.notes)


def test_a_screening_charge_that_does_not_follow_from_the_records_fails(tmp_path):
    lines = _ledger(tmp_path / "full.jsonl", screening_drop=1e-6)
    i = max(i for i, raw in enumerate(lines) if raw.startswith(b'{"kind":"round"'))
    recorded = json.loads(lines[i])["report"]["screening"]
    assert recorded["delta_total"] > CONFIG.delta
    lines[i] = _edit(lines[i], lambda e: e["report"]["screening"].__setitem__("delta_total", CONFIG.delta))
    result = verify_ledger(_write(tmp_path / "ledger.jsonl", _rechain(lines)))
    assert not result.ok and result.failure_line == i + 1, result  # before: ok
    assert "screening delta_total" in result.failure
    lines[i] = _edit(lines[i], lambda e: e["report"].pop("screening"))  # the charge left out altogether
    result = verify_ledger(_write(tmp_path / "ledger.jsonl", _rechain(lines)))
    assert not result.ok and "screening" in result.failure


def test_an_open_curious_server_round_at_the_end_is_named(tmp_path):
    curious = AccountantConfig(clients=3, colluders=1, lr=0.1, local_steps=1, sigma=1.0, threat_model="curious-server")
    _ledger(tmp_path / "ledger.jsonl", curious, 2, open_last=True, end=False)
    result = verify_ledger(tmp_path / "ledger.jsonl", live=True)
    assert result.ok and result.open_round == 3
    [note] = [n for n in result.notes if "round 3 was broadcast" in n]  # before: no word of it
    assert "may have spent more than certified" in note and "resume-unfinished-round = 'account'" in note
    _ledger(tmp_path / "all.jsonl", CONFIG, 2, open_last=True, end=False)
    [note] = [n for n in verify_ledger(tmp_path / "all.jsonl", live=True).notes if "was broadcast" in n]
    assert "released nothing" in note
    _ledger(tmp_path / "closed.jsonl", curious)
    assert verify_ledger(tmp_path / "closed.jsonl").open_round is None


def test_a_voided_round_is_not_open(tmp_path):
    path = tmp_path / "ledger.jsonl"
    ledger = PrivacyLedger.create(path, accountant_config=CONFIG.to_dict(), app_config={})
    accountant = PrivacyAccountant(CONFIG)
    ledger.append_event("round-open", {"round": 1, "node_ids": [1, 2, 3], "min_replies": 1})
    ledger.append_event("round-void", {"round": 1, "reason": "no usable reply"})
    ledger.append_event("round-open", {"round": 1, "node_ids": [1, 2, 3], "min_replies": 1})
    ledger.append_round(round=1, record=_record(1).to_dict(), report=accountant.step(_record(1)).to_dict(), metrics={})
    ledger.append_event("round-open", {"round": 2, "node_ids": [1, 2, 3], "min_replies": 1})
    ledger.append_event("round-void", {"round": 2, "reason": "no usable reply"})
    ledger.append_event("end", {"rounds_accounted": 1})
    ledger.close()
    result = verify_ledger(path)
    assert result.ok and result.open_round is None and not any("was broadcast" in n for n in result.notes)

"""``fl-dp-flower verify`` on a real run's ledger (the real ServerApp on the in-process grid):
unmodified it passes; every kind of tampering fails at the right line, with a non-zero exit."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fl_dp_flower.reporting.ledger import line_hash
from fl_dp_flower.reporting.verify import verify_ledger
from fl_dp_flower.app.testing import run_local, tiny_config

VERIFY = [sys.executable, "-m", "fl_dp_flower.app.cli", "verify"]


@pytest.fixture(scope="module")
def real_ledger(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("verify")
    cfg = tiny_config(out, **{"num-server-rounds": 3, "schedule": "stage", "threat-model": "final-model",
                              "assume-smooth-losses": True, "colluding-clients": 0})
    outcome, _ = run_local(cfg)
    return outcome.run_dir / "ledger.jsonl"


def _lines(path: Path) -> list[bytes]:
    return path.read_bytes().split(b"\n")[:-1]


def _write(tmp_path: Path, lines: list[bytes]) -> Path:
    path = tmp_path / "ledger.jsonl"
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def _edit(line: bytes, change) -> bytes:
    entry = json.loads(line)
    change(entry)
    return json.dumps(entry, separators=(",", ":")).encode()


def _round_index(lines: list[bytes], n: int) -> int:
    return [i for i, raw in enumerate(lines) if raw.startswith(b'{"kind":"round"')][n]


def test_unmodified_ledger_passes_and_its_head_is_the_summarys(real_ledger):
    result = verify_ledger(real_ledger)
    assert result.ok and result.chained and result.rounds_verified == 3, result
    summary = json.loads((real_ledger.parent / "summary.json").read_text())
    assert result.head == summary["ledger_head"] == line_hash(_lines(real_ledger)[-1])
    r = subprocess.run([*VERIFY, str(real_ledger.parent)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "OK" in r.stdout and "3 rounds recomputed" in r.stdout


@pytest.mark.parametrize("what", ["certified epsilon", "client list", "sigma"])
def test_an_edited_value_fails_at_its_line(real_ledger, tmp_path, what):
    lines = _lines(real_ledger)
    i = _round_index(lines, 1)
    change = {
        "certified epsilon": lambda e: e["report"]["certified"].__setitem__("epsilon", e["report"]["certified"]["epsilon"] * 0.5),
        "client list": lambda e: e["record"].__setitem__("node_ids", [9, 8, 7]),
        "sigma": lambda e: e["record"].__setitem__("sigma", e["record"]["sigma"] * 2),
    }[what]
    lines[i] = _edit(lines[i], change)
    path = _write(tmp_path, lines)
    result = verify_ledger(path)
    assert not result.ok
    if what == "client list":  # no number depends on it: the next line's prev catches it
        assert result.failure_line == i + 2 and "hash chain broken" in result.failure
    else:  # the recomputation catches it at its own line, before the chain does
        assert result.failure_line == i + 1 and "recomputed" in result.failure
        # and a forger who rewrites the chain consistently is still caught by the recomputation
        rechained = _rechain(lines)
        again = verify_ledger(_write(tmp_path, rechained))
        assert not again.ok and again.failure_line == i + 1, again
        assert ("certified epsilon" in again.failure) or ("recomputed" in again.failure)
        assert again.head is None or again.head != verify_ledger(real_ledger).head
    r = subprocess.run([*VERIFY, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "FAILED at line" in r.stdout


def _rechain(lines: list[bytes]) -> list[bytes]:
    """What a forger who knows the format does: recompute every prev from line 1 on."""
    out = [lines[0]]
    for raw in lines[1:]:
        out.append(_edit(raw, lambda e: e.__setitem__("prev", line_hash(out[-1]))))
    return out


def test_a_deleted_line_fails(real_ledger, tmp_path):
    lines = _lines(real_ledger)
    i = _round_index(lines, 1)
    del lines[i]
    result = verify_ledger(_write(tmp_path, lines))
    assert not result.ok and result.failure_line == i + 1 and "hash chain broken" in result.failure


def test_a_round_appended_by_hand_fails(real_ledger, tmp_path):
    lines = _lines(real_ledger)
    last_round = json.loads(lines[_round_index(lines, -1)])
    forged = dict(last_round, round=4, prev=line_hash(lines[-1]))
    forged["record"] = dict(forged["record"], round=4)
    lines.append(json.dumps(forged, separators=(",", ":")).encode())
    result = verify_ledger(_write(tmp_path, lines))
    assert not result.ok and result.failure_line == len(lines)
    assert "after the run's end event" in result.failure


def test_a_schema_1_ledger_is_read_and_its_numbers_checked(real_ledger, tmp_path):
    """Ledgers written before the chain: still verified by recomputation, with a note on what they lack."""
    lines = [_edit(raw, lambda e: (e.pop("prev", None), e.__setitem__("schema", 1))) for raw in _lines(real_ledger)]
    result = verify_ledger(_write(tmp_path, lines))
    assert result.ok and not result.chained and result.rounds_verified == 3
    assert any("schema 1" in note for note in result.notes)
    i = _round_index(lines, 2)
    lines[i] = _edit(lines[i], lambda e: e["report"]["bounds"]["composition"].__setitem__("mu", 1e-3))
    bad = verify_ledger(_write(tmp_path, lines))
    assert not bad.ok and bad.failure_line == i + 1 and "composition mu" in bad.failure


def test_a_torn_last_line_is_noted_not_failed(real_ledger, tmp_path):
    data = real_ledger.read_bytes() + b'{"kind":"event","schema":2,"event":"ro'
    path = tmp_path / "ledger.jsonl"
    path.write_bytes(data)
    result = verify_ledger(path)
    assert result.ok and any("torn last line" in n for n in result.notes)


def _cut_tail(real_ledger: Path, tmp_path: Path, *, with_summary: bool) -> tuple[Path, list[bytes]]:
    """The ledger without its last round and everything after it (its round-open, round line, end),
    in a run folder of its own, with the run's summary.json beside it or not."""
    lines = _lines(real_ledger)
    last_open = max(i for i, raw in enumerate(lines) if b'"event":"round-open"' in raw)
    kept = lines[:last_open]
    run_dir = tmp_path / "cut"
    run_dir.mkdir()
    path = _write(run_dir, kept)
    if with_summary:
        shutil.copy(real_ledger.parent / "summary.json", run_dir / "summary.json")
    return path, kept


def test_a_cut_tail_fails_against_the_published_head(real_ledger, tmp_path):
    """The chain of a ledger cut after round 2 of 3 is intact; the run's published head is not in it."""
    path, kept = _cut_tail(real_ledger, tmp_path, with_summary=True)
    published = json.loads((real_ledger.parent / "summary.json").read_text())["ledger_head"]
    result = verify_ledger(path, expected_heads={"summary.json": published})
    assert not result.ok and result.rounds_verified == 2
    assert "is the hash of no line of this ledger: lines were cut from its end" in result.failure
    r = subprocess.run([*VERIFY, str(path.parent)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1, r.stdout
    assert "FAILED" in r.stdout and "lines were cut from its end" in r.stdout and published in r.stdout
    # the same head given by hand, and the full ledger reaching it (at its last line)
    r = subprocess.run([*VERIFY, str(real_ledger), "--expected-head", published], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and f"--expected-head #1: line {len(_lines(real_ledger))})" in r.stdout, r.stdout


def test_a_cut_tail_without_a_published_head_fails_unless_the_run_is_live(real_ledger, tmp_path):
    path, kept = _cut_tail(real_ledger, tmp_path, with_summary=False)
    result = verify_ledger(path)
    assert not result.ok and not result.ended and result.rounds_verified == 2
    assert result.failure_line == len(kept) and "does not end with the run's end event" in result.failure
    r = subprocess.run([*VERIFY, str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "--expected-head" in r.stdout and "--live" in r.stdout, r.stdout
    live = subprocess.run([*VERIFY, str(path), "--live"], capture_output=True, text=True, timeout=120)
    assert live.returncode == 0 and "no end event: the run is live" in live.stdout, live.stdout
    # a head published mid-run (Prometheus after round 1) is reached; the lines after it are not protected
    mid = line_hash(kept[_round_index(kept, 0)])
    result = verify_ledger(path, expected_heads={"prometheus": mid})
    assert not result.ok and "lines follow the published head" in " ".join(result.notes)
    assert verify_ledger(path, expected_heads={"prometheus": mid}, live=True).ok
    # a mid-run head that happens to be the last line proves nothing about what followed it
    assert not verify_ledger(path, expected_heads={"prometheus": line_hash(kept[-1])}).ok


def test_missing_ledger_exits_2(tmp_path):
    r = subprocess.run([*VERIFY, str(tmp_path / "nope.jsonl")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no ledger at" in r.stderr


# ------------------------------------------------------------------ watch, against a real run in tmux
@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(shutil.which("tmux") is None, reason="tmux not installed")
def test_watch_follows_a_real_run_in_tmux_and_exits_on_ctrl_c(tmp_path):
    from deploy_harness import wait_until

    session = f"fldp-watch-{os.getpid()}-{tmp_path.name}"[:60]  # unique per test process (parallel runs)
    run_dir = tmp_path / "run"
    exe = Path(sys.executable).parent / "fl-dp-flower"
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "130", "-y", "100",
                    f"{exe} watch {run_dir} --interval 0.2; echo WATCH-EXIT=$?; sleep 120"], check=True)

    def screen() -> str:
        return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout

    try:
        wait_until(lambda: "waiting for a ledger" in screen(), 60, "the watch to start")
        script = ("from pathlib import Path; "
                  "from fl_dp_flower.app.testing import run_local, tiny_config; "
                  f"run_local(tiny_config(Path({str(tmp_path)!r}), **{{'num-server-rounds': 8, 'target-epsilon': 1000.0, 'noise-check-alpha': 0.0, 'update-bound-alpha': 0.0}}))")
        run = subprocess.Popen([sys.executable, "-c", script], cwd=Path(__file__).resolve().parents[2],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        seen: set[str] = set()

        def follows() -> bool:
            text = screen()
            seen.update(line for line in text.splitlines() if line.startswith("rounds"))
            return re.search(r"^rounds +8 / 8 planned", text, re.M) is not None and "run ended (8 rounds accounted)" in text

        wait_until(follows, 300, "the watch to show the finished run", interval=0.3, progress=screen)
        assert run.wait(60) == 0
        text = screen()
        assert len(seen) >= 2  # it showed the run while it grew, not only at the end
        assert "% of epsilon 1000" in text and "paper bound" in text and "certified" in text
        subprocess.run(["tmux", "send-keys", "-t", session, "C-c"], check=True)
        wait_until(lambda: "WATCH-EXIT=0" in screen(), 30, "the watch to exit on Ctrl-C")
        assert "stopped watching" in screen() and "Traceback" not in screen()
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)


def _legacy(lines: list[bytes]) -> list[bytes]:
    """The ledger as the code before 'colluders' and 'applied' wrote it: header without colluders
    (certified against an outside observer, c = 0), records without 'applied', reports without the
    new fields and computed with c = 0 (by an accountant built here, not read from the ledger)."""
    from fl_dp_flower.privacy import AccountantConfig, PrivacyAccountant, RoundRecord

    header = json.loads(lines[0])
    cfg = AccountantConfig(**{**header["accountant_config"], "colluders": 0, "assume_smooth_losses": True})
    del header["accountant_config"]["colluders"]
    header["accountant_config"].pop("assume_smooth_losses", None)  # predates it too (issue 16 item 4)
    accountant = PrivacyAccountant(cfg)
    out = [json.dumps(header, separators=(",", ":")).encode()]
    for raw in lines[1:]:
        entry = json.loads(raw)
        if entry["kind"] == "round":
            del entry["record"]["applied"]
            report = accountant.step(RoundRecord.from_dict(entry["record"])).to_dict()
            del report["rounds_applied"], report["colluders"], report["relation"], report["add_remove"]
            entry["report"] = report
        out.append(json.dumps(entry, separators=(",", ":")).encode())
    return _rechain(out)


def test_a_ledger_written_before_colluders_is_recomputed_as_written(real_ledger, tmp_path):
    """Issue 16 item 3: old ledgers were certified with c = 0; verify recomputes them that way
    and says so; resuming one under c >= 1 is refused (never a silent switch of rules)."""
    from fl_dp_flower.privacy import AccountantConfig
    from fl_dp_flower.reporting.ledger import PrivacyLedger

    legacy = _write(tmp_path, _legacy(_lines(real_ledger)))
    result = verify_ledger(legacy)
    assert result.ok and result.rounds_verified == 3, result.failure
    assert any("predates 'colluders'" in note and "c = 0" in note for note in result.notes)
    header = json.loads(_lines(real_ledger)[0])["accountant_config"]  # final-model, so c = 0 already
    today = AccountantConfig(**{**header, "threat_model": "all-rounds", "colluders": 1}).to_dict()
    with pytest.raises(ValueError, match=r"colluders.*colluding-clients = 0"):
        PrivacyLedger.check_resumable(legacy, accountant_config=today)
    as_written = AccountantConfig(**{**header, "colluders": 0}).to_dict()
    assert PrivacyLedger.check_resumable(legacy, accountant_config=as_written).last_round == 3
    # the same ledger with today's header (c = 1) does not match its numbers
    lines = _lines(legacy)
    lines[0] = _edit(lines[0], lambda e: e["accountant_config"].__setitem__("colluders", 1))
    assert not verify_ledger(_write(tmp_path, _rechain(lines))).ok


def test_a_ledger_written_before_assume_smooth_losses_is_recomputed_as_written(real_ledger, tmp_path):
    """Issue 16 items 2, 4: old ledgers certified L-dependent bounds (here the final-model bound)
    without an assertion; verify recomputes them under that rule and says so, and resuming one
    without the assertion is refused naming the key."""
    from fl_dp_flower.reporting.ledger import PrivacyLedger

    legacy = _write(tmp_path, _legacy(_lines(real_ledger)))
    result = verify_ledger(legacy)
    assert result.ok, result.failure
    assert any("predates 'assume_smooth_losses'" in note for note in result.notes)
    header = {**json.loads(_lines(real_ledger)[0])["accountant_config"], "colluders": 0}
    with pytest.raises(ValueError, match=r"assume_smooth_losses.*assume-smooth-losses = true"):
        PrivacyLedger.check_resumable(legacy, accountant_config={**header, "assume_smooth_losses": False})
    assert PrivacyLedger.check_resumable(legacy, accountant_config=header).last_round == 3


def test_a_not_applied_mark_must_name_accounted_rounds(real_ledger, tmp_path):
    lines = _lines(real_ledger)
    i = _round_index(lines, 1)
    event = {"kind": "event", "schema": 2, "event": "rounds-not-applied", "data": {"rounds": [3]},
             "time": "2026-01-01T00:00:00.000+00:00", "prev": None}
    lines.insert(i + 1, json.dumps(event, separators=(",", ":")).encode())
    result = verify_ledger(_write(tmp_path, _rechain(lines)))
    assert not result.ok and result.failure_line == i + 2 and "not accounted before it" in result.failure

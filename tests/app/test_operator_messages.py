"""Failures an operator must be able to act on from the ServerApp log alone (issue 18 item 9),
on the real ServerApp (``run_server``) and the real ClientApp on the in-process grid:

- a full disk anywhere in the run's writes: one ERROR saying what happened, that nothing
  unaccounted was released, and how to resume; the resume then works;
- "accounted no round", "all rounds already accounted", an existing ledger: logged at ERROR
  (``flwr log`` showed only "Exit Code: 201");
- nodes excluded for refusing stay excluded when the run is resumed;
- a full disk while the ledger is created leaves no ledger (issue 28.8), and an empty ledger an older
  version left is replaced by a fresh run or a resume.
"""

from __future__ import annotations

import errno
import json
import logging
import os

import pytest

from fl_dp_flower.app.config import ConfigError

from fl_dp_flower.app import serverapp as server_module
from fl_dp_flower.app.serverapp import LEDGER, SUMMARY, RunFailed
from fl_dp_flower.reporting import PrivacyLedger, read_ledger
from fl_dp_flower.reporting.verify import verify_ledger
from fl_dp_flower.testing import TINY_NODES
from fl_dp_flower.app.testing import run_local, tiny_config

SERVER_LOGGER = "flwr.fl_dp_flower"


def _errors(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records
            if r.levelno >= logging.ERROR and r.name.startswith(SERVER_LOGGER)]


def _disk_full_at_round_line(monkeypatch, round_: int) -> None:
    real_write = PrivacyLedger._write_locked

    def write(self, line: bytes) -> None:
        if line.startswith(b'{"kind":"round"') and f'"round":{round_},'.encode() in line:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, line)

    monkeypatch.setattr(PrivacyLedger, "_write_locked", write)


def _disk_full_at_checkpoint(monkeypatch, round_: int) -> None:
    """As torch.save reports it: a RuntimeError whose context is the OSError of the write."""
    from fl_dp_flower.checkpoint import ModelCheckpoint

    real_save = ModelCheckpoint.save

    def save(self, saved_round, arrays):
        if self.path.name == server_module.CHECKPOINT and saved_round == round_:
            try:
                raise OSError(errno.ENOSPC, "No space left on device", str(self.path))
            except OSError:
                raise RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 512 vs 0") from None
        real_save(self, saved_round, arrays)

    monkeypatch.setattr(ModelCheckpoint, "save", save)


@pytest.mark.parametrize("where", ["ledger", "checkpoint"])
def test_a_full_disk_says_what_happened_and_how_to_resume(tmp_path, monkeypatch, caplog, where):
    caplog.set_level(logging.INFO)
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 3})
    with monkeypatch.context() as m:
        (_disk_full_at_round_line if where == "ledger" else _disk_full_at_checkpoint)(m, 2)
        with pytest.raises(RunFailed) as info:
            run_local(cfg)
    message = str(info.value)
    assert message.startswith("disk full (ENOSPC: No space left on device)")
    assert "Nothing unaccounted was released" in message and "resume=true" in message
    assert str(tmp_path / "run") in message
    assert _errors(caplog).count(message) == 1, _errors(caplog)
    ledger = tmp_path / "run" / LEDGER
    assert read_ledger(ledger).last_round == (1 if where == "ledger" else 2)
    # the resume the message names works (round 2 was broadcast: its line is missing when the ledger
    # write failed, so the resume must account it)
    caplog.clear()
    resume = {"resume": True, "num-server-rounds": 3}
    if where == "ledger":
        resume["resume-unfinished-round"] = "account"
    outcome, _ = run_local(tiny_config(tmp_path, **resume))
    assert outcome.accountant.num_releases == 3
    assert verify_ledger(ledger).ok


def _disk_full_at_ledger_creation(monkeypatch) -> None:
    """ENOSPC at the ledger's first write, whichever call makes it: the line writer (the header, written in
    place before issue 28.8) or an ``os.write`` to a file named after the ledger (its temp file since)."""
    real_write_locked, real_os_write = PrivacyLedger._write_locked, os.write

    def write_locked(self, line: bytes) -> None:
        if line.startswith(b'{"kind":"header"'):
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write_locked(self, line)

    def os_write(fd, data):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = ""
        if LEDGER in os.path.basename(target):
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_os_write(fd, data)

    monkeypatch.setattr(PrivacyLedger, "_write_locked", write_locked)
    monkeypatch.setattr(os, "write", os_write)


def test_a_full_disk_while_the_ledger_is_created_leaves_no_ledger(tmp_path, monkeypatch, caplog):
    """Before: a 0-byte ledger.jsonl stayed; the advised resume failed with a traceback (`is empty`), a fresh
    run said "already exists", and the message forbade deleting it."""
    caplog.set_level(logging.INFO)
    cfg = tiny_config(tmp_path)
    with monkeypatch.context() as m:
        _disk_full_at_ledger_creation(m)
        with pytest.raises(RunFailed) as info:
            run_local(cfg)
    run_dir = tmp_path / "run"
    assert not (run_dir / LEDGER).exists() and list(run_dir.glob(f".{LEDGER}.*")) == []  # no ledger, no temp file
    message = str(info.value)
    assert message.startswith("disk full (ENOSPC: No space left on device)")
    assert "before its privacy ledger" in message and "nothing was spent" in message and "resume = false" in message
    assert _errors(caplog).count(message) == 1, _errors(caplog)
    outcome, _ = run_local(cfg)  # the run the message names
    assert outcome.accountant.num_releases == 2 and verify_ledger(run_dir / LEDGER).ok


@pytest.mark.parametrize("resume", [False, True])
def test_an_empty_ledger_is_replaced_by_a_fresh_run_or_a_resume(tmp_path, caplog, resume):
    """An empty ledger (what an older version's interrupted creation left) holds no header, so no round was
    ever opened: the run replaces it, with a WARNING. Before: "already exists" / a traceback (`is empty`)."""
    caplog.set_level(logging.INFO)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / LEDGER).write_bytes(b"")
    outcome, _ = run_local(tiny_config(tmp_path, resume=resume))
    assert outcome.accountant.num_releases == 2 and verify_ledger(tmp_path / "run" / LEDGER).ok
    assert any("was empty (0 bytes" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


def test_no_round_left_to_account_is_logged(tmp_path, caplog):
    run_local(tiny_config(tmp_path))
    caplog.set_level(logging.INFO)
    with pytest.raises(RunFailed, match="all 2 rounds were already accounted"):
        run_local(tiny_config(tmp_path, resume=True))
    assert any("the run accounted no round, so nothing was trained: all 2 rounds were already accounted" in e
               for e in _errors(caplog)), _errors(caplog)


def test_an_existing_ledger_is_logged(tmp_path, caplog):
    run_local(tiny_config(tmp_path))
    caplog.set_level(logging.INFO)
    with pytest.raises(FileExistsError):
        run_local(tiny_config(tmp_path))
    assert any("already exists; a ledger is never overwritten" in e and "choose another 'run-name'" in e
               for e in _errors(caplog)), _errors(caplog)


def test_a_budget_too_small_for_any_round_is_logged(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    """Refused before anything starts (the preflight: no round fits), and said at ERROR."""
    with pytest.raises(ConfigError):
        run_local(tiny_config(tmp_path, **{"target-epsilon": 1e-3}))
    assert any("target-epsilon" in e for e in _errors(caplog)), _errors(caplog)
    assert not (tmp_path / "run").exists()


def test_excluded_nodes_stay_excluded_after_a_resume(tmp_path, caplog):
    """Node 2 refuses every round (its floor min-sigma=5 is above the run's sigma): excluded after 2
    refusals in rounds 1-2; the resume for rounds 3-4 never asks it to train."""
    refusing = {2: {"min-sigma": 5.0}}
    cfg = {"max-node-refusals": 2}
    first, grid = run_local(tiny_config(tmp_path, **cfg), node_config=refusing)
    assert list(first.strategy.excluded_nodes) == [2]
    caplog.set_level(logging.INFO)
    out, grid = run_local(tiny_config(tmp_path, **cfg, **{"num-server-rounds": 4, "resume": True}),
                          node_config=refusing)
    asked = sorted({m.metadata.dst_node_id for m in grid.sent})
    assert asked == [n for n in range(1, TINY_NODES + 1) if n != 2], asked
    assert [sorted(r.node_ids) for r in out.accountant.records[2:]] == [asked] * 2
    assert any("nodes excluded earlier in this run stay excluded" in e and "node 2 (" in e for e in _errors(caplog))
    summary = json.loads((tmp_path / "run" / SUMMARY).read_text())
    assert list(summary["excluded_nodes"]) == ["2"] and "min-sigma" in summary["excluded_nodes"]["2"]

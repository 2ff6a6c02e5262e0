"""Issue 28 item 1: an unfinished secure-aggregation round is charged at the contributor floor in force
when it was broadcast (recorded in its ``round-open`` event), never at the resumed run's ``min-replies``.

The issue's reproduction, through the ServerApp's own ledger-opening code: the main job's settings with
one client per SuperNode (m 4,000, sigma 0.55, 60 rounds, c 0), round 60 opened under min-replies 4 and
left open by a crash after unmasking, resumed under min-replies 4,000. Before the fix the open round was
charged as a sum of 4,000 (epsilon 0.437 for that round; 4.147 for the run) where SecAggGrid could have
unmasked a sum of 4 (23.37; 24.16 for the run)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fl_dp_flower.app.serverapp import LEDGER, _open_ledger
from fl_dp_flower.app.config import AppConfig
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.reporting import PrivacyLedger, read_ledger
from fl_dp_flower.app.testing import run_local, tiny_config

MAIN = {"threat-model": "secure-aggregation", "clients-per-round": 4000, "num-partitions": 4000, "sigma": 0.55,
        "num-server-rounds": 60, "colluding-clients": 0, "local-steps": 1, "batch-size": 1, "lr": 2.0,
        "clip-norm": 1.0, "run-name": "run"}


def _config(tmp_path: Path, **overrides) -> AppConfig:
    return AppConfig.from_run_config({**MAIN, "output-dir": str(tmp_path), **overrides})


def _open_round_left_by_a_crash(tmp_path: Path, open_data: dict, *, accounted: int = 0) -> AppConfig:
    """A ledger of ``accounted`` planned rounds, then the ``round-open`` of the next one (no round line)."""
    opened = _config(tmp_path, **{"min-replies": 4})
    cfg = opened.accountant_config()
    ledger = PrivacyLedger.create(tmp_path / "run" / LEDGER, accountant_config=cfg.to_dict(),
                                  app_config=opened.to_run_config())
    acct = PrivacyAccountant(cfg)
    for t in range(1, accounted + 1):
        record = cfg.planned_round(t)
        report = acct.step(record)
        ledger.append_event("round-open", {"round": t, "node_ids": list(range(1, 4001)), "min_replies": 4})
        ledger.append_round(round=t, record=record.to_dict(), report=report.to_dict(), metrics={})
    ledger.append_event("round-open", {"round": accounted + 1, "node_ids": list(range(1, 4001)), **open_data})
    ledger.close()
    return _config(tmp_path, **{"min-replies": 4000, "resume": True, "resume-unfinished-round": "account"})


def test_open_round_is_charged_at_the_floor_recorded_at_round_open_not_the_resumed_min_replies(tmp_path):
    resumed = _open_round_left_by_a_crash(tmp_path, {"min_replies": 4})
    ledger, accountant, _ = _open_ledger(resumed, tmp_path / "run")
    ledger.close()
    assert [r.clients for r in accountant.records] == [4]
    assert accountant.report().certified.epsilon == pytest.approx(23.37, abs=5e-3)  # before the fix: 0.437
    event = next(e for e in read_ledger(tmp_path / "run" / LEDGER).events
                 if e["event"] == "unfinished-round-accounted")
    assert event["data"]["contributors"] == 4


def test_the_issue_s_sixty_round_run_certifies_24_16_not_4_147(tmp_path):
    resumed = _open_round_left_by_a_crash(tmp_path, {"min_replies": 4}, accounted=59)
    ledger, accountant, _ = _open_ledger(resumed, tmp_path / "run")
    ledger.close()
    assert [r.clients for r in accountant.records] == [4000] * 59 + [4]
    assert accountant.report().certified.epsilon == pytest.approx(24.16, abs=5e-3)  # before the fix: 4.147


def test_a_round_open_without_a_recorded_floor_is_charged_at_the_smallest_floor_ever_allowed(tmp_path, caplog):
    """A ledger written before the floor was recorded: min-replies - colluding-clients >= 4 has held under
    secure aggregation since its run path existed, so c + 4 contributors is what any such round could sum."""
    resumed = _open_round_left_by_a_crash(tmp_path, {})
    ledger, accountant, _ = _open_ledger(resumed, tmp_path / "run")
    ledger.close()
    assert [r.clients for r in accountant.records] == [4]
    assert "records no contributor floor" in caplog.text


def test_the_server_records_min_replies_and_the_screening_levels_in_every_round_open_event(tmp_path):
    run_local(tiny_config(tmp_path, **{"min-replies": 2, "noise-check-alpha": 1e-7}))
    opened = [e["data"] for e in read_ledger(tmp_path / "run" / LEDGER).events if e["event"] == "round-open"]
    assert [d["min_replies"] for d in opened] == [2, 2]
    assert [d["screening_drop"] for d in opened] == [1e-7 + 1e-12] * 2


def test_an_open_all_rounds_round_is_charged_its_recorded_screening_levels(tmp_path):
    """Its replies may have been screened (and a drop logged) before the crash: the charge of docs/MATH.md §17.1
    at the levels recorded at round-open, not the resumed run's."""
    cfg = {"threat-model": "all-rounds", "clients-per-round": 10, "num-partitions": 10}
    opened = _config(tmp_path, **cfg)
    ledger = PrivacyLedger.create(tmp_path / "run" / LEDGER, accountant_config=opened.accountant_config().to_dict(),
                                  app_config=opened.to_run_config())
    ledger.append_event("round-open", {"round": 1, "node_ids": list(range(1, 11)), "min_replies": 1,
                                       "screening_drop": 2e-6})
    ledger.close()
    resumed = _config(tmp_path, **cfg, **{"resume": True, "resume-unfinished-round": "account"})
    ledger, accountant, _ = _open_ledger(resumed, tmp_path / "run")
    ledger.close()
    assert accountant.records[0].screening_drop == 2e-6 and accountant.report().screening["drop_probability"] == 2e-6


def test_an_open_round_that_predates_the_recorded_levels_is_charged_the_levels_the_run_started_with(tmp_path):
    """Review V1: such a round was charged the resumed run's levels, which may now be 0 (update-bound-alpha 0 turns
    the check off): the larger of the header's (the run as started) and the resumed run's is charged."""
    cfg = {"threat-model": "all-rounds", "clients-per-round": 10, "num-partitions": 10}
    opened = _config(tmp_path, **cfg, **{"noise-check-alpha": 3e-7, "update-bound-alpha": 1e-7})
    ledger = PrivacyLedger.create(tmp_path / "run" / LEDGER, accountant_config=opened.accountant_config().to_dict(),
                                  app_config=opened.to_run_config())
    ledger.append_event("round-open", {"round": 1, "node_ids": list(range(1, 11)), "min_replies": 1})  # no levels
    ledger.close()
    resumed = _config(tmp_path, **cfg, **{"resume": True, "resume-unfinished-round": "account",
                                          "noise-check-alpha": 0.0, "update-bound-alpha": 0.0})
    ledger, accountant, _ = _open_ledger(resumed, tmp_path / "run")
    ledger.close()
    assert accountant.records[0].screening_drop == pytest.approx(4e-7)

"""Issue 28 item 2 end to end: every round the real ServerApp screens records the checks' drop probability
(noise-check-alpha + update-bound-alpha), the ledger's report and summary.json carry the delta it costs, and
verify reproduces it from the ledger (docs/MATH.md §17.1)."""

from __future__ import annotations

import json
import math

import pytest

from fl_dp_flower.app.serverapp import LEDGER, SUMMARY
from fl_dp_flower.reporting import read_ledger
from fl_dp_flower.reporting.verify import verify_ledger
from fl_dp_flower.app.testing import run_local, tiny_config


@pytest.mark.parametrize("overrides, drop", [({}, 2e-12), ({"noise-check-alpha": 0.0, "update-bound-alpha": 1e-6}, 1e-6)])
def test_screened_rounds_charge_their_drop_probability_to_delta(tmp_path, overrides, drop):
    out, _ = run_local(tiny_config(tmp_path, **overrides))
    assert [r.screening_drop for r in out.accountant.records] == [drop, drop]
    report = read_ledger(tmp_path / "run" / LEDGER).rounds[-1]["report"]
    eps = report["certified"]["epsilon"]
    assert report["screening"]["delta_total"] == pytest.approx(1e-5 + (1 + math.exp(eps)) * 2 * drop, rel=1e-12)
    summary = json.loads((tmp_path / "run" / SUMMARY).read_text())
    assert summary["final_report"]["screening"] == report["screening"]
    assert verify_ledger(tmp_path / "run" / LEDGER).ok


def test_a_void_round_s_screening_is_charged_with_the_next_record(tmp_path):
    """Round 1 gets no usable reply (a screening drop could be why, and the void is visible): its drop probability
    is carried to the next accounted record, which then holds two rounds' worth."""
    from fl_dp_flower.app.clientapp import app as client_app
    from fl_dp_flower.app.serverapp import run_server
    from fl_dp_flower.testing import TINY_NODES, LocalGrid, task_identity

    config = tiny_config(tmp_path)
    grid = LocalGrid(client_app, TINY_NODES, config.to_run_config(), failing=set(range(1, TINY_NODES + 1)))
    first = grid.send_and_receive

    def then_healthy(*args, **kwargs):
        replies = first(*args, **kwargs)
        grid.failing.clear()
        return replies
    grid.send_and_receive = then_healthy
    with task_identity():
        out = run_server(grid, config)
    assert [e["event"] for e in read_ledger(tmp_path / "run" / LEDGER).events][:2] == ["round-open", "round-void"]
    assert [r.screening_drop for r in out.accountant.records] == [4e-12]

"""examples/digits in-process (issue 30): its ServerApp and ClientApp as a user copies them, on the
in-process grid: secure aggregation (refused before round 1 with too few clients), and a resume that
continues the model; every ledger verifies. (`flwr run` of the same app: tests/integration/test_examples.py.)"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from flwr.app import Context, RecordDict

from fl_dp_flower.reporting.ledger import read_ledger
from fl_dp_flower.reporting.verify import verify_ledger
from fl_dp_flower.testing import LocalGrid, task_identity

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits"
BASE = {"num-server-rounds": 2, "clients-per-round": 3, "sigma": 0.02, "clip-norm": 1.0, "local-steps": 2,
        "batch-size": 16, "lr": 0.5, "target-epsilon": 0.0, "delta": 1e-5}


@pytest.fixture()
def digits(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLE))
    for name in [m for m in sys.modules if m.startswith("digits_dp")]:
        monkeypatch.delitem(sys.modules, name)
    from digits_dp import client_app, server_app

    return server_app, client_app


def _main(digits, tmp_path, nodes: int, **run_config):
    server_app, client_app = digits
    rc = {**BASE, "output-dir": str(tmp_path / "out"), **run_config}
    grid = LocalGrid(client_app.app, nodes, rc, copy_content=True)
    with task_identity():
        server_app.main(grid, Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config=rc))
    return json.loads((tmp_path / "out" / "summary.json").read_text())


def test_secure_aggregation_example_trains_and_certifies_the_sum(digits, tmp_path):
    summary = _main(digits, tmp_path, 5, **{"clients-per-round": 5, "secure-aggregation": True})
    assert summary["rounds"] == 2 and summary["bound"] == "secure_aggregation"
    assert verify_ledger(tmp_path / "out" / "ledger.jsonl").ok


def test_secure_aggregation_with_too_few_clients_is_refused_before_round_1(digits, tmp_path):
    with pytest.raises(ValueError, match="4 clients per round and colluders = 1 can never unmask a sum"):
        _main(digits, tmp_path, 4, **{"clients-per-round": 4, "secure-aggregation": True})
    assert not (tmp_path / "out" / "ledger.jsonl").exists()  # nothing was broadcast: no ledger left (review O6)


def test_resume_example_continues_from_the_checkpoint(digits, tmp_path):
    _main(digits, tmp_path, 3)
    summary = _main(digits, tmp_path, 3, **{"num-server-rounds": 3, "resume": True})
    assert summary["rounds"] == 3
    contents = read_ledger(tmp_path / "out" / "ledger.jsonl")
    assert "rounds-not-applied" not in [e["event"] for e in contents.events]  # the model was continued
    assert verify_ledger(tmp_path / "out" / "ledger.jsonl").ok

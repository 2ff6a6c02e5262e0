"""Issue 28 items 3 and 6: what the certificate does not cover is said where it is printed.

3. With cohorts a SuperNode's operator knows its whole cohort's noise: the main job's 3.825 is against one
   virtual client; one node's operator (colluding-clients 400) gets 4.063, two nodes' 4.349 (the package's
   planner). Outside simulation a WARNING says so before round 1.
6. A fixed seed lets whoever knows it regenerate the clients' noise: under secure aggregation the server sends
   it, so the certificate against the server is void, and the certificate says so."""

from __future__ import annotations

import json
import logging

import pytest

from fl_dp_flower.app.serverapp import SUMMARY, RunFailed, run_server
from fl_dp_flower.app.threat import (coalition_epsilon, cohort_collusion_warning, fixed_seed_note, node_assumptions,
                                      simulated, start_warnings)
from fl_dp_flower.app.clientapp import app as client_app
from fl_dp_flower.app.config import AppConfig
from fl_dp_flower.app.presets import PRESETS
from fl_dp_flower.testing import LocalGrid
from fl_dp_flower.app.testing import run_local, tiny_config

MAIN = AppConfig.from_run_config(PRESETS["main"])


def test_the_main_job_against_one_node_operator():
    assert coalition_epsilon(MAIN, 1) == pytest.approx(3.825, abs=5e-4)
    assert coalition_epsilon(MAIN, 400) == pytest.approx(4.063, abs=5e-4)
    assert coalition_epsilon(MAIN, 800) == pytest.approx(4.349, abs=5e-4)
    warning = cohort_collusion_warning(MAIN)
    assert warning is not None and "3.825 planned" in warning and "colluding-clients = 400) the plan certifies 4.063" \
        in warning
    assert cohort_collusion_warning(AppConfig.from_run_config({**PRESETS["main"], "colluding-clients": 400})) is None
    assert cohort_collusion_warning(tiny_config("/tmp")) is None  # one client per node: nothing to say
    assert warning in node_assumptions(MAIN)  # printed with the certificate (summary.json, the final log line)


def test_the_warning_comes_outside_simulation_only():
    grid = LocalGrid(client_app, 2)
    assert simulated(grid) and not any("cohort mode" in w for w in start_warnings(MAIN, grid))
    grid.simulated = False  # a deployment's Grid (Flower's HttpGrid)
    assert any("cohort mode" in w for w in start_warnings(MAIN, grid))


def test_a_deployment_run_logs_it_before_anything_else(tmp_path, caplog):
    """The ServerApp logs it before it opens the ledger (here a resume without a ledger stops the run right there,
    before round 1: the warning is already out)."""
    caplog.set_level(logging.INFO)
    config = tiny_config(tmp_path, **{"clients-per-node": 2, "clients-per-round": 6, "num-partitions": 6,
                                      "resume": True})
    grid = LocalGrid(client_app, 3, config.to_run_config())
    grid.simulated = False
    with pytest.raises(RunFailed, match="no privacy ledger"):
        run_server(grid, config)
    warned = [r for r in caplog.records if r.getMessage().startswith("cohort mode: each SuperNode trains 2 virtual")]
    assert len(warned) == 1 and warned[0].levelno == logging.WARNING


def test_a_fixed_seed_voids_the_secure_aggregation_certificate_and_says_so():
    secure = {"threat-model": "secure-aggregation", "clients-per-round": 5, "min-replies": 5}
    fixed = AppConfig.from_run_config({**secure, "seed": 0})
    note = fixed_seed_note(fixed)
    assert note is not None and note.startswith("CERTIFICATE VOID against the server: fixed seed = 0")
    assert note in node_assumptions(fixed) and note in start_warnings(fixed, LocalGrid(client_app, 1))
    assert fixed_seed_note(AppConfig.from_run_config(secure)) is None  # seed -1: OS entropy
    assert "VOID" in fixed_seed_note(AppConfig.from_run_config({"threat-model": "curious-server", "seed": 3}))
    all_rounds = fixed_seed_note(AppConfig.from_run_config({"seed": 3}))
    assert "holds only against an adversary who does not know it" in all_rounds


def test_the_summary_of_a_seeded_run_carries_the_note(tmp_path):
    out, _ = run_local(tiny_config(tmp_path, **{"num-server-rounds": 1}))  # seed 0
    summary = json.loads((out.run_dir / SUMMARY).read_text())
    assert summary["node_assumptions"][-1].startswith("fixed seed = 0")


def test_a_run_whose_nodes_share_statistics_says_so_in_its_assumptions(tmp_path, monkeypatch):
    """share-metrics (review R2/L2): the nodes' un-noised statistics are averaged into every round line; the
    summary's node_assumptions says they are outside the certificate, only when some node shared them."""
    from fl_dp_flower.app.testing import run_local, tiny_config

    out, _ = run_local(tiny_config(tmp_path / "quiet", **{"num-server-rounds": 1}))
    quiet = json.loads((out.run_dir / "summary.json").read_text())["node_assumptions"]
    assert not any("un-noised training statistics" in a for a in quiet)
    monkeypatch.setenv("FL_DP_SHARE_METRICS", "1")
    out, _ = run_local(tiny_config(tmp_path / "shared", **{"num-server-rounds": 1}))
    shared = json.loads((out.run_dir / "summary.json").read_text())["node_assumptions"]
    assert any("un-noised training statistics" in a and "outside the privacy certificate" in a for a in shared)

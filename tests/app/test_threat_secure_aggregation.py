"""A whole run under threat-model "secure-aggregation" (docs/MATH.md §20): the real ServerApp and ClientApp
on the in-process grid, every train round through SecAgg+ with the integer upload; the ledger certifies
the Skellam bound of the clients in each sum, and verify reproduces it."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest

from fl_dp_flower.app.threat import node_assumptions, run_grid
from fl_dp_flower.app.config import AppConfig
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.reporting.ledger import read_ledger
from fl_dp_flower.reporting.verify import verify_ledger
from fl_dp_flower.strategies.secagg import SecAggGrid
from fl_dp_flower.testing import LocalGrid
from fl_dp_flower.app.testing import run_local, tiny_config
from fl_dp_flower.training.models import parameter_count


def test_a_run_certifies_the_skellam_bound_of_the_secure_sums(tmp_path):
    config = tiny_config(tmp_path, **{"threat-model": "secure-aggregation", "clients-per-round": 5,
                                      "num-partitions": 5, "min-replies": 5, "num-server-rounds": 2,
                                      "model": "cnn-tanh"})
    outcome, _ = run_local(config, nodes=5, copy_content=True)
    ledger = tmp_path / "run" / "ledger.jsonl"
    contents = read_ledger(ledger)
    assert [line["record"]["node_ids"] for line in contents.rounds] == [[1, 2, 3, 4, 5]] * 2
    header = contents.header["accountant_config"]
    assert header["sum_dimension"] == parameter_count(config.dataset, "cnn-tanh") == 26_010  # the model's size
    assert header["sum_grid_step"] > 0
    report = contents.rounds[-1]["report"]
    assert report["certified"]["bound"] == "secure_aggregation" and math.isinf(report["certified"]["mu"])
    assert any("Skellam" in a for a in report["certified"]["assumes"])
    # the same number from the config alone: the accountant over the planned rounds
    planned = PrivacyAccountant(config.accountant_config())
    planned.extend(config.accountant_config().planned_round(t) for t in (1, 2))
    assert report["certified"]["epsilon"] == pytest.approx(planned.report().certified.epsilon, rel=1e-12)
    assert verify_ledger(ledger).ok
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["final_report"]["certified"]["bound"] == "secure_aggregation"
    assert any("Skellam" in a for a in summary["node_assumptions"])
    del outcome


def test_the_run_grid_is_secagg_only_under_secure_aggregation(tmp_path):
    grid = LocalGrid(None, 2, {})
    assert run_grid(grid, AppConfig.from_run_config({"threat-model": "all-rounds"})) is grid
    config = AppConfig.from_run_config({"threat-model": "secure-aggregation", "secagg-num-shares": 5,
                                        "clients-per-round": 8, "min-replies": 5})
    wrapped = run_grid(grid, config)
    assert isinstance(wrapped, SecAggGrid) and wrapped.grid == config.secure_sum_grid()
    assert any("Skellam" in a for a in node_assumptions(config))


@pytest.mark.parametrize("keys, message", [
    ({"sigma": "auto", "target-epsilon": 4.0}, "not available with threat-model 'secure-aggregation'"),
    ({"client-sampling": "poisson", "sampling-rate": 0.5}, "secure-aggregation"),
    ({"min-replies": 4}, "'min-replies' - 'colluding-clients' >= 4"),
    ({"secagg-num-shares": 4}, "'secagg-num-shares' = 0 or >= 5"),
])
def test_what_secure_aggregation_cannot_combine_with_is_refused_naming_the_key(keys, message):
    with pytest.raises(Exception, match=message):
        AppConfig.from_run_config({"threat-model": "secure-aggregation", "clients-per-round": 8, "min-replies": 5,
                                   **keys})


def test_cohorts_upload_their_members_integer_sum_and_the_accountant_counts_the_members(tmp_path):
    """clients-per-node 2 on 5 nodes (docs/MATH.md §20.6): each node is one SecAgg+ participant uploading its two
    members' integer sum; the global model moves by the decoded sum over the 10 clients, the ledger lists the 10
    members and certifies what the planned run of 10 single clients certifies."""
    import numpy as np
    from flwr.clientapp import ClientApp

    from fl_dp_flower.app import clientapp
    from fl_dp_flower.privacy.skellam import CLIENT_HALF_RANGE
    from fl_dp_flower.protocol import MEMBERS, SECURE_SUM_RECORD
    from fl_dp_flower.secagg_mod import secure_aggregation_mod

    uploads, sent = {}, {}

    def recording(msg, ctx):
        reply = clientapp.train(msg, ctx)
        sent[ctx.node_id] = msg.content["arrays"].to_numpy_ndarrays()
        ints = reply.content.array_records[SECURE_SUM_RECORD]
        uploads[ctx.node_id] = (reply.content["metrics"][MEMBERS], [ints[k].numpy() for k in ints.keys()])
        return reply

    app = ClientApp(mods=[secure_aggregation_mod])
    app.train()(recording)
    config = tiny_config(tmp_path, **{"threat-model": "secure-aggregation", "clients-per-round": 10,
                                      "clients-per-node": 2, "num-partitions": 5, "min-replies": 10,
                                      "num-server-rounds": 1, "model": "cnn-tanh"})
    outcome, _ = run_local(config, app, nodes=5, copy_content=True)
    contents = read_ledger(tmp_path / "run" / "ledger.jsonl")
    assert contents.rounds[0]["record"]["node_ids"] == list(range(2, 12))  # node id x 2 + slot: the 10 members
    header = contents.header["accountant_config"]
    assert header["sum_clients_per_upload"] == 2
    assert sorted(len(m) for m, _ in uploads.values()) == [2] * 5
    step = header["sum_grid_step"]
    w0 = next(iter(sent.values()))
    total = [sum(u[i].astype(np.int64) - CLIENT_HALF_RANGE for _, u in uploads.values()) for i in range(len(w0))]
    final = outcome.strategy.global_arrays.to_numpy_ndarrays()
    for w, t, f in zip(w0, total, final, strict=True):
        np.testing.assert_allclose(f, w + t * step / 10, rtol=1e-5, atol=1e-6)
    single = dataclasses.replace(config.accountant_config(), sum_clients_per_upload=1)
    planned = PrivacyAccountant(single)
    planned.extend([single.planned_round(1)])
    report = contents.rounds[-1]["report"]
    assert report["certified"]["epsilon"] == pytest.approx(planned.report().certified.epsilon, rel=1e-12)
    assert verify_ledger(tmp_path / "run" / "ledger.jsonl").ok


TWENTY = {"clients-per-round": 20, "min-replies": 20, "num-partitions": 10}  # 10 nodes of 2


@pytest.mark.parametrize("keys, message", [
    ({"clients-per-node": 2, "min-replies": 6}, r"ceil\('min-replies' / 'clients-per-node'\) - ceil\('colluding-clients' "
                                                r"/ 'clients-per-node'\) >= 4 \(got 3 - 1\)"),
    ({"clients-per-node": 2, "colluding-clients": 3}, r"\(got 5 - 2\)"),  # 3 colluding clients: 2 nodes
    ({"clients-per-node": 2, "secagg-num-shares": 5, "colluding-clients": 3, **TWENTY},
     r"ceil\('colluding-clients' / 'clients-per-node'\) colluding nodes <= 'secagg-num-shares' - 4 \(got 2 with 5\)"),
    ({"clients-per-node": 2, "secagg-threshold": 0.2, "colluding-clients": 3, **TWENTY},
     r"threshold above ceil\('colluding-clients' / 'clients-per-node'\) colluding nodes \(2\): .* = 2 with 10 shares"),
])
def test_cohort_rules_count_nodes_and_name_the_keys(keys, message):
    """SecAgg+ participants are nodes: the brute-force floor, num-shares and threshold rules count
    ceil(colluding-clients / clients-per-node) colluding nodes among ceil(clients / clients-per-node) nodes."""
    with pytest.raises(Exception, match=message):
        AppConfig.from_run_config({"threat-model": "secure-aggregation", "clients-per-round": 10, "min-replies": 10,
                                   "num-partitions": 5, **keys})


def test_a_cohort_config_plans_node_sums():
    config = AppConfig.from_run_config({"threat-model": "secure-aggregation", "clients-per-round": 10,
                                        "min-replies": 10, "num-partitions": 5, "clients-per-node": 2})
    assert config.accountant_config().sum_clients_per_upload == 2
    assert config.secure_sum_fields()["sum_clients_per_upload"] == 2

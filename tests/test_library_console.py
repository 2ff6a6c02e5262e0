"""Issue 30 item 8: the 21 dp-* metrics of every round stay out of Flower's own console dumps (its
per-round "Aggregated MetricRecord" and its final summary); the Result, the ledger and the sinks keep them."""

from __future__ import annotations

import json
import logging

from flwr.app import ArrayRecord
from flwr.clientapp import ClientApp

from fl_dp_flower import ConsoleSink, DPSettings, FederationSettings, NoisyFedAvg, dp_train, open_ledger
from fl_dp_flower.testing import LocalGrid, task_identity
from tests.test_public_api import NODES, TinyNet, load_data


def test_flowers_dumps_carry_no_dp_metrics_and_everything_else_keeps_them(tmp_path, caplog):
    caplog.set_level(logging.INFO)
    settings = DPSettings(sigma=0.5, clip_norm=1.0, local_steps=2, batch_size=8, lr=0.1)
    ledger, accountant = open_ledger(tmp_path / "ledger.jsonl", settings.accountant_config(clients=NODES))
    strategy = NoisyFedAvg(settings, accountant, federation=FederationSettings(clients_per_round=NODES,
                                                                                num_server_rounds=2),
                           sinks=[ledger, ConsoleSink()])
    app = ClientApp()
    app.train()(dp_train(TinyNet, load_data))
    with ledger, task_identity():
        result = strategy.start(grid=LocalGrid(app, NODES), initial_arrays=ArrayRecord(TinyNet().state_dict()))
    flower = [r.getMessage() for r in caplog.records if r.name == "flwr"]
    dumps = [m for m in flower if "Aggregated MetricRecord" in m]
    assert len(dumps) == 2 and all("dp-" not in m and "num-examples" in m for m in dumps)
    assert not any("dp-certified" in m for m in flower)  # nor in Flower's final summary
    ours = [r.getMessage() for r in caplog.records if r.name.endswith("fl_dp_flower")]
    assert sum("certified mu=" in m for m in ours) == 2  # the one-line round summary stays
    assert result.train_metrics_clientapp[2]["dp-certified-epsilon"] == accountant.report().certified.epsilon
    lines = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert [e["metrics"]["dp-aggregated"] for e in lines if e["kind"] == "round"] == [1, 1]

"""ServerApp: Noisy-FedAvg with the accountant, the privacy ledger and an optional budget."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fl_dp_flower import Budget, ConsoleSink, DPSettings, FederationSettings, NoisyFedAvg, open_ledger
from digits_dp.task import DigitsNet, load_test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    settings = DPSettings(sigma=float(rc["sigma"]), clip_norm=float(rc["clip-norm"]), local_steps=int(rc["local-steps"]),
                          batch_size=int(rc["batch-size"]), lr=float(rc["lr"]))
    federation = FederationSettings(clients_per_round=int(rc["clients-per-round"]),
                                    num_server_rounds=int(rc["num-server-rounds"]))
    out = Path(str(rc["output-dir"])).expanduser().resolve()
    ledger, accountant = open_ledger(out / "ledger.jsonl",
                                     settings.accountant_config(clients=federation.clients_per_round,
                                                                delta=float(rc["delta"])),
                                     run_config=dict(rc))
    target = float(rc["target-epsilon"])
    strategy = NoisyFedAvg(settings, accountant, federation=federation,
                           budget=Budget(target, float(rc["delta"])) if target > 0 else None,
                           sinks=[ledger, ConsoleSink()])

    x_test, y_test = load_test()
    model = DigitsNet()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        with torch.no_grad():
            out_ = model(x_test)
        return MetricRecord({"accuracy": float((out_.argmax(1) == y_test).float().mean()),
                             "loss": float(F.cross_entropy(out_, y_test))})

    with ledger:
        strategy.start(grid=grid, initial_arrays=ArrayRecord(DigitsNet().state_dict()), evaluate_fn=evaluate)
    spent = strategy.privacy_spent()
    summary = {"rounds": accountant.num_releases, "epsilon": spent.epsilon, "delta": spent.delta,
               "bound": spent.bound, "stop_reason": strategy.stop_reason}
    (out / "summary.json").write_text(json.dumps(summary))
    print(f"certified epsilon {spent.epsilon:.4g} at delta {spent.delta:g} after {accountant.num_releases} rounds")

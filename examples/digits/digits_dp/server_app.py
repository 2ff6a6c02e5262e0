"""ServerApp: Noisy-FedAvg with the accountant, the privacy ledger, a model checkpoint (resume), an
optional budget and optional secure aggregation."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp

from fl_dp_flower import (Budget, ConsoleSink, DPSettings, FederationSettings, ModelCheckpoint, NoisyFedAvg, SecAggGrid,
                          open_ledger, plan_grid)
from digits_dp.task import DigitsNet, load_test

app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    rc = context.run_config
    settings = DPSettings(sigma=float(rc["sigma"]), clip_norm=float(rc["clip-norm"]), local_steps=int(rc["local-steps"]),
                          batch_size=int(rc["batch-size"]), lr=float(rc["lr"]))
    secure = bool(rc.get("secure-aggregation", False))
    clients = int(rc["clients-per-round"])
    # secure aggregation: a sum is unmasked only with >= 4 contributors outside the colluding coalition (1 here),
    # so every round must wait for all of them (min_replies); the strategy refuses fewer before round 1
    federation = FederationSettings(clients_per_round=clients, num_server_rounds=int(rc["num-server-rounds"]),
                                    min_replies=clients if secure else 1)
    delta = float(rc["delta"])
    if secure:  # the integer grid of the uploads and the secure-aggregation accountant (Skellam noise of the sum)
        dimension = sum(v.numel() for v in DigitsNet().state_dict().values())
        sum_grid = plan_grid(settings.sigma, settings.clip_norm, [settings.lr] * settings.local_steps, clients,
                             dimension, federation.num_server_rounds)
        plan = settings.accountant_config(clients=clients, delta=delta, threat_model="secure-aggregation",
                                          sum_grid_step=sum_grid.step, sum_dimension=dimension)
        grid = SecAggGrid(grid, sum_grid, min_contributors=federation.min_replies)
    else:
        plan = settings.accountant_config(clients=clients, delta=delta)
    out = Path(str(rc["output-dir"])).expanduser().resolve()
    checkpoint = ModelCheckpoint(out / "model-latest.pt")  # the model (and server-optimizer state) after each round
    ledger, accountant = open_ledger(out / "ledger.jsonl", plan, run_config=dict(rc), resume=bool(rc.get("resume", False)),
                                     unfinished_round=str(rc.get("resume-unfinished-round", "refuse")),  # type: ignore[arg-type]
                                     checkpoint=checkpoint)
    target = float(rc["target-epsilon"])
    strategy = NoisyFedAvg(settings, accountant, federation=federation,
                           budget=Budget(target, delta) if target > 0 else None,
                           sinks=[ledger, checkpoint, ConsoleSink()])  # the ledger line first, then the checkpoint

    x_test, y_test = load_test()
    model = DigitsNet()

    def evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
        model.load_state_dict(arrays.to_torch_state_dict())
        with torch.no_grad():
            out_ = model(x_test)
        return MetricRecord({"accuracy": float((out_.argmax(1) == y_test).float().mean()),
                             "loss": float(F.cross_entropy(out_, y_test))})

    initial = checkpoint.restore(strategy) or ArrayRecord(DigitsNet().state_dict())  # a resume continues the model
    with ledger:
        strategy.start(grid=grid, initial_arrays=initial, evaluate_fn=evaluate)
    spent = strategy.privacy_spent()
    summary = {"rounds": accountant.num_releases, "epsilon": spent.epsilon, "delta": spent.delta,
               "bound": spent.bound, "stop_reason": strategy.stop_reason}
    (out / "summary.json").write_text(json.dumps(summary))
    print(f"certified epsilon {spent.epsilon:.4g} at delta {spent.delta:g} after {accountant.num_releases} rounds")

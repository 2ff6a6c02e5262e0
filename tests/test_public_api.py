"""The library as a user's own Flower app uses it: top-level names only, own model and data."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from torch import nn

import fl_dp_flower
from fl_dp_flower import (Budget, ConsoleSink, DPSettings, FederationSettings, NoisyFedAvg, NoisyFedProx,
                          PrivacyAccountant, RoundOutcome, TrainInstruction, dp_train, open_ledger)
from fl_dp_flower.testing import LocalGrid, task_identity

NODES = 3


class TinyNet(nn.Module):  # not LeNet: any parameter-only torch model
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def load_data(context: Context) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(int(context.node_config["partition-id"]))
    x = torch.randn(40, 6, generator=g)
    return x, (x[:, 0] > 0).long() + (x[:, 1] > 1).long()


class Recorder:
    """A user's own sink: any object with on_event and on_round."""

    def __init__(self) -> None:
        self.events: list[str] = []
        self.rounds: list[RoundOutcome] = []

    def on_event(self, kind: str, data: dict) -> None:
        self.events.append(kind)

    def on_round(self, outcome: RoundOutcome) -> None:
        self.rounds.append(outcome)


def test_public_names_are_small_and_importable():
    assert 12 <= len(fl_dp_flower.__all__) <= 24
    for name in fl_dp_flower.__all__:
        assert getattr(fl_dp_flower, name) is not None
    with pytest.raises(AttributeError):
        fl_dp_flower.not_a_name  # noqa: B018


def test_settings_are_frozen_and_validated_naming_the_field():
    s = DPSettings(sigma=0.5, clip_norm=1.0)
    with pytest.raises(AttributeError):
        s.sigma = 1.0  # type: ignore[misc]
    for bad, field in (({"sigma": 0.0}, "sigma"), ({"clip_norm": -1.0}, "clip_norm"), ({"local_steps": 0}, "local_steps"),
                       ({"schedule": "linear"}, "schedule"), ({"sigma": True}, "sigma")):
        with pytest.raises(ValueError, match=field):
            DPSettings(**{"sigma": 0.5, "clip_norm": 1.0, **bad})
    with pytest.raises(ValueError, match="lr \\* prox_alpha"):
        DPSettings(sigma=0.5, clip_norm=1.0, algorithm="fedprox", prox_alpha=20.0, lr=0.1)
    with pytest.raises(ValueError, match="min_replies"):
        FederationSettings(clients_per_round=2, min_replies=3)


def test_strategy_refuses_an_accountant_planned_for_another_run():
    s = DPSettings(sigma=0.5, clip_norm=1.0)
    other = PrivacyAccountant(DPSettings(sigma=0.4, clip_norm=1.0).accountant_config(clients=3))
    with pytest.raises(ValueError, match="sigma: accountant 0.4 != settings 0.5"):
        NoisyFedAvg(s, other, federation=FederationSettings(clients_per_round=3))
    with pytest.raises(ValueError, match="clients"):
        NoisyFedAvg(s, PrivacyAccountant(s.accountant_config(clients=5)), federation=FederationSettings(clients_per_round=3))
    with pytest.raises(ValueError, match="fedprox"):
        NoisyFedProx(s, PrivacyAccountant(s.accountant_config(clients=10)))
    with pytest.raises(TypeError, match="PrivacySink"):
        NoisyFedAvg(s, PrivacyAccountant(s.accountant_config(clients=10)), sinks=[print])


def test_own_model_and_data_run_with_ledger_report_and_budget_stop(tmp_path):
    settings = DPSettings(sigma=0.3, clip_norm=1.0, local_steps=2, batch_size=8, lr=0.1)
    federation = FederationSettings(clients_per_round=NODES, num_server_rounds=10)
    config = settings.accountant_config(clients=NODES)
    ledger, accountant = open_ledger(tmp_path / "ledger.jsonl", config, run_config=settings.to_dict())
    # budget: enough for some rounds, not for 10 (epsilon grows with every round)
    budget_eps = PrivacyAccountant.from_records(config, [config.planned_round(t) for t in (1, 2, 3)]).report().certified.epsilon
    recorder = Recorder()
    strategy = NoisyFedAvg(settings, accountant, federation=federation, budget=Budget(budget_eps * 1.0001, 1e-5),
                           sinks=[ledger, ConsoleSink(), recorder])
    app = ClientApp()
    app.train()(dp_train(TinyNet, load_data))
    with ledger, task_identity():
        result = strategy.start(grid=LocalGrid(app, NODES), initial_arrays=ArrayRecord(TinyNet().state_dict()))
    assert accountant.num_releases == 3 and strategy.stop_reason and "budget" in strategy.stop_reason
    assert result.arrays is not None and set(result.arrays) == set(TinyNet().state_dict())
    assert strategy.privacy_spent().epsilon == pytest.approx(budget_eps, rel=1e-9)
    assert [o.round for o in recorder.rounds] == [1, 2, 3] and recorder.events.count("round-open") == 3
    lines = [json.loads(line) for line in (tmp_path / "ledger.jsonl").read_text().splitlines()]
    assert [e["round"] for e in lines if e["kind"] == "round"] == [1, 2, 3]
    assert [e["event"] for e in lines if e["kind"] == "event"].count("round-open") == 3
    # resume: the accountant is rebuilt from the ledger's records
    again, rebuilt = open_ledger(tmp_path / "ledger.jsonl", config, resume=True)
    again.close()
    assert rebuilt.num_releases == 3 and rebuilt.report().certified.epsilon == accountant.report().certified.epsilon


def test_dp_train_refuses_a_model_with_buffers():
    class WithNorm(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin, self.bn = nn.Linear(6, 3), nn.BatchNorm1d(3)

    with pytest.raises(ValueError, match="buffers.*BatchNorm"):
        dp_train(WithNorm, load_data)


def test_dp_train_echoes_and_refuses_like_the_contract():
    train = dp_train(TinyNet, load_data)
    ins = TrainInstruction(round_index=2, algorithm="fedavg", schedule="constant", lr=0.1, local_steps=3,
                           clip_norm=1.0, sigma=0.2, clipping="per-batch", batch_size=64, prox_alpha=0.0, seed=-1)
    ctx = Context(run_id=0, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    msg = Message(RecordDict({"arrays": ArrayRecord(TinyNet().state_dict()), "config": ConfigRecord(ins.to_config())}),
                  1, MessageType.TRAIN)
    reply = train(msg, ctx)
    m = reply.content["metrics"]
    assert (m["dp.sigma"], m["dp.local-steps"], m["dp.batch-size"], m["dp.round-index"]) == (0.2, 3, 40, 2)
    assert TrainInstruction.from_config(ConfigRecord(ins.to_config())) == ins
    limited = Context(run_id=0, node_id=1, node_config={"partition-id": 0, "min-sigma": 0.5}, state=RecordDict(),
                      run_config={})
    refused = train(msg, limited)
    assert refused.has_error() and "dp.sigma=0.2 violates this node's limit min-sigma=0.5" in refused.error.reason
    # per-sample clipping averages over B samples: a batch larger than the 40 held would be a smaller B than accounted
    per_sample = dataclasses.replace(ins, clipping="per-sample")
    too_big = Message(RecordDict({"arrays": ArrayRecord(TinyNet().state_dict()),
                                  "config": ConfigRecord(per_sample.to_config())}), 1, MessageType.TRAIN)
    refused = train(too_big, ctx)
    assert refused.has_error() and "dp.batch-size=64 exceeds the 40 local samples" in refused.error.reason
    # Poisson batches (docs/MATH.md §23): the reply echoes the rate B/n, nothing about the draws
    poisson = dataclasses.replace(per_sample, batch_size=8, batch_sampling="poisson")
    reply = train(Message(RecordDict({"arrays": ArrayRecord(TinyNet().state_dict()),
                                      "config": ConfigRecord(poisson.to_config())}), 1, MessageType.TRAIN), ctx)
    assert not reply.has_error() and reply.content["metrics"]["dp.batch-rate"] == pytest.approx(8 / 40)


def test_every_package_error_has_the_one_base_class():
    """Issue 17: one error base class (each error keeps its standard base; a budget stop stays
    Flower's PrivacyBudgetExhausted)."""
    from flwr.serverapp.exception import PrivacyBudgetExhausted

    from fl_dp_flower import FlDpError
    from fl_dp_flower.app.recovery import RunFailed
    from fl_dp_flower.app.config import ConfigError
    from fl_dp_flower.protocol import Refused
    from fl_dp_flower.strategies.budget import BudgetExhausted

    for error in (RunFailed, ConfigError, Refused, BudgetExhausted):
        assert issubclass(error, FlDpError), error
    assert issubclass(BudgetExhausted, PrivacyBudgetExhausted) and issubclass(ConfigError, ValueError)

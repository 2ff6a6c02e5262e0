"""A library user's own model and data that cannot train are refused by dp_train before any local step,
with a reply that names model_fn / data_fn / loss_fn and the mismatch (before this check the node raised
torch's RuntimeError / IndexError out of the ClientApp: Flower's generic ClientAppException reply, or, on an
in-process grid, a crashed ServerApp)."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp.strategy import FedAvg
from torch import nn

from fl_dp_flower import TrainInstruction, dp_train
from fl_dp_flower.client import check_loss_runs
from fl_dp_flower.protocol import Refused
from fl_dp_flower.testing import LocalGrid, task_identity
from tests.test_public_api import TinyNet, load_data

INSTRUCTION = TrainInstruction(round_index=0, algorithm="fedavg", schedule="constant", lr=0.1, local_steps=2,
                               clip_norm=1.0, sigma=0.5, clipping="per-batch", batch_size=8, prox_alpha=0.0, seed=-1)


class WiderNet(nn.Module):  # the client's model_fn builds another head than the server's initial model
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def _reply(model_fn=TinyNet, data_fn=load_data, loss_fn=F.cross_entropy, server_model=TinyNet, arrays_key="arrays"):
    msg = Message(RecordDict({"arrays": ArrayRecord(server_model().state_dict()),
                              "config": ConfigRecord(INSTRUCTION.to_config())}), 1, MessageType.TRAIN)
    ctx = Context(run_id=0, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    return dp_train(model_fn, data_fn, loss_fn, arrays_key=arrays_key)(msg, ctx)


def _reason(reply: Message) -> str:
    assert reply.has_error(), "the instruction was not refused"
    return reply.error.reason


def test_a_client_model_that_does_not_fit_the_servers_is_refused_naming_model_fn():
    reason = _reason(_reply(model_fn=WiderNet))
    assert "does not fit model_fn() (WiderNet)" in reason
    assert "net.2.weight: server (3, 8) != model_fn() (5, 8)" in reason and "net.2.bias: server (3,) != model_fn() (5,)" in reason
    assert "initial_arrays" in reason


def test_a_wrong_arrays_key_is_refused_naming_it():
    assert "no ArrayRecord 'weights'" in _reason(_reply(arrays_key="weights"))


def test_labels_outside_the_models_classes_are_refused_naming_data_fn():
    def shifted(context):  # labels 1..3 for a 3-class head (a 1-based label encoding)
        x, y = load_data(context)
        return x, y + 1

    reason = _reason(_reply(data_fn=shifted))
    assert re.search(r"data_fn's labels span \[1, 3\] but model_fn\(\)'s output has 3 classes", reason), reason


def test_features_of_another_width_are_refused_naming_loss_and_shapes():
    def narrow(context):
        x, y = load_data(context)
        return x[:, :4], y

    reason = _reason(_reply(data_fn=narrow))
    assert "model_fn()(x) fails on data_fn's x (RuntimeError" in reason and "x has shape (40, 4)" in reason


def test_a_loss_that_does_not_take_the_labels_is_refused_naming_loss_fn():
    def float_targets(context):  # mse_loss on class ids: the outputs' shape (B, 3) cannot take y's (B,)
        x, y = load_data(context)
        return x, y.float()

    reason = _reason(_reply(data_fn=float_targets, loss_fn=lambda out, y: F.mse_loss(out, y.view(-1, 2))))
    assert reason.startswith("refused by node: loss_fn(model_fn()(x), y) fails on data_fn's data (RuntimeError"), reason


def test_the_checks_pass_data_that_trains():
    reply = _reply()
    assert not reply.has_error()
    check_loss_runs(TinyNet(), *load_data(Context(0, 1, {"partition-id": 1}, RecordDict(), {})), F.cross_entropy, 8)
    with pytest.raises(Refused, match="labels span \\[-1, 1\\]"):
        x, y = load_data(Context(0, 1, {"partition-id": 1}, RecordDict(), {}))
        check_loss_runs(TinyNet(), x, y - 1, F.cross_entropy, 8)


def test_a_plain_flower_strategy_is_refused_naming_the_strategy_to_use():
    """FedAvg on the server and dp_train on the clients: before, the node said "train config is missing
    'dp.round-index'"; now it names the strategy (nothing is trained, nothing accounted: no number at all)."""
    app = ClientApp()
    app.train()(dp_train(TinyNet, load_data))
    grid = LocalGrid(app, 2)
    with task_identity():
        result = FedAvg(fraction_evaluate=0.0).start(grid=grid, initial_arrays=ArrayRecord(TinyNet().state_dict()),
                                                     num_rounds=1)
    assert result.train_metrics_clientapp == {}
    msg = Message(RecordDict({"arrays": ArrayRecord(TinyNet().state_dict()), "config": ConfigRecord({"lr": 0.1})}),
                  1, MessageType.TRAIN)
    ctx = Context(run_id=0, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    reason = _reason(dp_train(TinyNet, load_data)(msg, ctx))
    assert "carries no dp.* settings (ConfigRecord 'config' has ['lr'])" in reason and "NoisyFedAvg" in reason


class DropoutNet(nn.Module):  # a user's model with dropout (parameters only)
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(6, 16), nn.ReLU(), nn.Dropout(0.5), nn.Linear(16, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


@pytest.mark.parametrize("batch_sampling", ["fixed", "poisson"])
def test_per_sample_clipping_trains_a_model_with_dropout_within_the_clipping_bound(batch_sampling):
    """Before, torch.func.vmap raised "called random operation while in randomness error mode" out of dp_train."""
    from fl_dp_flower.training.local_update import local_update

    torch.manual_seed(0)
    model = DropoutNet()
    start = [p.detach().clone() for p in model.parameters()]
    x, y = load_data(Context(0, 1, {"partition-id": 0}, RecordDict(), {}))
    lr, steps, clip = 0.5, 3, 0.1
    stats = local_update(model, x * 50, y, step_sizes=[lr] * steps, clip_norm=clip, clipping="per-sample", batch_size=8,
                         generator=torch.Generator().manual_seed(1), batch_sampling=batch_sampling)
    moved = torch.sqrt(sum(((p.detach() - s) ** 2).sum() for p, s in zip(model.parameters(), start)))
    assert stats.steps == steps and 0 < float(moved) <= steps * lr * clip * (1 + 1e-6)
    assert stats.clipped_fraction > 0  # the bound was exercised, not met trivially

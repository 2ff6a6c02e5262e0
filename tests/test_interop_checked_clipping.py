"""Flower's client-side fixed-clipping wrapper certifies clipped updates whether or not the ClientApp runs
fixedclipping_mod: without the mod its accountant composes the same mu for unclipped updates (shown below
with Flower's own wrapper). CheckedClientSideFixedClipping stops such a run at its first round, naming the
node, and passes honest clipped replies (float32 rounding included) with the same accounting."""

from __future__ import annotations

import math

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod
from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping, FedAvg

from fl_dp_flower import FlDpError, FlowerGDPAccountant
from fl_dp_flower.interop import CheckedClientSideFixedClipping, UnclippedUpdate, update_norm
from fl_dp_flower.testing import LocalGrid, task_identity

NODES, ROUNDS, Z, C = 4, 3, 1.5, 1.0


def _client_app(mods=()) -> ClientApp:
    app = ClientApp(mods=list(mods))

    @app.train()
    def train(msg: Message, context: Context) -> Message:  # an update of norm about 10 C: only the mod clips it
        arrays = msg.content["arrays"].to_numpy_ndarrays()
        rng = np.random.default_rng(context.node_id)
        updated = ArrayRecord([a + rng.normal(scale=2.0, size=a.shape).astype(a.dtype) for a in arrays])
        return Message(RecordDict({"arrays": updated, "metrics": MetricRecord({"num-examples": 1})}), reply_to=msg)

    return app


def _run(wrapper, app):
    accountant = FlowerGDPAccountant(population_size=NODES)
    strategy = wrapper(FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=NODES),
                       noise_multiplier=Z, clipping_norm=C, num_sampled_clients=NODES, accountant=accountant)
    initial = ArrayRecord([np.full(25, 0.3, dtype=np.float32), np.full((5, 4), -7.0, dtype=np.float32)])
    with task_identity():
        strategy.start(grid=LocalGrid(app, NODES), initial_arrays=initial, num_rounds=ROUNDS)
    return accountant


def test_flowers_wrapper_certifies_an_unclipped_run_and_the_checked_one_refuses_it():
    # Flower's own wrapper: no mod, updates of norm ~10 C, yet the same mu as a clipped run
    assert _run(DifferentialPrivacyClientSideFixedClipping, _client_app()).mu == pytest.approx(math.sqrt(ROUNDS) / Z)
    with pytest.raises(UnclippedUpdate, match=r"round 1: node \d's update has L2 norm .* > clipping_norm 1: "
                                              r"its ClientApp does not clip \(add fixedclipping_mod"):
        _run(CheckedClientSideFixedClipping, _client_app())


def test_the_checked_wrapper_passes_clipped_replies_with_the_same_accounting():
    accountant = _run(CheckedClientSideFixedClipping, _client_app([fixedclipping_mod]))
    assert accountant.num_releases == ROUNDS and accountant.mu == pytest.approx(math.sqrt(ROUNDS) / Z, rel=1e-12)


def test_update_norm_allows_float32_rounding_only():
    rng = np.random.default_rng(0)
    old = [rng.normal(scale=50.0, size=10_000).astype(np.float32)]
    update = rng.normal(size=10_000)
    update *= C / np.linalg.norm(update)  # exactly C in float64
    new = [(old[0] + update.astype(np.float32)).astype(np.float32)]  # rounded twice in float32
    norm, slack = update_norm(new, old)
    assert abs(norm - C) <= slack and norm <= C * (1 + 1e-6) + slack
    assert slack < 0.01 * C  # sharp: a 1 % excess is caught at this model size
    assert update_norm([old[0] + np.float32(0.0)], old)[0] == 0.0
    with pytest.raises(UnclippedUpdate, match="shape"):
        update_norm([np.zeros(3, np.float32)], [np.zeros(4, np.float32)])
    assert issubclass(UnclippedUpdate, FlDpError) and issubclass(UnclippedUpdate, ValueError)

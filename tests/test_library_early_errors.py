"""Issue 30 item 5: a library user's mistakes get a clear error naming the argument, before round 1
where the server can know (delta, the budget's delta), at the node's first instruction otherwise
(numpy data is converted; an empty or mismatched partition is refused naming data_fn), and a run
that accounted nothing fails loudly."""

from __future__ import annotations

import re

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.clientapp import ClientApp

from fl_dp_flower import Budget, DPSettings, FederationSettings, NoisyFedAvg, PrivacyAccountant, TrainInstruction, dp_train
from fl_dp_flower.strategies import NothingAccounted
from fl_dp_flower.testing import LocalGrid, task_identity
from tests.test_public_api import NODES, TinyNet, load_data

SETTINGS = DPSettings(sigma=0.5, clip_norm=1.0, local_steps=2, batch_size=8, lr=0.1)
INSTRUCTION = TrainInstruction(round_index=0, algorithm="fedavg", schedule="constant", lr=0.1, local_steps=2,
                               clip_norm=1.0, sigma=0.5, clipping="per-batch", batch_size=8, prox_alpha=0.0, seed=-1)


def _train(data_fn):
    msg = Message(RecordDict({"arrays": ArrayRecord(TinyNet().state_dict()),
                              "config": ConfigRecord(INSTRUCTION.to_config())}), 1, MessageType.TRAIN)
    ctx = Context(run_id=0, node_id=1, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    return dp_train(TinyNet, data_fn)(msg, ctx)


def test_numpy_data_is_converted_like_scikit_learn_gives_it():
    def numpy_data(context):  # float64 features, int32 labels: what sklearn's loaders return
        x, y = load_data(context)
        return x.double().numpy(), y.int().numpy()

    reply = _train(numpy_data)
    assert not reply.has_error()
    assert reply.content["metrics"]["num-examples"] == 40
    assert all(v.dtype == "float32" for v in reply.content["arrays"].to_numpy_ndarrays())


@pytest.mark.parametrize("data, reason", [
    ((np.zeros((0, 6)), np.zeros(0)), "data_fn returned an empty partition \\(0 samples\\)"),
    ((np.zeros((5, 6)), np.zeros(4)), "data_fn returned x of shape \\(5, 6\\) and y of shape \\(4,\\)"),
    (({"x": 1}, [0]), "data_fn must return \\(x, y\\) as tensors or numpy arrays; x is a dict"),
])
def test_data_that_cannot_train_is_refused_naming_data_fn(data, reason):
    reply = _train(lambda context: data)
    assert reply.has_error()
    assert re.search(reason, reply.error.reason), reply.error.reason


def test_a_run_that_accounts_no_round_fails_loudly():
    app = ClientApp()
    app.train()(dp_train(TinyNet, lambda context: (np.zeros((0, 6)), np.zeros(0))))
    accountant = PrivacyAccountant(SETTINGS.accountant_config(clients=NODES))
    strategy = NoisyFedAvg(SETTINGS, accountant, federation=FederationSettings(clients_per_round=NODES,
                                                                                num_server_rounds=2))
    with task_identity(), pytest.raises(NothingAccounted, match="2 round\\(s\\) ran but none was accounted"):
        strategy.start(grid=LocalGrid(app, NODES), initial_arrays=ArrayRecord(TinyNet().state_dict()))


def test_implausible_delta_is_refused_naming_it():
    with pytest.raises(ValueError, match="delta must be a number in \\(0, 0.1\\)"):
        SETTINGS.accountant_config(clients=NODES, delta=0.5)
    with pytest.raises(ValueError, match="delta = 0.05 must be below 1/clients = 0.05"):
        SETTINGS.accountant_config(clients=20, delta=0.05)
    with pytest.raises(ValueError, match="budget delta must be a number in \\(0, 0.1\\)"):
        Budget(epsilon=1.0, delta=0.5)
    assert SETTINGS.accountant_config(clients=NODES, delta=1e-3).delta == 1e-3


def test_a_budget_at_another_delta_than_the_accountant_is_refused():
    accountant = PrivacyAccountant(SETTINGS.accountant_config(clients=NODES, delta=1e-5))
    with pytest.raises(ValueError, match="budget delta 1e-06 != the accountant's delta 1e-05"):
        NoisyFedAvg(SETTINGS, accountant, federation=FederationSettings(clients_per_round=NODES),
                    budget=Budget(epsilon=5.0, delta=1e-6))


@pytest.mark.parametrize("fields, message", [
    ({"clients_per_round": 3, "min_replies": 4}, r"min_replies = 4: must be an integer in \[1, clients_per_round = 3\]"),
    ({"client_sampling": "poisson", "sampling_rate": 0.5, "weighting": "examples"},
     "weighting = 'examples': client_sampling = 'poisson' needs 'uniform'"),
    ({"sample_secrecy": "secret", "weighting": "examples"},  # the record's weights n_i / sum n would name who it was
     "weighting = 'examples': sample_secrecy = 'secret' needs 'uniform'"),
])
def test_federation_rules_name_the_fields_for_a_library_user(fields, message):
    """The round's cross-field rules (settings.round_problems, which the run config also uses, naming its dash
    keys) name the FederationSettings fields."""
    with pytest.raises(ValueError, match=message):
        FederationSettings(**fields)

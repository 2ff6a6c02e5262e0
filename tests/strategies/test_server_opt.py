"""Server-side post-processing (strategies/server_opt.py): a server optimizer on the noisy aggregate and an
averaged release. The privacy report is the same with and without them (in-process grid, fixed seed); the
updates equal hand computations on a 2-parameter model; final-model refuses them; bad values name the field."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord

from fl_dp_flower import DPSettings, FederationSettings, NoisyFedAvg, PrivacyAccountant
from fl_dp_flower.app.serverapp import CHECKPOINT, FINAL_MODEL, LEDGER
from fl_dp_flower.app.config import ConfigError
from fl_dp_flower.reporting import read_ledger
from fl_dp_flower.strategies.server_opt import ServerUpdate
from fl_dp_flower.app.testing import run_local, tiny_config

PRIVACY_FIELDS = ("round", "record", "report")


def _two(a: float, b: float) -> ArrayRecord:
    """A 2-parameter model as the strategy sees it."""
    return ArrayRecord({"a": torch.tensor([a], dtype=torch.float64), "b": torch.tensor([b], dtype=torch.float64)})


def _vec(x: np.ndarray) -> ArrayRecord:
    """A one-array float64 model."""
    return ArrayRecord({"w": torch.from_numpy(np.array(x, dtype=np.float64))})


def _values(arrays: ArrayRecord) -> list[float]:
    return [float(x[0]) for x in arrays.to_numpy_ndarrays()]


def _privacy(out) -> list[dict]:
    return [{k: line[k] for k in PRIVACY_FIELDS} for line in read_ledger(out.run_dir / LEDGER).rounds]


def _broadcasts(grid) -> list[list[np.ndarray]]:
    """The model each round's first train instruction carried."""
    seen, out = set(), []
    for m in grid.sent:
        rnd = m.content["config"]["server-round"]
        if m.metadata.message_type == "train" and rnd not in seen:
            seen.add(rnd)
            out.append(m.content["arrays"].to_numpy_ndarrays())
    return out


def _final(out) -> dict[str, torch.Tensor]:
    return torch.load(out.run_dir / FINAL_MODEL, map_location="cpu", weights_only=True)


# ------------------------------------------------------------------ privacy report unchanged
@pytest.mark.parametrize("base, extra", [
    ({}, {"server-optimizer": "momentum", "server-lr": 0.5, "release-average": "ema", "release-ema-decay": 0.5}),
    ({}, {"server-optimizer": "adam", "server-lr": 0.01, "release-average": "tail"}),
    ({"threat-model": "curious-server"}, {"server-optimizer": "momentum", "release-average": "ema"}),
    ({"client-sampling": "poisson", "sampling-rate": 0.7}, {"server-optimizer": "momentum", "release-average": "tail"}),
    ({}, {"server-optimizer": "momentum", "server-momentum": 0.0, "server-weight-decay": 0.05}),
])
def test_privacy_report_identical_with_and_without_post_processing(tmp_path, base, extra):
    base = {"num-server-rounds": 3, **base}
    plain, _ = run_local(tiny_config(tmp_path, **base, **{"run-name": "plain"}))
    post, _ = run_local(tiny_config(tmp_path, **base, **extra, **{"run-name": "post"}))
    assert _privacy(post) == _privacy(plain)  # every ledger line's privacy fields
    assert post.strategy.privacy_spent() == plain.strategy.privacy_spent()
    assert post.summary["final_report"] == plain.summary["final_report"]
    a, b = _final(plain), _final(post)
    assert any(not torch.equal(a[k], b[k]) for k in a)  # the released model did change


def test_ema_release_leaves_the_training_trajectory_alone(tmp_path):
    """Without an optimizer the clients train from the aggregate exactly as without averaging (same seed:
    the same broadcasts, bit for bit); only the released model is the average."""
    plain, g_plain = run_local(tiny_config(tmp_path, **{"num-server-rounds": 3, "run-name": "plain"}))
    ema, g_ema = run_local(tiny_config(tmp_path, **{"num-server-rounds": 3, "run-name": "ema",
                                                    "release-average": "ema", "release-ema-decay": 0.5}))
    for x, y in zip(_broadcasts(g_plain), _broadcasts(g_ema), strict=True):
        assert all(np.array_equal(u, v) for u, v in zip(x, y))
    iterates = [*_broadcasts(g_plain)[1:], [t.numpy() for t in _final(plain).values()]]  # w_1, w_2, w_3
    released = _final(ema)
    for i, key in enumerate(released):
        expect = (0.25 * iterates[0][i] + 0.5 * iterates[1][i] + iterates[2][i]) / 1.75
        np.testing.assert_allclose(released[key].numpy(), expect, rtol=1e-5, atol=1e-6)
    assert ema.summary["final_accuracy"] == ema.result.evaluate_metrics_serverapp[3]["accuracy"]


def test_library_use_with_a_users_model_and_a_budget_stop():
    """NoisyFedAvg with FederationSettings' post-processing fields on any model: the Result and the
    strategy's saved model are the released average; the accountant's spend is the plain run's."""
    from flwr.clientapp import ClientApp
    from torch import nn

    from fl_dp_flower import Budget, dp_train
    from fl_dp_flower.testing import LocalGrid, task_identity

    def net() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 3))

    def data(context):
        g = torch.Generator().manual_seed(int(context.node_config["partition-id"]))
        x = torch.randn(20, 4, generator=g)
        return x, (x[:, 0] > 0).long()

    settings = DPSettings(sigma=0.3, clip_norm=1.0, local_steps=2, batch_size=8, lr=0.1, seed=1)
    config = settings.accountant_config(clients=3)
    budget = Budget(PrivacyAccountant.from_records(config, [config.planned_round(t) for t in (1, 2)])
                    .report().certified.epsilon * 1.0001, 1e-5)
    results = {}
    for name, extra in (("plain", {}), ("post", {"server_optimizer": "momentum", "release_average": "ema"})):
        acct = PrivacyAccountant(config)
        strategy = NoisyFedAvg(settings, acct, federation=FederationSettings(clients_per_round=3, seed=1, **extra),
                               budget=budget)
        app = ClientApp()
        app.train()(dp_train(net, data))
        with task_identity():
            result = strategy.start(grid=LocalGrid(app, 3), initial_arrays=ArrayRecord(net().state_dict()))
        assert acct.num_releases == 2 and strategy.stop_reason is not None
        results[name] = (strategy.privacy_spent(), result.arrays.to_torch_state_dict(), strategy)
    assert results["post"][0] == results["plain"][0]
    post = results["post"][2]
    assert post.server_update.steps == 2
    released = post.global_arrays.to_torch_state_dict()
    assert all(torch.equal(released[k], v) for k, v in results["post"][1].items())
    iterate = post.server_update.iterate.to_torch_state_dict()
    assert any(not torch.equal(released[k], iterate[k]) for k in released)  # the average, not the iterate


# ------------------------------------------------------------------ hand computations
def test_momentum_equals_a_hand_computation():
    upd = ServerUpdate(FederationSettings(server_optimizer="momentum", server_lr=0.5, server_momentum=0.9),
                       "all-rounds")
    w0 = _two(1.0, 2.0)
    assert upd.broadcast(w0) is w0
    w1 = upd.apply(w0, _two(0.5, 2.5), 1)  # g1 = (0.5, -0.5), v1 = g1, w1 = w0 - 0.5 v1
    assert _values(w1) == pytest.approx([0.75, 2.25], abs=1e-12)
    w2 = upd.apply(upd.broadcast(w1), _two(0.5, 2.0), 2)  # g2 = (0.25, 0.25), v2 = 0.9 v1 + g2 = (0.7, -0.2)
    assert _values(w2) == pytest.approx([0.4, 2.35], abs=1e-12)
    assert _values(upd.broadcast(_two(9.0, 9.0))) == _values(w2)  # clients train from the iterate


def test_momentum_zero_at_lr_one_is_the_plain_aggregate():
    upd = ServerUpdate(FederationSettings(server_optimizer="momentum", server_lr=1.0, server_momentum=0.0),
                       "all-rounds")
    assert _values(upd.apply(_two(1.0, 2.0), _two(0.3, -4.0), 1)) == pytest.approx([0.3, -4.0], abs=1e-15)


def test_a_decaying_server_lr_falls_linearly_to_its_end_factor_at_the_last_planned_round():
    upd = ServerUpdate(FederationSettings(num_server_rounds=3, server_optimizer="momentum", server_lr=1.0,
                                          server_momentum=0.0, server_lr_end=0.5), "all-rounds")
    assert [upd.lr(t) for t in (1, 2, 3, 4)] == pytest.approx([1.0, 0.75, 0.5, 0.5])
    w1 = upd.apply(_two(1.0, 2.0), _two(0.0, 4.0), 1)  # the full step: the aggregate
    assert _values(w1) == pytest.approx([0.0, 4.0], abs=1e-12)
    w2 = upd.apply(w1, _two(1.0, 0.0), 2)  # g = (-1, 4), step 0.75
    assert _values(w2) == pytest.approx([0.75, 1.0], abs=1e-12)
    w3 = upd.apply(w2, _two(0.75, 3.0), 3)  # g = (0, -2), step 0.5
    assert _values(w3) == pytest.approx([0.75, 2.0], abs=1e-12)
    constant = ServerUpdate(FederationSettings(num_server_rounds=3, server_optimizer="momentum", server_lr=0.3),
                            "all-rounds")
    assert [constant.lr(t) for t in (1, 2, 3)] == [0.3, 0.3, 0.3]


def test_adam_equals_a_hand_computation():
    upd = ServerUpdate(FederationSettings(server_optimizer="adam", server_lr=0.1, server_momentum=0.9,
                                          server_adam_beta2=0.99, server_adam_eps=1e-3), "all-rounds")
    w1 = upd.apply(_two(1.0, 2.0), _two(0.5, 2.5), 1)
    # g = (0.5, -0.5); m = -(0.1) g = (-0.05, 0.05); v = 0.01 g^2 = 0.0025; eta = 0.1 sqrt(0.01) / 0.1 = 0.1
    step = 0.1 * 0.05 / (0.05 + 1e-3)
    assert _values(w1) == pytest.approx([1.0 - step, 2.0 + step], abs=1e-12)
    w2 = upd.apply(w1, _two(1.0 - step, 2.0 + step), 2)  # g = 0: m and v decay, the step keeps going
    m2, v2 = 0.9 * 0.05, 0.99 * 0.0025
    eta2 = 0.1 * math.sqrt(1 - 0.99 ** 2) / (1 - 0.9 ** 2)
    step2 = eta2 * m2 / (math.sqrt(v2) + 1e-3)
    assert _values(w2) == pytest.approx([1.0 - step - step2, 2.0 + step + step2], abs=1e-12)


def _reference(optimizer: str, lam: float, rounds: int, seed: int = 3) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Iterates of a decaying-step server optimizer with decoupled weight decay on random aggregates (numpy, float64,
    written from the formulas: w_{t+1} = w_t - lr_t step_t - lr_t lam w_t), and the aggregates themselves."""
    rng = np.random.default_rng(seed)
    w = rng.normal(size=5)
    m, v, ws, aggs = np.zeros(5), np.zeros(5), [w], []
    for t in range(1, rounds + 1):
        lr = 0.8 * (1 - 0.5 * (t - 1) / (rounds - 1))  # server-lr 0.8, server-lr-end 0.5
        a = w + rng.normal(scale=0.3, size=5)
        g = w - a
        if optimizer == "momentum":
            m = g if t == 1 else 0.6 * m + g
            step = m
        else:
            m, v = 0.6 * m - 0.4 * g, 0.9 * v + 0.1 * g * g
            step = -(math.sqrt(1 - 0.9 ** t) / (1 - 0.6 ** t)) * m / (np.sqrt(v) + 1e-3)
        w = w - lr * step - lr * lam * w
        ws.append(w)
        aggs.append(a)
    return ws, aggs


@pytest.mark.parametrize("optimizer", ["momentum", "adam"])
def test_server_weight_decay_equals_a_numpy_reference(optimizer):
    rounds, lam = 4, 0.2
    upd = ServerUpdate(FederationSettings(num_server_rounds=rounds, server_optimizer=optimizer, server_lr=0.8,
                                          server_lr_end=0.5, server_momentum=0.6, server_adam_beta2=0.9,
                                          server_weight_decay=lam), "all-rounds")
    plain = ServerUpdate(FederationSettings(num_server_rounds=rounds, server_optimizer=optimizer, server_lr=0.8,
                                            server_lr_end=0.5, server_momentum=0.6, server_adam_beta2=0.9),
                         "all-rounds")
    ws, aggs = _reference(optimizer, lam, rounds)
    assert not np.allclose(ws[1:], _reference(optimizer, 0.0, rounds)[0][1:])  # the decay matters here
    current = _vec(ws[0])
    for t, a in enumerate(aggs, 1):
        current = upd.apply(upd.broadcast(current), _vec(a), t)
        np.testing.assert_allclose(current.to_numpy_ndarrays()[0], ws[t], rtol=0, atol=1e-12)
    # one round from the same point: with the decay the step is the plain step less lr_1 lam w_1
    w0, a1 = _vec(ws[0]), _vec(aggs[0])
    without = plain.apply(w0, a1, 1).to_numpy_ndarrays()[0]
    np.testing.assert_allclose(ServerUpdate(upd.federation, "all-rounds").apply(w0, a1, 1).to_numpy_ndarrays()[0],
                               without - 0.8 * lam * ws[0], rtol=0, atol=1e-12)


def test_ema_equals_a_hand_computation():
    upd = ServerUpdate(FederationSettings(release_average="ema", release_ema_decay=0.5), "all-rounds")
    w = [_two(1.0, 0.0), _two(3.0, 4.0), _two(-1.0, 8.0)]
    released = [_values(upd.apply(_two(0.0, 0.0), x, r)) for r, x in enumerate(w, 1)]
    assert released[0] == pytest.approx([1.0, 0.0])
    assert released[1] == pytest.approx([(0.5 * 1 + 3) / 1.5, (0.5 * 0 + 4) / 1.5])
    assert released[2] == pytest.approx([(0.25 * 1 + 0.5 * 3 - 1) / 1.75, (0.25 * 0 + 0.5 * 4 + 8) / 1.75])
    assert _values(upd.broadcast(_two(5.0, 5.0))) == [-1.0, 8.0]  # the iterate, not the average


def test_tail_average_starts_with_the_last_rounds():
    upd = ServerUpdate(FederationSettings(num_server_rounds=4, release_average="tail", release_tail_fraction=0.5),
                       "all-rounds")
    assert upd.tail_start() == 3
    w = [_two(1.0, 1.0), _two(2.0, 2.0), _two(4.0, 6.0), _two(8.0, 10.0)]
    released = [_values(upd.apply(_two(0.0, 0.0), x, r)) for r, x in enumerate(w, 1)]
    assert released == [[1.0, 1.0], [2.0, 2.0], [4.0, 6.0], [6.0, 8.0]]


def test_integer_arrays_follow_the_aggregate():
    upd = ServerUpdate(FederationSettings(server_optimizer="momentum", release_average="ema"), "all-rounds")
    cur = ArrayRecord({"w": torch.tensor([1.0]), "n": torch.tensor([3])})
    out = upd.apply(cur, ArrayRecord({"w": torch.tensor([0.0]), "n": torch.tensor([4])}), 1)
    state = out.to_torch_state_dict()
    assert state["n"].dtype == torch.int64 and int(state["n"]) == 4 and state["w"].dtype == torch.float32


# ------------------------------------------------------------------ refusals and bad values
def test_final_model_refuses_post_processing_in_the_run_config(tmp_path):
    for key, value in (("server-optimizer", "momentum"), ("release-average", "ema")):
        with pytest.raises(ConfigError, match=f"'{key}' = '{value}': must be 'none' under 'threat-model' = 'final-model'"):
            tiny_config(tmp_path, **{key: value, "threat-model": "final-model", "assume-smooth-losses": True})


def test_server_weight_decay_bounds_and_final_model_refusal(tmp_path):
    with pytest.raises(ValueError, match=r"server_weight_decay x server_lr must be < 1"):
        FederationSettings(server_optimizer="adam", server_lr=2.0, server_weight_decay=0.5)
    with pytest.raises(ConfigError, match=r"'server-weight-decay' x 'server-lr' must be < 1"):
        tiny_config(tmp_path, **{"server-optimizer": "momentum", "server-weight-decay": 1.0})
    with pytest.raises(ConfigError, match="'server-optimizer' = 'momentum': must be 'none' under 'threat-model'"):
        tiny_config(tmp_path, **{"server-optimizer": "momentum", "server-weight-decay": 0.01,
                                 "threat-model": "final-model", "assume-smooth-losses": True})
    with pytest.raises(ConfigError, match="'server-weight-decay' = 0.01 needs 'server-optimizer'"):
        tiny_config(tmp_path, **{"server-weight-decay": 0.01, "threat-model": "final-model",
                                 "assume-smooth-losses": True})


def test_final_model_refuses_post_processing_in_library_use():
    settings = DPSettings(sigma=0.5, clip_norm=1.0, local_steps=1)
    acct = PrivacyAccountant(settings.accountant_config(clients=3, threat_model="final-model",
                                                        assume_smooth_losses=True, colluders=0))
    with pytest.raises(ValueError, match=r"release_average \('release-average'\) = 'tail': must be 'none'"):
        NoisyFedAvg(settings, acct, federation=FederationSettings(clients_per_round=3, release_average="tail"))
    NoisyFedAvg(settings, acct, federation=FederationSettings(clients_per_round=3))  # none: fine


@pytest.mark.parametrize("field, value, message", [
    ("server_optimizer", "sgd", r"server_optimizer must be one of \('none', 'momentum', 'adam'\)"),
    ("server_lr", 0.0, "server_lr must be a finite number > 0"),
    ("server_momentum", 1.0, r"server_momentum must be in \[0, 1\)"),
    ("server_lr_end", 0.0, "server_lr_end must be a finite number > 0"),
    ("server_lr_end", 1.5, r"server_lr_end must be in \(0, 1\]"),
    ("server_lr_end", 0.5, "server_lr_end = 0.5 needs server_optimizer 'momentum' or 'adam'"),
    ("server_adam_beta2", -0.1, "server_adam_beta2 must be a finite number >= 0"),
    ("server_adam_eps", 0.0, "server_adam_eps must be a finite number > 0"),
    ("server_weight_decay", -0.1, "server_weight_decay must be a finite number >= 0"),
    ("server_weight_decay", 0.01, "server_weight_decay = 0.01 needs server_optimizer 'momentum' or 'adam'"),
    ("release_average", "swa", r"release_average must be one of \('none', 'ema', 'tail'\)"),
    ("release_ema_decay", 1.0, r"release_ema_decay must be in \(0, 1\)"),
    ("release_tail_fraction", 1.5, r"release_tail_fraction must be in \(0, 1\]"),
])
def test_bad_settings_name_the_field_and_range(field, value, message):
    with pytest.raises(ValueError, match=message):
        FederationSettings(**{field: value})


@pytest.mark.parametrize("key, value, message", [
    ("server-momentum", 1.0, "'server-momentum' = 1.0: must be a finite number >= 0 and < 1"),
    ("release-ema-decay", 0.0, "'release-ema-decay' = 0.0: must be a finite number > 0 and < 1"),
    ("server-optimizer", "sgd", "'server-optimizer' = 'sgd'"),
    ("server-lr", -1.0, "'server-lr' = -1.0: must be a finite number > 0"),
    ("server-lr-end", 1.5, "'server-lr-end' = 1.5: must be a finite number > 0 and <= 1"),
    ("server-lr-end", 0.5, "'server-lr-end' = 0.5 needs 'server-optimizer' 'momentum' or 'adam'"),
    ("server-weight-decay", -0.1, "'server-weight-decay' = -0.1: must be a finite number >= 0"),
    ("server-weight-decay", 0.01, "'server-weight-decay' = 0.01 needs 'server-optimizer' 'momentum' or 'adam'"),
])
def test_bad_run_config_values_name_the_key_and_range(tmp_path, key, value, message):
    with pytest.raises(ConfigError, match=message):
        tiny_config(tmp_path, **{key: value})


# ------------------------------------------------------------------ resume
def test_resume_restores_the_optimizer_and_the_average(tmp_path):
    extra = {"server-optimizer": "momentum", "server-lr": 0.5, "server-weight-decay": 0.1, "release-average": "ema"}
    full, _ = run_local(tiny_config(tmp_path, **extra, **{"run-name": "full", "num-server-rounds": 3}))
    run_local(tiny_config(tmp_path, **extra, **{"run-name": "split", "num-server-rounds": 2}))
    assert torch.load(tmp_path / "split" / CHECKPOINT, weights_only=True)["server_update"]["steps"] == 2
    resumed, _ = run_local(tiny_config(tmp_path, **extra, **{"run-name": "split", "num-server-rounds": 3,
                                                             "resume": True}))
    assert resumed.accountant.records == full.accountant.records
    a, b = _final(full), _final(resumed)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)

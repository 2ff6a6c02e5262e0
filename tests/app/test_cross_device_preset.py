"""The cross-device preset: a valid config that plans epsilon <= 4 on a quarter of the main job's client-steps (issue 31)."""

from __future__ import annotations

from doc_commands import pyproject_defaults

from fl_dp_flower.app.config import AppConfig
from fl_dp_flower.app.presets import PRESETS
from fl_dp_flower.privacy.client_sampling import SecretSampleAccount, conditioned_epsilon
from fl_dp_flower.privacy.sampled import composed_epsilon
from fl_dp_flower.privacy.terms import round_terms
from fl_dp_flower.strategies.server_opt import ServerUpdate  # imports flwr (seconds, once per session)


def _config(name: str) -> AppConfig:
    return AppConfig.from_run_config({**pyproject_defaults(), **PRESETS[name]})


def _client_steps(config: AppConfig) -> float:
    """Expected client-steps of a run: sampled clients per round x local steps x rounds."""
    population = config.num_partitions * config.clients_per_node
    rate = config.sampling_rate if config.client_sampling == "poisson" else 1.0
    return population * rate * config.local_steps * config.num_server_rounds


def test_the_cross_device_preset_samples_a_secret_tenth_of_the_main_jobs_clients_in_cohorts():
    config, main = _config("cross-device"), _config("main")
    assert config.client_sampling == "poisson" and config.sampling_rate <= 0.1
    assert config.sample_secrecy == "secret"
    assert (config.num_partitions, config.clients_per_node, config.clients_per_round) == (10, 400, 4000)
    assert (main.num_partitions * main.clients_per_node, config.model, config.dataset) == (4000, main.model, main.dataset)
    assert _client_steps(main) == 400_000
    assert _client_steps(config) <= _client_steps(main) / 4


def test_the_cross_device_preset_plans_epsilon_at_most_4_by_the_secret_sample_bound():
    """The planned rounds (floor(q N) contributors each, as the planner and calibrate assume) through the
    accountant's own ``sampled_secret`` composition; with the sample public the amplification is much weaker."""
    config = _config("cross-device").accountant_config()
    assert (config.sample_secrecy, config.population, config.delta) == ("secret", 4000, 1e-5)
    account = SecretSampleAccount(config.colluders)
    rounds = [config.planned_round(t) for t in range(1, PRESETS["cross-device"]["num-server-rounds"] + 1)]
    pairs = [account.round(r, round_terms(r, config.smoothness, config.colluders, config.assume_smooth_losses))
             for r in rounds]
    assert {p for p, _ in pairs} == {400 / (4000 - config.colluders)}  # p_t = k_t / (N - c), docs/MATH.md §22
    secret = conditioned_epsilon(pairs, config.delta)
    assert 3.8 < secret <= 4.0
    public = composed_epsilon(0.1, [mu for _, mu in pairs], config.delta)  # the pair (1 - q) bottom + q N(mu, 1)
    assert public > 2 * secret


def test_the_cross_device_presets_decaying_server_step_is_post_processing_the_plan_ignores():
    """The preset's server step falls linearly from 1 to 0.5 (server-optimizer "momentum" with momentum 0) and
    decays the weights by 0.003 a unit step: the same accountant config, hence the same certified plan, as the
    plain aggregate."""
    preset = _config("cross-device")
    federation = preset.federation_settings()
    update = ServerUpdate(federation, preset.threat_model)
    assert (federation.server_optimizer, federation.server_momentum, federation.server_weight_decay) == (
        "momentum", 0.0, 0.003)
    assert (federation.release_average, federation.release_ema_decay) == ("ema", 0.9)  # docs/results.md
    assert [update.lr(t) for t in (1, 250)] == [1.0, 0.5]
    plain = {k: v for k, v in PRESETS["cross-device"].items() if not k.startswith("server-")}
    assert _config("cross-device").accountant_config() == AppConfig.from_run_config(
        {**pyproject_defaults(), **plain}).accountant_config()


def test_the_sweeps_server_step_overrides_drop_the_presets_server_weight_decay(monkeypatch):
    """scripts/cross_device_sweep.py lays overrides over the preset: the frontier's sampled column names its whole
    server step (side_by_side.server_step: off, or momentum 0 with a decaying step), and the preset's weight decay
    goes unless the overrides name it; any other override keeps it."""
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    from cross_device_sweep import preset_with

    plain = preset_with({"server-optimizer": "none", "server-lr-end": 1.0, "lr": 0.5})
    assert "server-weight-decay" not in plain and plain["lr"] == 0.5
    AppConfig.from_run_config({**pyproject_defaults(), **plain})  # a valid config
    kept = preset_with({"lr": 0.5})
    assert kept.get("server-weight-decay") == PRESETS["cross-device"].get("server-weight-decay")
    assert preset_with({"server-optimizer": "none", "server-weight-decay": 0.0})["server-weight-decay"] == 0.0
    decaying = preset_with({"server-optimizer": "momentum", "server-momentum": 0.0, "server-lr": 1.0,
                            "server-lr-end": 0.25})
    assert "server-weight-decay" not in decaying
    AppConfig.from_run_config({**pyproject_defaults(), **decaying})


def test_the_sweeps_decay_to_initial_pulls_towards_the_first_iterate_and_is_undone(monkeypatch):
    """scripts/cross_device_sweep.py --decay-to-initial (an experiment): w_{t+1} = w_t - lr_t (w_t - a_t) - lr_t lambda
    (w_t - w_0) with w_0 the model of round 1, checked by hand over two rounds; ServerUpdate is restored afterwards."""
    from pathlib import Path

    import numpy as np
    from flwr.app import Array, ArrayRecord

    from fl_dp_flower.app.testing import tiny_config

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "scripts"))
    from cross_device_sweep import decayed_to_initial, preset_with

    lam = 0.1
    fed = tiny_config(Path("unused"), **{**preset_with({}), "server-weight-decay": lam,
                                         "release-average": "none"}).federation_settings()

    def record(x: list[float]) -> ArrayRecord:
        return ArrayRecord({"w": Array(np.asarray(x, np.float32))})

    w0, a1, a2 = np.array([1.0, 2.0]), np.array([1.5, 1.0]), np.array([0.0, 3.0])
    original = ServerUpdate._step
    with decayed_to_initial(True):
        update = ServerUpdate(fed, "all-rounds")
        update.apply(update.broadcast(record(list(w0))), record(list(a1)), 1)
        w1 = update.iterate.to_numpy_ndarrays()[0]
        update.apply(update.iterate, record(list(a2)), 2)
        w2 = update.iterate.to_numpy_ndarrays()[0]
    assert ServerUpdate._step is original
    lr1, lr2 = update.lr(1), update.lr(2)
    assert lr2 < lr1 == 1.0  # the preset's decaying server step
    expected1 = w0 - lr1 * (w0 - a1)  # no pull at round 1: the iterate is w_0
    expected2 = expected1 - lr2 * (expected1 - a2) - lr2 * lam * (expected1 - w0)
    np.testing.assert_allclose(w1, expected1, atol=1e-6)
    np.testing.assert_allclose(w2, expected2, atol=1e-6)
    plain = ServerUpdate(fed, "all-rounds")  # the library's own decay (towards 0) differs at round 2
    plain.apply(plain.broadcast(record(list(w0))), record(list(a1)), 1)
    plain.apply(plain.iterate, record(list(a2)), 2)
    assert not np.allclose(plain.iterate.to_numpy_ndarrays()[0], expected2, atol=1e-3)

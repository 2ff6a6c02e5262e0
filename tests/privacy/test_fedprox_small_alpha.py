"""Issue 30 item 6: FedProx with alpha <= L (a usual FedProx mu of 0.01-1 with the default L = 1) is
certified by composition, which rests on clipping alone (sensitivity 2V(1 - prod(1 - eta alpha))/alpha,
needing only eta alpha <= 1); alpha > L is asked only with assume_smooth_losses."""

from __future__ import annotations

import math

import pytest

from fl_dp_flower import DPSettings, PrivacyAccountant
from fl_dp_flower.privacy.planning import plan

SETTINGS = DPSettings(sigma=1.0, clip_norm=1.0, local_steps=5, lr=0.1, algorithm="fedprox", prox_alpha=0.1)


def _report(settings: DPSettings, rounds: int, **kwargs):
    config = settings.accountant_config(clients=4, **kwargs)
    accountant = PrivacyAccountant(config)
    for t in range(1, rounds + 1):
        report = accountant.step(config.planned_round(t))
    return config, accountant, report


@pytest.mark.parametrize("threat_model", ["all-rounds", "curious-server"])
def test_alpha_below_L_certifies_by_clipping_alone(threat_model):
    config, accountant, report = _report(SETTINGS, 3, threat_model=threat_model)
    # independent reference: the exact clipping-only composition of 3 rounds, by hand.
    # per-client sensitivity 2V sum_k eta (1 - eta alpha)^(K-1-k) = 2V (1 - (1 - eta alpha)^K)/alpha
    gamma_client = 2 * 1.0 * (1 - (1 - 0.1 * 0.1) ** 5) / 0.1
    m, c = 4, 1  # default coalition: one participant's own upload is known to it (docs/MATH.md §14.2a)
    hidden = 1.0 * math.sqrt(m - c) / m  # noise of the m - c others in the average
    composition = math.sqrt(3) * (gamma_client / m) / hidden
    local = math.sqrt(3) * gamma_client / 1.0
    assert report.bounds["composition"].mu == pytest.approx(composition, rel=1e-12)
    assert report.bounds["local_dp"].mu == pytest.approx(local, rel=1e-12)
    certified = composition if threat_model == "all-rounds" else local
    assert report.certified.mu == pytest.approx(certified, rel=1e-12) and math.isfinite(report.certified.epsilon)
    assert report.bounds["composition"].sound and not report.bounds["paper"].sound
    assert report.bounds["paper"].mu == math.inf  # Theorem 4 needs alpha > L: no closed form
    # composition does not depend on L: the same run with L = 0 (< alpha) has the same number
    _, _, smooth0 = _report(SETTINGS, 3, threat_model=threat_model, smoothness=0.0)
    assert smooth0.bounds["composition"].mu == pytest.approx(report.bounds["composition"].mu, rel=1e-12)
    # replay (resume, verify) and the planner agree with the online accountant
    assert PrivacyAccountant.from_records(config, accountant.records).report().certified.mu == report.certified.mu
    assert plan(config, 3).bounds["composition"].mu == pytest.approx(composition, rel=1e-9)


def test_alpha_below_L_is_refused_only_where_a_certifying_bound_rests_on_L():
    with pytest.raises(ValueError, match="prox_alpha must be > smoothness L = 1.0 for fedprox with assume_smooth"):
        SETTINGS.accountant_config(clients=4, threat_model="final-model", assume_smooth_losses=True, colluders=0)
    with pytest.raises(ValueError, match="prox_alpha must be > smoothness"):
        SETTINGS.accountant_config(clients=4, assume_smooth_losses=True)
    with pytest.raises(ValueError, match="lr \\* prox_alpha must be <= 1"):  # eta alpha <= 1 stays required everywhere
        DPSettings(sigma=1.0, clip_norm=1.0, lr=0.1, algorithm="fedprox", prox_alpha=20.0)


def test_alpha_below_L_run_config_is_accepted_without_the_assertion():
    from fl_dp_flower.app.config import AppConfig, ConfigError

    config = AppConfig.from_run_config({"algorithm": "fedprox", "prox-alpha": 0.1, "lr": 0.1})
    assert config.accountant_config().prox_alpha == 0.1
    with pytest.raises(ConfigError, match="'prox-alpha' = 0.1: must be > 'smoothness'"):
        AppConfig.from_run_config({"algorithm": "fedprox", "prox-alpha": 0.1, "lr": 0.1, "assume-smooth-losses": True})


def test_a_users_noisy_fedprox_with_alpha_0_1_runs_and_certifies(tmp_path):
    from flwr.app import ArrayRecord
    from flwr.clientapp import ClientApp

    from fl_dp_flower import FederationSettings, NoisyFedProx, dp_train, open_ledger
    from fl_dp_flower.reporting.verify import verify_ledger
    from fl_dp_flower.testing import LocalGrid, task_identity
    from tests.test_public_api import TinyNet, load_data

    settings = DPSettings(sigma=1.0, clip_norm=1.0, local_steps=2, batch_size=8, lr=0.1, algorithm="fedprox",
                          prox_alpha=0.1)
    ledger, accountant = open_ledger(tmp_path / "ledger.jsonl", settings.accountant_config(clients=3))
    strategy = NoisyFedProx(settings, accountant, federation=FederationSettings(clients_per_round=3,
                                                                                 num_server_rounds=2), sinks=[ledger])
    app = ClientApp()
    app.train()(dp_train(TinyNet, load_data))
    with ledger, task_identity():
        strategy.start(grid=LocalGrid(app, 3), initial_arrays=ArrayRecord(TinyNet().state_dict()))
    spent = strategy.privacy_spent()
    assert accountant.num_releases == 2 and spent.bound == "composition" and math.isfinite(spent.epsilon)
    assert verify_ledger(tmp_path / "ledger.jsonl").ok


def test_the_final_model_bound_says_nothing_after_a_round_without_rho():
    import numpy as np

    from fl_dp_flower.privacy.final_model import OnlineFinalModel

    online = OnlineFinalModel()
    online.push(0.1, 0.5, 1.0)
    finite = online.mu
    assert online.peek(math.inf, 0.5, 1.0) == math.inf and online.mu == finite  # peek changes nothing
    online.push(math.inf, 0.5, 1.0)
    assert online.mu == math.inf and online.peek(0.1, 0.5, 1.0) == math.inf and len(online) == 2
    batch, out = OnlineFinalModel(), np.zeros(3)
    batch._extend_arrays(np.array([0.1, math.inf, 0.1]), np.full(3, 0.5), np.ones(3), out=out)
    assert out[0] == pytest.approx(finite ** 2, rel=1e-15) and list(out[1:]) == [math.inf, math.inf]
    assert batch.mu == math.inf and len(batch) == 3

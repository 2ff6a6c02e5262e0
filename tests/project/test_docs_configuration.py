"""docs/configuration.md is generated from AppConfig's field descriptions and must be current."""

from __future__ import annotations

from pathlib import Path

from fl_dp_flower.app.config import AppConfig
from fl_dp_flower.app.config_docs import configuration_markdown

PAGE = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_every_run_config_key_has_a_description():
    missing = [name.replace("_", "-") for name, info in AppConfig.model_fields.items() if not info.description]
    assert not missing, f"run-config keys without a description (a docstring under the field): {missing}"


def test_configuration_page_is_current():
    assert PAGE.read_text() == configuration_markdown(), (
        "docs/configuration.md is stale: python -m fl_dp_flower.app.config_docs > docs/configuration.md")

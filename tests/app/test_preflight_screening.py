"""The preflight (ServerApp start, ``fl-dp-flower run``, ``fl-dp-flower privacy``) warns when the reply checks'
screening levels would be charged to delta beyond 1 % of it at the planned epsilon (docs/MATH.md §17.1).
Measured before: the deployment example (sigma 1, 2 sites, target-epsilon 35) ran with no warning and
printed every epsilon at delta 1e-5 + 1 from round 2 on; the planner said delta 1e-5."""

from __future__ import annotations

import math

import pytest

from doc_commands import parse_overrides, pyproject_defaults
from fl_dp_flower.app.config import AppConfig, ConfigError
from fl_dp_flower.app.preflight import preflight, screening_note
from fl_dp_flower.app.presets import PRESETS

EXAMPLE = "clients-per-round=2 num-partitions=2 num-server-rounds=10 schedule='stage' sigma=1.0 target-epsilon=35.0"
UNBUDGETED = EXAMPLE.replace(" target-epsilon=35.0", "")


def config(text: str = "", preset: str | None = None) -> AppConfig:
    return AppConfig.from_run_config({**pyproject_defaults(), **(PRESETS[preset] if preset else {}),
                                      **parse_overrides(text)})


def test_the_default_levels_at_the_examples_epsilon_are_named_with_a_level_that_fits():
    """Without its budget the example plans epsilon 32.92 and warns; with it (target-epsilon 35) the config refuses
    the default levels outright (privacy.screening_charge.budget_charge_problems)."""
    with pytest.raises(ConfigError, match="at the budget's epsilon 35, 'noise-check-alpha' \\+ 'update-bound-alpha'"):
        config(EXAMPLE)
    notes = [n for n in preflight(config(UNBUDGETED)) if "screening" in n]
    assert len(notes) == 1 and notes[0].startswith("warning:")
    assert "delta 1e-05 + 1 (certifies nothing)" in notes[0] and "epsilon 32.92 after 10 rounds" in notes[0]
    assert "set noise-check-alpha and update-bound-alpha to 1e-23 or less" in notes[0]
    # the suggested level does fit: (1 + e^32.92) x 10 rounds x 2e-23 is below 1 % of delta
    assert (1 + math.exp(32.9156)) * 10 * 2e-23 < 0.01 * 1e-5
    assert screening_note(config(UNBUDGETED + " noise-check-alpha=1e-23 update-bound-alpha=1e-23"), 10) is None


def test_no_warning_where_the_charge_is_negligible_or_not_charged():
    assert screening_note(config(preset="main"), 100) is None  # eps 3.8: charge 9.4e-9
    assert screening_note(config(UNBUDGETED + " threat-model='curious-server'"), 10) is None  # local DP: not charged
    assert screening_note(config(EXAMPLE + " noise-check-alpha=0.0 update-bound-alpha=1e-24"), 10) is None


def test_a_budget_stop_is_checked_at_the_rounds_that_train():
    """A budget that stops after 2 rounds: the charge after 2 rounds (eps 28.37), not after the 10 planned."""
    # levels that the budget's own rule accepts ((1 + e^29) x 10 x 2.5e-20 <= 1e-6) and that the 2 rounds it trains
    # still charge above 1 % of delta ((1 + e^28.37) x 2 x 2.5e-20 > 1e-7)
    text = EXAMPLE.replace("target-epsilon=35.0", "target-epsilon=29.0") + \
        " noise-check-alpha=1.25e-20 update-bound-alpha=1.25e-20"
    notes = [n for n in preflight(config(text)) if "screening" in n]
    assert len(notes) == 1 and "epsilon 28.37 after 2 rounds" in notes[0], notes

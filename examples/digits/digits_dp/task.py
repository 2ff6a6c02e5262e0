"""The model and the data: yours to replace (nothing here knows about privacy)."""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn


class DigitsNet(nn.Module):
    """A small MLP for 8x8 digit images (parameters only: no BatchNorm buffers)."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Tanh(), nn.Linear(32, 10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


def _all_data() -> tuple[torch.Tensor, torch.Tensor]:
    digits = load_digits()  # bundled with scikit-learn: no download
    x = torch.tensor(digits.data / 16.0, dtype=torch.float32)
    return x, torch.tensor(digits.target, dtype=torch.long)


def split(test_fraction: float = 0.2, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """Indices of the shared train / held-out test split."""
    order = np.random.default_rng(seed).permutation(len(load_digits().target))
    cut = int(len(order) * (1 - test_fraction))
    return order[:cut], order[cut:]


def load_partition(partition_id: int, num_partitions: int) -> tuple[torch.Tensor, torch.Tensor]:
    """IID shard ``partition_id`` of the training split (one shard per client)."""
    x, y = _all_data()
    train, _ = split()
    mine = np.array_split(train, num_partitions)[partition_id]
    return x[mine], y[mine]


def load_test() -> tuple[torch.Tensor, torch.Tensor]:
    x, y = _all_data()
    _, test = split()
    return x[test], y[test]

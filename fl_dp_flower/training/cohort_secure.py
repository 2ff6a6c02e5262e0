"""Secure aggregation for a cohort node: its members' integer sum as the node's one upload (docs/MATH.md §20.6).

Under secure aggregation one client uploads k = clamp(round(Delta / s) + Sk) + 2^29 (training/secure_sum.py).
A cohort node (one SuperNode for M virtual clients, docs/cohorts.md) does for each member exactly what one
client does, with that member's own random streams, and uploads the sum:

1. each member's CLEAN local update Delta_i (the cohort trainer, :func:`~.cohort.train_cohort`, with every
   member's own batch generator, as :class:`~.cohort_data.MemberStreams` draws it: the single-client
   update's ``randperm`` stream, and no Gaussian noise);
2. each member's integers a_i = round(Delta_i / s) + Sk_i (:func:`~.secure_sum.grid_values`) with that
   member's own Skellam stream (``noise_rngs[i]``: the single client's generator for a fixed seed, OS
   entropy otherwise), so each member adds its own noise of variance sigma^2, as the accountant counts;
3. the node clamps sum_i a_i to [-2^29, 2^29) once and uploads it offset by 2^29 (:func:`~.secure_sum.clamp_upload`)
   as its one masked vector (the node is one SecAgg+ participant).

With one member this is the single-client upload (the same integers from the same clean update and
streams); with M members it is the sum of the M single-client uploads' integers unless a clamp occurs (the grid
plan keeps every clamp below e^-200, and the accountant charges the clamp of sums of M members:
:func:`fl_dp_flower.privacy.skellam_tails.log_clamp_bound`).
"""

from __future__ import annotations

import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from .cohort import train_cohort
from .cohort_data import CohortData, MemberStreams
from .cohort_settings import CohortSettings
from .secure_sum import SumGrid, clamp_upload

#: values of one array rounded at a time by :func:`node_upload` (a block of members: 512 KB of float64)
BLOCK_VALUES = 1 << 16

__all__ = ["CleanMembers", "SecureCohortUpload", "clean_members", "node_upload", "secure_cohort_upload"]


class _CleanStreams:
    """Each member's own batch generator (:class:`~.cohort_data.MemberStreams`) and no Gaussian noise: the members
    the cohort trainer keeps are then their clean local models (the Skellam noise is added on the grid)."""

    def __init__(self, batch: Sequence[torch.Generator]) -> None:
        self._members = MemberStreams(batch, [None] * len(batch))

    def batches(self, pos: np.ndarray, sizes: np.ndarray, sizes_on_device: torch.Tensor, bsz: int,
                steps: int) -> torch.Tensor:
        return self._members.batches(pos, sizes, sizes_on_device, bsz, steps)

    def add_noise_(self, pos: np.ndarray, trained: Mapping[str, torch.Tensor], order: Sequence[str],
                   sigma: float) -> None:
        return None

    def noise_sum(self, pos: np.ndarray, like: Mapping[str, torch.Tensor], order: Sequence[str],
                  sigma: float) -> dict[str, torch.Tensor]:
        return {name: torch.zeros_like(like[name]) for name in order}


@dataclass(frozen=True)
class CleanMembers:
    """The members' clean local models after :func:`clean_members` (on the host, the weights' dtype), the shared
    start w_t (float64) and the cohort trainer's statistics (training/cohort.py ``CohortResult``)."""

    trained: list[np.ndarray]  # per state-dict array: [M, ...]
    start: list[np.ndarray]
    clipped_fraction: float
    batch_sizes: tuple[int, ...]
    nonfinite_gradients: int

    def delta(self, j: int) -> list[np.ndarray]:
        """Member j's clean update Delta = w_j - w_t in float64, as the single client computes it."""
        return [t[j].astype(np.float64) - b for t, b in zip(self.trained, self.start)]


@dataclass(frozen=True)
class SecureCohortUpload:
    """``upload``: k = clamp(sum_i a_i, -2^29, 2^29 - 1) + 2^29 per array of the model's state dict, int64;
    ``clamped``: values clamped; the cohort trainer's statistics."""

    upload: list[np.ndarray]
    clamped: int
    clipped_fraction: float
    batch_sizes: tuple[int, ...]
    nonfinite_gradients: int


def clean_members(model: nn.Module, data: CohortData, rows: Sequence[int] | np.ndarray,
                  batch_generators: Sequence[torch.Generator], settings: CohortSettings) -> CleanMembers:
    """Step 1: the clean local models of members ``rows`` of ``data`` (the cohort trainer with ``settings``, no
    Gaussian noise: ``settings.sigma`` is not read), ``batch_generators[j]`` drawing member j's batches as the
    single client's generator does. The model must hold parameters only (every value goes on the grid); ``model``
    is not changed."""
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if len(batch_generators) != len(rows):
        raise ValueError(f"need one batch generator per member ({len(rows)}), got {len(batch_generators)}")
    keys = list(model.state_dict().keys())
    if keys != [n for n, _ in model.named_parameters()]:
        raise ValueError("a secure cohort upload needs a model whose state dict is its parameters (no buffers)")
    result = train_cohort(model, data, rows, _CleanStreams(batch_generators), settings, keep_members=True)
    assert result.members is not None  # keep_members
    return CleanMembers([result.members[k].detach().cpu().numpy() for k in keys],
                        [v.detach().to("cpu", torch.float64).numpy() for v in model.state_dict().values()],
                        result.clipped_fraction, result.batch_sizes, result.nonfinite_gradients)


def node_upload(members: CleanMembers, noise_rngs: Sequence[np.random.Generator | None], grid: SumGrid,
                sigma: float, member_block: int | None = None) -> tuple[list[np.ndarray], int]:
    """Steps 2 and 3: member j's integers round(Delta_j / s) + Skellam from ``noise_rngs[j]`` (None: OS entropy),
    summed over the members, clamped once and offset (:func:`~.secure_sum.clamp_upload`): (upload, clamped).

    The same integers as summing :func:`~.secure_sum.grid_values` member by member (integer sums commute), at the
    cost of the draws alone: the rounding is done for ``member_block`` members at a time (None: about 2^16 values
    of an array at a time, so that a block stays in the CPU's cache), and each member's noise
    is drawn array by array as :func:`~.secure_sum.skellam_noise` draws it (its two Poisson draws of an array in
    one call: numpy fills a sized draw value by value, so the stream is the same) and accumulated in place."""
    count = len(members.trained[0]) if members.trained else 0
    if len(noise_rngs) != count:
        raise ValueError(f"need one noise generator per member ({count}), got {len(noise_rngs)}")
    if count == 0:
        raise ValueError("a cohort needs at least one member")
    total = [_rounded_sum(t, b, grid, member_block or max(1, BLOCK_VALUES // max(1, b.size)))
             for t, b in zip(members.trained, members.start)]
    lam = grid.poisson_rate(sigma)
    for rng in noise_rngs:
        gen = rng if rng is not None else np.random.default_rng(secrets.randbits(128))
        for acc in total:  # the array order of grid_values; per array first Poisson minus second
            draws = gen.poisson(lam, size=(2, *acc.shape))
            acc += draws[0]
            acc -= draws[1]
    return clamp_upload(total)


def _rounded_sum(trained: np.ndarray, start: np.ndarray, grid: SumGrid, member_block: int) -> np.ndarray:
    """sum_j round((trained[j] - start) / s) in int64 (trained: [M, ...], the weights' dtype; start: float64), each
    member's difference taken in float64 as :meth:`CleanMembers.delta` does."""
    acc = np.zeros(start.shape, dtype=np.int64)
    for lo in range(0, len(trained), member_block):
        d = trained[lo:lo + member_block].astype(np.float64)
        d -= start
        if not np.all(np.isfinite(d)):
            raise ValueError("update holds a non-finite value: it cannot be put on the grid")
        d /= grid.step
        acc += np.rint(d, out=d).astype(np.int64).sum(0)
    return acc


def secure_cohort_upload(
    model: nn.Module,
    data: CohortData,
    rows: Sequence[int] | np.ndarray,
    batch_generators: Sequence[torch.Generator],
    noise_rngs: Sequence[np.random.Generator | None],
    grid: SumGrid,
    settings: CohortSettings,
) -> SecureCohortUpload:
    """The node's integer upload for members ``rows`` of ``data`` (module docstring): :func:`clean_members` then
    :func:`node_upload`, with ``settings`` (:class:`~.cohort_settings.CohortSettings`; ``settings.sigma``: each
    member's Skellam noise, variance sigma^2 per value). ``batch_generators[j]`` and ``noise_rngs[j]`` are member
    j's (``rows[j]``) streams."""
    if not len(batch_generators) == len(noise_rngs) == len(np.asarray(rows).reshape(-1)):
        raise ValueError(f"need one batch generator and one noise generator per member ({len(rows)}), got "
                         f"{len(batch_generators)} and {len(noise_rngs)}")
    members = clean_members(model, data, rows, batch_generators, settings)
    upload, clamped = node_upload(members, noise_rngs, grid, settings.sigma)
    return SecureCohortUpload(upload, clamped, members.clipped_fraction, members.batch_sizes,
                              members.nonfinite_gradients)

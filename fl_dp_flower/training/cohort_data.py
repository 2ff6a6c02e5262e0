"""A cohort's data resident on the training device, and the random streams its members draw from.

:class:`CohortData`: every member's images and labels concatenated once into two tensors on the
device (member i owns rows ``offsets[i] : offsets[i] + sizes[i]``), so a round moves no data per
member: a chunk's batches are one gather from these tensors with a [members, K, B] index.

Streams (where a member's batch indices and noise come from):

- :class:`MemberStreams`: one ``torch.Generator`` per member for its batches and one for its noise,
  drawn in exactly the order of the single-client update (``local_update`` + ``add_gaussian_noise_``):
  stream for stream the reference. It loops over members (host work per member): for tests, the
  sensitivity audit and callers that bring their own generators.
- :class:`KeyedStreams`: the fast path (the ClientApp's cohorts). A chunk of c members draws its
  batch indices with one ``torch.rand`` of shape [c, K, n_max] (the B smallest of n_i i.i.d. keys:
  a uniformly random B-subset in random order, as ``randperm(n_i)[:B]``) and its noise with one
  ``torch.randn`` of shape [c, *shape] per parameter, on the device. The stream of a chunk is keyed by
  (seed, round, the client id of the chunk's first member, the chunk's size, purpose): with a fixed
  seed a round is reproducible for the same members and chunking; a member's draws are independent
  of every other member's and have the distribution of the single-client update's (a batch that is
  a member's whole data is taken in index order: the same set, and the per-batch mean does not
  depend on order). Without a seed every chunk's generators are seeded from OS entropy over their whole state.
  ``noise_mode = "secure"``: the noise of a chunk comes from :class:`~.noise.SecureGaussian` in one call.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import torch

from .data import load_partition
from .noise import FIXED_SEED_WARNING, SecureGaussian, entropy_generator, gaussian_noised

log = logging.getLogger(__name__)

_COHORT_TAG = 0x636F686F7274  # "cohort": keeps these streams apart from the single-client seeds
BATCH_STREAM, NOISE_STREAM = 1, 0


@dataclass(frozen=True)
class CohortData:
    """Members' data on one device: ``x`` [N, ...], ``y`` [N], member i = rows offsets[i]:offsets[i]+sizes[i].
    ``sizes``/``offsets`` are kept on the host (numpy, for grouping) and on the device (for indexing)."""

    x: torch.Tensor
    y: torch.Tensor
    sizes: np.ndarray
    offsets: np.ndarray
    sizes_on_device: torch.Tensor
    offsets_on_device: torch.Tensor

    @classmethod
    def stack(cls, xs: Sequence[torch.Tensor], ys: Sequence[torch.Tensor],
              device: torch.device | str = "cpu") -> CohortData:
        """One concatenation and one copy to ``device`` of every member's (x, y)."""
        if len(xs) != len(ys) or not xs:
            raise ValueError(f"need as many x as y tensors, at least one (got {len(xs)} and {len(ys)})")
        sizes = np.asarray([len(y) for y in ys], dtype=np.int64)
        if any(len(x) != n for x, n in zip(xs, sizes)):
            raise ValueError("every member's x and y must have the same length")
        device = torch.device(device)
        return cls.of(torch.cat(list(xs)).to(device), torch.cat(list(ys)).to(device), sizes)

    @classmethod
    def of(cls, x: torch.Tensor, y: torch.Tensor, sizes: Sequence[int] | np.ndarray) -> CohortData:
        """``x``, ``y`` already on their device, cut into members of ``sizes`` consecutive rows."""
        sizes = np.asarray(sizes, dtype=np.int64)
        if sizes.ndim != 1 or int(sizes.sum()) != len(y) or len(x) != len(y):
            raise ValueError(f"sizes must add up to the {len(y)} rows of y (and x), got {int(sizes.sum())}")
        offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
        return cls(x, y, sizes, offsets, torch.as_tensor(sizes, device=y.device),
                   torch.as_tensor(offsets, device=y.device))

    def __len__(self) -> int:
        return len(self.sizes)

    @property
    def device(self) -> torch.device:
        return self.y.device


class CohortStreams(Protocol):
    """Where a chunk's randomness comes from. ``pos``: the chunk's members as positions 0..M-1 in
    the round's member list; ``sizes``: their data sizes (host)."""

    def batches(self, pos: np.ndarray, sizes: np.ndarray, sizes_on_device: torch.Tensor, bsz: int,
                steps: int) -> torch.Tensor:
        """[c, K, B] int64 row indices within each member's data (0 .. n_i - 1), on the device of
        ``sizes_on_device`` (the same sizes, [c])."""
        ...

    def add_noise_(self, pos: np.ndarray, trained: Mapping[str, torch.Tensor], order: Sequence[str],
                   sigma: float) -> None:
        """Add N(0, sigma^2) to every value of ``trained`` (name -> [c, ...]) in place, names in ``order``."""
        ...

    def noise_sum(self, pos: np.ndarray, like: Mapping[str, torch.Tensor], order: Sequence[str],
                  sigma: float) -> dict[str, torch.Tensor]:
        """The sum over the chunk's members of the noise :meth:`add_noise_` would add (the same draws):
        name -> a tensor like ``like[name]`` (one member's)."""
        ...


def _summed_noise(streams: CohortStreams, pos: np.ndarray, like: Mapping[str, torch.Tensor], order: Sequence[str],
                  sigma: float) -> dict[str, torch.Tensor]:
    """noise_sum through add_noise_ on zeros (members' noise formed, then summed)."""
    zeros = {n: torch.zeros(len(pos), *like[n].shape, dtype=like[n].dtype, device=like[n].device) for n in order}
    streams.add_noise_(pos, zeros, order, sigma)
    return {n: t.sum(0) for n, t in zeros.items()}


class MemberStreams:
    """Each member's own generators (``batch`` and ``noise``, the latter a Generator or SecureGaussian
    or None when the cohort draws summed noise), drawn as the single-client update draws them."""

    def __init__(self, batch: Sequence[torch.Generator],
                 noise: Sequence[torch.Generator | SecureGaussian | None]) -> None:
        self.batch, self.noise = list(batch), list(noise)

    def batches(self, pos, sizes, sizes_on_device, bsz, steps):
        draws = [torch.stack([torch.randperm(int(n), generator=self.batch[i], device=self.batch[i].device)[:bsz]
                              for _ in range(steps)]).cpu() for i, n in zip(pos, sizes)]
        return torch.stack(draws).to(sizes_on_device.device)

    def add_noise_(self, pos, trained, order, sigma):
        for j, i in enumerate(pos):  # member i's values in add_gaussian_noise_'s order, from its own stream
            source = self.noise[i]
            if source is None:
                raise ValueError("every member needs a noise_generator (or pass summed_noise)")
            for name in order:
                trained[name][j] = gaussian_noised(trained[name][j], sigma, source)

    def noise_sum(self, pos, like, order, sigma):
        return _summed_noise(self, pos, like, order, sigma)


def stream_seed(seed: int, round_index: int, first_client: int, members: int, purpose: int) -> int:
    """The 63-bit seed of one chunk's stream (numpy's SeedSequence hash of the key)."""
    words = [_COHORT_TAG, seed, round_index, first_client, members, purpose]
    return int(np.random.SeedSequence(words).generate_state(1, np.uint64)[0] >> np.uint64(1))


class KeyedStreams:
    """Chunk-wide draws on the device, keyed by (seed, round, first client of the chunk, chunk size).

    ``clients``: the global client id of every member of the round, in member order (ids >= 0).
    ``seed``: None or -1 for OS entropy (the default for real runs), else a fixed seed >= 0 (a
    warning is logged when noise is drawn from it: fixed-seed noise gives no privacy). ``noise_mode``: "standard" (torch.randn)
    or "secure" (os.urandom, never reproducible: needs no seed)."""

    def __init__(self, seed: int | None, round_index: int, clients: Sequence[int] | np.ndarray,
                 noise_mode: str = "standard") -> None:
        if noise_mode not in ("standard", "secure"):
            raise ValueError(f"noise mode must be 'standard' or 'secure', got {noise_mode!r}")
        self.seed = None if seed is None or seed == -1 else int(seed)
        if self.seed is not None and self.seed < 0:
            raise ValueError(f"seed must be None, -1 or an integer >= 0, got {seed!r}")
        self._warned = False
        self.round_index, self.clients = int(round_index), np.asarray(clients, dtype=np.int64)
        self.secure = SecureGaussian() if noise_mode == "secure" else None

    def generator(self, pos: np.ndarray, purpose: int, device: torch.device) -> torch.Generator:
        if self.seed is None:  # OS entropy over the generator's whole state (noise.entropy_generator)
            return entropy_generator(device)
        gen = torch.Generator(device=device)
        gen.manual_seed(stream_seed(self.seed, self.round_index, int(self.clients[pos[0]]), len(pos), purpose))
        return gen

    def batches(self, pos, sizes, sizes_on_device, bsz, steps):
        c, n_max, device = len(pos), int(sizes.max()), sizes_on_device.device
        if int(sizes.min()) == bsz == n_max:  # every batch is the member's whole data
            return torch.arange(bsz, device=device).expand(c, steps, bsz)
        keys = torch.rand((c, steps, n_max), generator=self.generator(pos, BATCH_STREAM, device), device=device)
        if int(sizes.min()) < n_max:  # a member's rows beyond its data are never drawn
            keys.masked_fill_(torch.arange(n_max, device=device) >= sizes_on_device.view(c, 1, 1), 2.0)
        return keys.topk(bsz, dim=-1, largest=False, sorted=True).indices

    def _warn_fixed_seed(self) -> None:
        if self.seed is not None and self.secure is None and not self._warned:
            log.warning(FIXED_SEED_WARNING)  # once per round: noise from a fixed seed gives no privacy
            self._warned = True

    def add_noise_(self, pos, trained, order, sigma):
        self._warn_fixed_seed()
        if self.secure is not None:
            for name in order:
                trained[name].copy_(self.secure.noisy(trained[name], sigma))
            return
        t0 = trained[order[0]]
        gen = self.generator(pos, NOISE_STREAM, t0.device)
        for name in order:  # one draw of [c, *shape] per tensor
            t = trained[name]
            t.add_(torch.randn(t.shape, generator=gen, device=t.device, dtype=t.dtype), alpha=float(sigma))

    def noise_sum(self, pos, like, order, sigma):
        if self.secure is not None:
            return _summed_noise(self, pos, like, order, sigma)  # float64 per member, rounded once
        self._warn_fixed_seed()
        gen = self.generator(pos, NOISE_STREAM, like[order[0]].device)
        return {name: torch.randn((len(pos), *like[name].shape), generator=gen, device=like[name].device,
                                  dtype=like[name].dtype).sum(0).mul_(float(sigma)) for name in order}


@functools.lru_cache(maxsize=8)  # a node keeps its cohort's data on its device across rounds
def resident_partitions(dataset: str, data_dir: str, first: int, count: int, num_partitions: int, scheme: str,
                        alpha: float, seed: int, test_fraction: float, validation_fraction: float,
                        device: str) -> CohortData:
    """Training partitions ``first .. first + count - 1`` of ``num_partitions`` (``load_partition``),
    as one :class:`CohortData` on ``device``: loaded and copied once per process, then reused."""
    parts = [load_partition(dataset, data_dir, i, num_partitions, scheme, alpha, seed, test_fraction,
                            validation_fraction) for i in range(first, first + count)]
    return CohortData.stack([p.x_train for p in parts], [p.y_train for p in parts], device)

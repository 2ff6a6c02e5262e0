"""Gaussian noise on uploaded values: every parameter and buffer gets i.i.d. N(0, sigma^2).

sigma is the per-coordinate standard deviation in the units of the weights (docs/MATH.md §1: the noise
``n_i ~ N(0, sigma^2 I_d)`` added to the client's locally trained model). Noise is drawn on each
tensor's own device with that device's generator (one generator per device).

Seeding: ``seed=None`` or ``-1`` seeds the generator from OS entropy (:func:`entropy_generator`), so the
noise cannot be reproduced by anyone who knows the configuration. On the CPU that fills the whole
624-word state of torch's MT19937 from ``os.urandom``: ``manual_seed`` keeps only the low 32 bits of
its seed (``manual_seed(s)`` and ``manual_seed(s + 2**32)`` give the same stream), and 2^32 streams
are few enough for whoever sees an upload to try every one and subtract the noise (or for two of a
run's uploads to share one: about n^2 / 2^33 pairs among n generators). CUDA's Philox generator
takes the 63-bit seed whole. A fixed seed makes the noise
reproducible -- useful for experiments, never for real privacy (whoever knows the seed can subtract
the noise). torch's generators are not cryptographically secure PRNGs; the OS-entropy seed only
ensures that the seed itself is unpredictable.

Two samplers (run config ``noise-mode``; docs/MATH.md §18 says what each certifies):

- ``standard`` (a ``torch.Generator``): ``torch.randn`` in the tensor's dtype. For float32 that
  is Box-Muller on 24-bit uniforms from MT19937: no draw beyond about 5.77 sigma, values on a
  float32 grid. Fast; reproducible with a fixed seed.
- ``secure`` (:class:`SecureGaussian`): every normal from 64 bits of ``os.urandom`` (the OS's
  cryptographic generator): one sign bit and a 53-bit uniform u in (0, 1], |z| = -ndtri(u / 2)
  (inverse-CDF sampling in float64; no value beyond about 8.29 sigma), added to the weights in
  float64 and rounded once to their dtype. Never reproducible (no seed).
"""

from __future__ import annotations

import logging
import math
import os
import secrets
from collections.abc import Iterable, Mapping

import numpy as np
import torch
from scipy.special import ndtri
from torch import nn

log = logging.getLogger(__name__)

UNIFORM_BITS = 53  # resolution of the secure sampler's uniforms (a float64 mantissa)


class SecureGaussian:
    """Standard normals from ``os.urandom`` (cryptographically secure bytes), float64, 53-bit uniforms.

    Inverse-CDF sampling of the half-normal with a random sign: u = (k + 1) / 2^53 for a uniform
    53-bit integer k, |z| = -ndtri(u / 2). The largest |z| is -ndtri(2^-54) = 8.29 (the only
    truncation); between grid points ndtri is evaluated in float64. Thread-safe (no state).
    """

    max_abs = float(-ndtri(2.0 ** -(UNIFORM_BITS + 1)))

    def standard_normal(self, count: int) -> np.ndarray:
        """``count`` i.i.d. N(0, 1) draws as float64."""
        words = np.frombuffer(os.urandom(8 * count), dtype=np.uint64)
        k = words >> np.uint64(64 - UNIFORM_BITS)  # the top 53 bits
        sign = np.where((words & np.uint64(1)) == 1, -1.0, 1.0)  # the lowest bit
        u = (k.astype(np.float64) + 1.0) * 2.0 ** -(UNIFORM_BITS + 1)  # u / 2 in (0, 1/2]
        return sign * -ndtri(u)

    def noisy(self, t: torch.Tensor, sigma: float) -> torch.Tensor:
        """t + sigma N(0, I), computed in float64 and rounded once to t's dtype, on t's device."""
        z = torch.from_numpy(self.standard_normal(t.numel()).reshape(tuple(t.shape)))
        return (t.detach().to(torch.float64) + float(sigma) * z.to(t.device)).to(t.dtype)


Generators = torch.Generator | Mapping[str, torch.Generator] | SecureGaussian


def make_noise_source(mode: str, device: torch.device | str = "cpu", seed: int | None = None
                      ) -> torch.Generator | SecureGaussian:
    """The sampler of ``noise-mode``: a torch.Generator (standard) or :class:`SecureGaussian`
    (secure: needs seed None/-1, since its noise is never reproducible)."""
    if mode == "standard":
        return make_generator(device, seed)
    if mode == "secure":
        if seed not in (None, -1):
            raise ValueError(f"noise-mode 'secure' draws from os.urandom and takes no seed, got {seed!r}")
        return SecureGaussian()
    raise ValueError(f"noise mode must be 'standard' or 'secure', got {mode!r}")


def gaussian_noised(t: torch.Tensor, sigma: float, source: torch.Generator | SecureGaussian) -> torch.Tensor:
    """A new tensor t + N(0, sigma^2 I) from ``source`` (on t's device)."""
    if isinstance(source, SecureGaussian):
        return source.noisy(t, sigma)
    return t + float(sigma) * torch.randn(t.shape, generator=source, device=t.device, dtype=t.dtype)


#: logged whenever noise is drawn from a fixed seed (the Gaussian generators here, the Skellam one of secure_sum)
FIXED_SEED_WARNING = ("Noise generator seeded with a fixed seed: the noise is reproducible. Use this for "
                      "experiments only; with a known seed the noise can be removed and gives NO privacy.")


#: torch's CPU generator state (``get_state``): initial seed (8 bytes), left and seeded (4 + 4), next (8), then
#: MT19937's 624 state words, 8 bytes each (the layout :func:`entropy_generator` checks before writing into it)
_MT_WORDS, _MT_OFFSET, _MT_STATE_BYTES = 624, 24, 5056


def _mt_init_word(previous: int, index: int) -> int:
    """MT19937's seeding recurrence: state word ``index`` from the one before it."""
    return (1812433253 * (previous ^ (previous >> 30)) + index) & 0xFFFFFFFF


def entropy_generator(device: torch.device | str = "cpu") -> torch.Generator:
    """A torch.Generator on ``device`` seeded from OS entropy over its whole state: on the CPU the 624 words
    of MT19937 from ``os.urandom`` (19,968 bits; ``manual_seed`` alone keeps 32), elsewhere a 63-bit seed.
    Raises RuntimeError (never a weaker seed) if torch's CPU state layout is not the one expected."""
    gen = torch.Generator(device=torch.device(device))
    seed = secrets.randbits(32)
    gen.manual_seed(seed if gen.device.type == "cpu" else secrets.randbits(63))
    if gen.device.type != "cpu":
        return gen
    state = gen.get_state().numpy().copy()
    words = state[_MT_OFFSET:_MT_OFFSET + 8 * _MT_WORDS].view(np.uint64) if len(state) == _MT_STATE_BYTES else None
    if words is None or int(words[0]) != seed or int(words[1]) != _mt_init_word(seed, 1):
        raise RuntimeError(f"torch {torch.__version__}: the CPU generator's state is not laid out as expected (624 "
                           "MT19937 words at byte 24 of 5056): cannot seed its whole state from OS entropy")
    words[:] = np.frombuffer(os.urandom(4 * _MT_WORDS), dtype=np.uint32)
    gen.set_state(torch.from_numpy(state))
    return gen


def make_generator(device: torch.device | str = "cpu", seed: int | None = None) -> torch.Generator:
    """A torch.Generator on ``device``; seed None/-1 = OS entropy over its whole state (:func:`entropy_generator`),
    otherwise reproducible (+ WARNING)."""
    if seed is None or seed == -1:
        return entropy_generator(device)
    if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
        raise ValueError(f"seed must be None, -1 or an integer >= 0, got {seed!r}")
    gen = torch.Generator(device=torch.device(device))
    log.warning(FIXED_SEED_WARNING)
    gen.manual_seed(seed)
    return gen


def _tensors(target: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(target, nn.Module):
        return [p.data for p in target.parameters()] + list(target.buffers())
    return [t.data if isinstance(t, nn.Parameter) else t for t in target]


def _generator_for(generator: torch.Generator | Mapping[str, torch.Generator], device: torch.device) -> torch.Generator:
    if isinstance(generator, torch.Generator):
        gen = generator
    else:
        found = generator.get(str(device)) or generator.get(device.type)
        if found is None:
            raise ValueError(f"no noise generator for device {device} (have {list(generator)})")
        gen = found
    if gen.device.type != device.type or (
        device.type != "cpu" and gen.device.index not in (None, device.index)
    ):
        raise ValueError(f"noise generator is on {gen.device}, tensor on {device}: one generator per device")
    return gen


@torch.no_grad()
def add_gaussian_noise_(
    target: nn.Module | Iterable[torch.Tensor], sigma: float, generator: Generators
) -> int:
    """Add i.i.d. N(0, sigma^2) to every value of ``target`` in place; return the number of values.

    target: a module (all parameters and buffers) or an iterable of tensors (e.g. a state_dict's
    values). Non-floating tensors cannot carry Gaussian noise and would be released un-noised, so
    they raise TypeError. generator: one torch.Generator, a mapping "cuda:0"/"cpu" -> generator,
    or a :class:`SecureGaussian` (secure mode: any device).
    """
    if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma must be a finite number >= 0, got {sigma!r}")
    tensors = _tensors(target)
    for t in tensors:
        if not t.is_floating_point():
            raise TypeError(f"cannot add Gaussian noise to a {t.dtype} tensor of shape {tuple(t.shape)}")
    count = 0
    for t in tensors:
        if isinstance(generator, SecureGaussian):
            t.copy_(generator.noisy(t, sigma))
        else:
            gen = _generator_for(generator, t.device)
            t.add_(torch.randn(t.shape, generator=gen, device=t.device, dtype=t.dtype), alpha=float(sigma))
        count += t.numel()
    return count

"""Gaussian noise on uploaded values: every parameter and buffer gets i.i.d. N(0, sigma^2).

sigma is the per-coordinate standard deviation in the units of the weights (docs/MATH.md §1: the noise
``n_i ~ N(0, sigma^2 I_d)`` added to the client's locally trained model). Noise is drawn on each
tensor's own device with that device's generator (one generator per device).

Seeding: ``seed=None`` or ``-1`` seeds the generator from OS entropy (``secrets``), so the noise
cannot be reproduced by anyone who knows the configuration. A fixed seed makes the noise
reproducible -- useful for experiments, never for real privacy (whoever knows the seed can subtract
the noise). torch's generators are not cryptographically secure PRNGs; the OS-entropy seed only
ensures that the seed itself is unpredictable.
"""

from __future__ import annotations

import logging
import math
import secrets
from collections.abc import Iterable, Mapping

import torch
from torch import nn

log = logging.getLogger(__name__)

Generators = torch.Generator | Mapping[str, torch.Generator]


def make_generator(device: torch.device | str = "cpu", seed: int | None = None) -> torch.Generator:
    """A torch.Generator on ``device``; seed None/-1 = OS entropy, otherwise reproducible (+ WARNING)."""
    gen = torch.Generator(device=torch.device(device))
    if seed is None or seed == -1:
        gen.manual_seed(secrets.randbits(63))
    else:
        if not isinstance(seed, int) or isinstance(seed, bool) or seed < 0:
            raise ValueError(f"seed must be None, -1 or an integer >= 0, got {seed!r}")
        log.warning(
            "Noise generator seeded with a fixed seed: the noise is reproducible. Use this for "
            "experiments only; with a known seed the noise can be removed and gives NO privacy."
        )
        gen.manual_seed(seed)
    return gen


def _tensors(target: nn.Module | Iterable[torch.Tensor]) -> list[torch.Tensor]:
    if isinstance(target, nn.Module):
        return [p.data for p in target.parameters()] + list(target.buffers())
    return [t.data if isinstance(t, nn.Parameter) else t for t in target]


def _generator_for(generator: Generators, device: torch.device) -> torch.Generator:
    if isinstance(generator, torch.Generator):
        gen = generator
    else:
        gen = generator.get(str(device)) or generator.get(device.type)
        if gen is None:
            raise ValueError(f"no noise generator for device {device} (have {list(generator)})")
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
    they raise TypeError. generator: one torch.Generator, or a mapping "cuda:0"/"cpu" -> generator.
    """
    if not (isinstance(sigma, (int, float)) and math.isfinite(sigma) and sigma >= 0):
        raise ValueError(f"sigma must be a finite number >= 0, got {sigma!r}")
    tensors = _tensors(target)
    for t in tensors:
        if not t.is_floating_point():
            raise TypeError(f"cannot add Gaussian noise to a {t.dtype} tensor of shape {tuple(t.shape)}")
    count = 0
    for t in tensors:
        gen = _generator_for(generator, t.device)
        t.add_(torch.randn(t.shape, generator=gen, device=t.device, dtype=t.dtype), alpha=float(sigma))
        count += t.numel()
    return count

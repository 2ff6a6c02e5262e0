"""Noise generators seeded from OS entropy over their whole state (training/noise.py ``entropy_generator``).

torch's CPU generator (MT19937) keeps only the low 32 bits of ``manual_seed``'s seed: 2^32 streams, few
enough to try every one against an upload. Without a seed the noise generators of the package
(``make_generator(seed=-1)``, the cohort's ``KeyedStreams`` without a seed) fill MT19937's 624 state words
from ``os.urandom`` instead. The tests make the 63-bit seed drawn from ``secrets`` collide (the same value
twice, and two values that agree in their low 32 bits): the streams must still differ, which they did
not when the 63-bit seed was the only entropy.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fl_dp_flower.training import cohort_data, noise
from fl_dp_flower.training.cohort_data import KeyedStreams
from fl_dp_flower.training.noise import entropy_generator, make_generator


def test_torch_cpu_seeds_keep_32_bits():
    """The reason: manual_seed(s) and manual_seed(s + 2^32) give one stream (a check of the installed torch)."""
    a = torch.randn(8, generator=torch.Generator().manual_seed(12345))
    b = torch.randn(8, generator=torch.Generator().manual_seed(12345 + 2**32))
    assert torch.equal(a, b)


@pytest.mark.parametrize("first, second", [(7, 7), (5, 5 + 2**40)])
def test_os_entropy_generators_differ_when_their_seeds_collide(first, second, monkeypatch):
    seeds = iter([first, second] * 4)
    monkeypatch.setattr(noise.secrets, "randbits", lambda bits: next(seeds) % 2**bits)
    a = torch.randn(1000, generator=make_generator("cpu", -1))
    b = torch.randn(1000, generator=make_generator("cpu", None))
    assert not torch.equal(a, b)
    assert abs(float(torch.corrcoef(torch.stack([a, b]))[0, 1])) < 0.2  # independent streams (|r| < 6.3 SE)
    c, d = (torch.rand(1000, generator=entropy_generator()) for _ in range(2))
    assert not torch.equal(c, d)


def test_keyed_streams_without_a_seed_differ_when_their_seeds_collide(monkeypatch):
    monkeypatch.setattr(noise.secrets, "randbits", lambda bits: 99)
    assert cohort_data.entropy_generator is entropy_generator
    streams = KeyedStreams(None, 0, np.arange(4))
    draws = [torch.zeros(4, 500) for _ in range(2)]
    for t in draws:
        streams.add_noise_(np.arange(4), {"w": t}, ["w"], 1.0)
    assert not torch.equal(draws[0], draws[1])


def test_whole_state_draws_are_standard_normal():
    """The noise of a whole-state generator: mean 0 and variance 1 (100,000 draws; bounds of 6 standard errors:
    a false alarm below 1e-8)."""
    z = torch.randn(100_000, generator=make_generator("cpu", -1), dtype=torch.float64)
    se = 1 / 100_000**0.5
    assert abs(float(z.mean())) < 6 * se and abs(float(z.var()) - 1) < 6 * 2**0.5 * se


def test_a_fixed_seed_is_unchanged_and_a_changed_state_layout_is_refused(monkeypatch):
    """A fixed seed keeps its stream (manual_seed: seeded runs reproduce as before); a state that is not torch's
    expected layout raises instead of falling back to a 32-bit seed."""
    assert torch.equal(torch.randn(5, generator=make_generator("cpu", 3)),
                       torch.randn(5, generator=torch.Generator().manual_seed(3)))
    monkeypatch.setattr(noise, "_MT_OFFSET", 32)
    with pytest.raises(RuntimeError, match="not laid out as expected"):
        entropy_generator("cpu")

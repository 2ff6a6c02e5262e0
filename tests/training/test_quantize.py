"""Quantization of the noisy uploads for secure aggregation (docs/MATH.md §20.3): round trip, exact clip
counting, the modular sum, and the tail probability the chosen range promises (scipy's norm.sf)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy.stats import norm

from fl_dp_flower.training.quantize import (QuantizationPlan, clip_probability_bound, clipping_range,
                                            dequantize_sum, plan_quantization, quantization_range_for,
                                            quantize_upload, update_bound)


def _plan(clip_range=1.0, levels=2**16, clients=8, modulus=2**32) -> QuantizationPlan:
    return QuantizationPlan(clip_range=clip_range, quantization_range=levels, modulus_range=modulus, clients=clients,
                            values=100, clip_probability=1e-9, update_bound=0.1, sigma=0.2)


def test_round_trip_error_is_below_one_step_and_unbiased():
    np.random.seed(1)
    plan = _plan(clip_range=2.0, levels=2**10)
    x = np.random.uniform(-2.0, 2.0, size=200_000)
    q, clipped = quantize_upload([x], plan)
    assert clipped == 0
    assert q[0].min() >= 0 and q[0].max() <= plan.quantization_range
    back = dequantize_sum(q, plan, clients=1)[0]
    err = back - x
    assert np.max(np.abs(err)) < plan.step  # stochastic rounding: strictly within one step
    # unbiased: the mean error is within 6 standard errors of 0 (each error has variance <= step^2/4)
    assert abs(err.mean()) < 6 * (plan.step / 2) / math.sqrt(x.size)
    # values on the grid come back exactly
    grid = -2.0 + plan.step * np.arange(0, plan.quantization_range + 1, 7)
    q_grid, _ = quantize_upload([grid], plan)
    np.testing.assert_allclose(dequantize_sum(q_grid, plan, 1)[0], grid, atol=1e-12)


def test_clip_counting_is_exact_and_clipped_values_land_on_the_bounds():
    np.random.seed(2)
    plan = _plan(clip_range=1.0, levels=2**12)
    a = np.array([0.0, 1.0, -1.0, 1.0000001, -3.0, 0.5, 7.0])  # exactly 3 outside [-1, 1]; +-1 are inside
    b = np.array([[2.0, -0.99], [-1.5, 0.2]])  # 2 more
    q, clipped = quantize_upload([a, b], plan)
    assert clipped == 5
    back = dequantize_sum(q, plan, clients=1)
    np.testing.assert_allclose(back[0][[3, 4, 6]], [1.0, -1.0, 1.0], atol=1e-12)
    np.testing.assert_allclose(back[1][[0, 1], [0, 0]], [1.0, -1.0], atol=1e-12)
    assert q[0].dtype == np.int64 and q[1].shape == (2, 2)


def test_the_modular_sum_of_m_uploads_dequantizes_to_their_sum():
    np.random.seed(3)
    m = 50
    levels = quantization_range_for(m, 2**24)
    assert m * levels <= 2**24 - 1 < m * 2 * levels  # the largest power of two that cannot wrap
    plan = _plan(clip_range=1.5, levels=levels, clients=m, modulus=2**24)
    uploads = [np.random.uniform(-1.5, 1.5, size=(30, 4)) for _ in range(m)]
    total = np.zeros((30, 4), dtype=np.int64)
    for u in uploads:
        q, _ = quantize_upload([u], plan)
        total = (total + q[0]) % plan.modulus_range  # what SecAgg+ leaves after the masks cancel
    got = dequantize_sum([total], plan, clients=m)[0]
    assert np.max(np.abs(got - np.sum(uploads, axis=0))) < m * plan.step
    with pytest.raises(ValueError, match="clients must be at most the planned 50"):
        dequantize_sum([total], plan, clients=51)


def test_the_chosen_range_has_the_stated_tail_probability():
    sigma, b, n, p = 0.03, 0.2, 61_706 * 100, 1e-9
    r = clipping_range(sigma, b, n, p)
    assert 2 * n * norm.sf((r - b) / sigma) == pytest.approx(p, rel=1e-9)  # union bound meets p exactly
    assert clip_probability_bound(r, sigma, b, n) == pytest.approx(p, rel=1e-9)
    assert clip_probability_bound(r * 0.9, sigma, b, n) > p  # any smaller range misses it
    assert clip_probability_bound(b, sigma, b, n) == 1.0


def test_the_tail_bound_holds_by_simulation():
    """P(any of n values clipped) observed over many draws stays below the stated p (worst case |Delta_j| = B)."""
    rng = np.random.default_rng(4)
    sigma, b, n, p = 1.0, 0.5, 20, 0.2
    r = clipping_range(sigma, b, n, p)
    draws = b + sigma * rng.standard_normal((40_000, n))  # every coordinate at the bound: the worst case
    observed = np.mean(np.any(np.abs(draws) > r, axis=1))
    assert observed <= p
    assert observed > p / 4  # and the bound is not vacuous here (one-sided tail dominates)


def test_plan_quantization_ties_the_parts_together():
    plan = plan_quantization(sigma=0.05, clip_norm=1.0, step_sizes=[0.1] * 5, parameters=1000, clients=100,
                             clip_probability=1e-8, rounds=60)
    assert plan.update_bound == pytest.approx(0.5)
    assert plan.values == 1000 * 100 * 60
    assert plan.clip_range == pytest.approx(0.5 + 0.05 * norm.isf(1e-8 / (2 * 6_000_000)))
    assert plan.quantization_range == 2**25 and 100 * 2**25 < 2**32
    assert plan.step == pytest.approx(2 * plan.clip_range / 2**25)
    assert plan.to_dict()["step"] == plan.step


@pytest.mark.parametrize(("call", "match"), [
    (lambda: update_bound(0.0, [0.1]), "clip_norm"),
    (lambda: update_bound(1.0, []), "step_sizes"),
    (lambda: clipping_range(0.1, -1.0, 10, 1e-6), "bound"),
    (lambda: clipping_range(0.1, 0.0, 0, 1e-6), "values"),
    (lambda: clipping_range(0.1, 0.0, 10, 1.0), "clip_probability"),
    (lambda: quantization_range_for(10, 1000), "power of two"),
    (lambda: quantization_range_for(2**20, 2**20), "cannot hold"),
])
def test_bad_input_is_refused_naming_the_field(call, match):
    with pytest.raises(ValueError, match=match):
        call()

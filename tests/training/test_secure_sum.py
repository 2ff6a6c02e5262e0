"""Secure aggregation's integer upload (training/secure_sum.py): exact through Flower's own
quantization and the workflow's dequantization, modular wrap of the field, the Skellam noise."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.common.secure_aggregation.ndarrays_arithmetic import factor_combine, factor_extract, parameters_mod
from flwr.common.secure_aggregation.quantization import dequantize, quantize

from fl_dp_flower.training.secure_sum import (FLOWER_LEVELS, FLOWER_MODULUS, FLOWER_RANGE, SumGrid, decode_sum,
                                              encode_update, skellam_noise, to_flower_values)


def _through_flower(encoded_per_client: list[list[np.ndarray]]) -> list[np.ndarray]:
    """What Flower 1.41's secaggplus_mod and SecAggPlusWorkflow compute from the clients' floats (weight 1,
    max_weight 1), masks left out (they cancel modulo 2^32): the vector handed to aggregate_fit."""
    total = None
    for encoded in encoded_per_client:
        q = factor_combine(FLOWER_LEVELS, quantize(to_flower_values(encoded), FLOWER_RANGE, FLOWER_LEVELS))
        q = [np.asarray(a, dtype=np.int64) for a in q]
        total = q if total is None else [a + b for a, b in zip(total, q)]
    factor, recon = factor_extract(parameters_mod(total, FLOWER_MODULUS))
    out = dequantize(recon, FLOWER_RANGE, FLOWER_LEVELS)
    n = len(encoded_per_client)
    for vec in out:  # the workflow's unmask stage, verbatim in effect
        vec += -(n - 1) * FLOWER_RANGE
        vec *= FLOWER_LEVELS / factor
    return out


@pytest.mark.parametrize("clients", [1, 3, 4, 7])
def test_the_decoded_sum_is_the_exact_integer_sum(clients):
    grid = SumGrid(step=2.0**-12, bits=20)
    rng = np.random.default_rng(clients)
    updates = [[rng.normal(0, 3.0, size=(5, 4)), rng.normal(0, 3.0, size=7)] for _ in range(clients)]
    enc = [encode_update(u, grid, sigma=0.5, rng=np.random.default_rng(100 + i)) for i, u in enumerate(updates)]
    # the clients' integers before the modulus: the same draws again
    ints = [[np.rint(d / grid.step).astype(np.int64) + skellam_noise(d.shape, grid.poisson_rate(0.5), r)
             for d in u] for u, r in ((u, np.random.default_rng(100 + i)) for i, u in enumerate(updates))]
    decoded = decode_sum(_through_flower(enc), clients, grid)
    for j in range(2):
        exact = sum(c[j] for c in ints)
        assert np.all(np.abs(exact) < grid.modulus // 2)
        np.testing.assert_array_equal(decoded[j], exact.astype(np.float64) * grid.step)


def test_sums_that_wrap_the_field_decode_exactly():
    """Integers near Q - 1 from many clients wrap 2^32 many times over; (sum mod 2^32) mod Q is still exact."""
    grid = SumGrid(step=1.0, bits=30)
    n = 9
    ks = [[np.array([grid.modulus - 1, grid.modulus - 2, 5], dtype=np.int64)] for _ in range(n)]
    decoded = decode_sum(_through_flower(ks), n, grid)
    np.testing.assert_array_equal(decoded[0], [-n, -2 * n, 5 * n])


def test_the_skellam_noise_has_variance_sigma_squared_in_parameter_units():
    grid = SumGrid(step=2.0**-8, bits=30)
    sigma = 0.3
    zero = [np.zeros(200_000)]
    enc = encode_update(zero, grid, sigma, rng=np.random.default_rng(0))[0]
    centred = np.where(enc >= grid.modulus // 2, enc - grid.modulus, enc) * grid.step
    assert abs(centred.mean()) < 0.005 and centred.var() == pytest.approx(sigma**2, rel=0.02)
    assert np.all(np.mod(centred / grid.step, 1) == 0)  # on the grid


def test_rounding_is_to_the_nearest_grid_point():
    grid = SumGrid(step=0.25, bits=16)
    rate = grid.poisson_rate(1e-9)  # practically no noise: lam ~ 1e-17
    enc = encode_update([np.array([0.1, 0.13, -0.37, 2.0])], grid, 1e-9, rng=np.random.default_rng(1))[0]
    assert rate < 1e-15
    np.testing.assert_array_equal(np.where(enc >= 2**15, enc - 2**16, enc), [0, 1, -1, 8])


@pytest.mark.parametrize("kwargs, message", [({"step": 0.3, "bits": 10}, "power of two"),
                                             ({"step": -1.0, "bits": 10}, "step"),
                                             ({"step": 0.5, "bits": 31}, r"bits must be in \[2, 30\]"),
                                             ({"step": 0.5, "bits": 1}, "bits")])
def test_bad_grids_are_refused_naming_the_field(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SumGrid(**kwargs)


def test_a_non_finite_update_is_refused():
    with pytest.raises(ValueError, match="non-finite"):
        encode_update([np.array([np.nan])], SumGrid(step=1.0, bits=8), 1.0)

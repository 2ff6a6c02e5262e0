"""Secure aggregation's integer upload (training/secure_sum.py): exact through Flower's own
quantization and the workflow's dequantization, modular wrap of the field, the Skellam noise."""

from __future__ import annotations

import numpy as np
import pytest
from flwr.common.secure_aggregation.ndarrays_arithmetic import factor_combine, factor_extract, parameters_mod
from flwr.common.secure_aggregation.quantization import dequantize, quantize

from fl_dp_flower.privacy.skellam import CLIENT_HALF_RANGE
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


def _encode(update, grid, sigma, seed):
    return encode_update(update, grid, sigma, rng=np.random.default_rng(seed))[0]


@pytest.mark.parametrize("clients", [1, 3, 4, 7])
def test_the_decoded_sum_is_the_exact_integer_sum(clients):
    grid = SumGrid(step=2.0**-12)
    rng = np.random.default_rng(clients)
    updates = [[rng.normal(0, 3.0, size=(5, 4)), rng.normal(0, 3.0, size=7)] for _ in range(clients)]
    enc = [_encode(u, grid, 0.5, 100 + i) for i, u in enumerate(updates)]
    # the clients' integers before the offset: the same draws again
    ints = [[np.rint(d / grid.step).astype(np.int64) + skellam_noise(d.shape, grid.poisson_rate(0.5), r)
             for d in u] for u, r in ((u, np.random.default_rng(100 + i)) for i, u in enumerate(updates))]
    decoded = decode_sum(_through_flower(enc), clients, grid)
    for j in range(2):
        exact = sum(c[j] for c in ints)
        np.testing.assert_array_equal(decoded[j], exact.astype(np.float64) * grid.step)


def test_what_the_server_sees_is_a_function_of_the_sum_alone():
    """No per-client carry (review finding): uploads with one sum give one field element, whatever the signs."""
    a = [np.array([5, -5, CLIENT_HALF_RANGE - 1]), np.array([-5, 5, -(CLIENT_HALF_RANGE - 1)])]
    b = [np.array([0, 0, 0]), np.array([0, 0, 0])]
    seen = [_through_flower([[x + CLIENT_HALF_RANGE] for x in pair])[0] for pair in (a, b)]
    np.testing.assert_array_equal(seen[0], seen[1])
    np.testing.assert_array_equal(decode_sum([seen[0]], 2, SumGrid(step=1.0))[0], [0, 0, 0])


def test_sums_beyond_the_field_wrap_modulo_2_to_the_32():
    """Sums of many near-extreme integers wrap 2^32: the decoded value is the sum modulo 2^32, centred."""
    grid = SumGrid(step=1.0)
    n = 9
    top = CLIENT_HALF_RANGE - 1
    ks = [[np.array([top, -CLIENT_HALF_RANGE, 5]) + CLIENT_HALF_RANGE] for _ in range(n)]
    decoded = decode_sum(_through_flower(ks), n, grid)
    exact = np.array([n * top, -n * CLIENT_HALF_RANGE, 5 * n])
    wrapped = (exact + 2**31) % 2**32 - 2**31
    np.testing.assert_array_equal(decoded[0], wrapped)
    assert wrapped[0] != exact[0]  # the test exercises a wrap


def test_values_beyond_the_client_range_are_clamped_and_counted():
    grid = SumGrid(step=1.0)
    enc, clamped = encode_update([np.array([3.0 * CLIENT_HALF_RANGE, -3.0 * CLIENT_HALF_RANGE, 7.0])], grid,
                                 1e-9, rng=np.random.default_rng(0))
    assert clamped == 2
    np.testing.assert_array_equal(enc[0], [2 * CLIENT_HALF_RANGE - 1, 0, CLIENT_HALF_RANGE + 7])


def test_the_skellam_noise_has_variance_sigma_squared_in_parameter_units():
    grid = SumGrid(step=2.0**-8)
    sigma = 0.3
    enc = _encode([np.zeros(200_000)], grid, sigma, 0)[0]
    centred = (enc - CLIENT_HALF_RANGE) * grid.step
    assert abs(centred.mean()) < 0.005 and centred.var() == pytest.approx(sigma**2, rel=0.02)


def test_rounding_is_to_the_nearest_grid_point():
    grid = SumGrid(step=0.25)
    enc = _encode([np.array([0.1, 0.13, -0.37, 2.0])], grid, 1e-9, 1)[0]
    np.testing.assert_array_equal(enc - CLIENT_HALF_RANGE, [0, 1, -1, 8])


@pytest.mark.parametrize("step, message", [(0.3, "power of two"), (-1.0, "step")])
def test_bad_grids_are_refused_naming_the_field(step, message):
    with pytest.raises(ValueError, match=message):
        SumGrid(step=step)


def test_a_non_finite_update_is_refused():
    with pytest.raises(ValueError, match="non-finite"):
        encode_update([np.array([np.nan])], SumGrid(step=1.0), 1.0)

"""noise-mode = "secure" (issue 16.7): normals from os.urandom through 53-bit uniforms and the inverse
normal CDF in float64, added in float64; checked against mpmath and by distribution tests."""

from __future__ import annotations

import math

import mpmath
import numpy as np
import pytest
import torch
from scipy import stats

from fl_dp_flower.training import noise as noise_module
from fl_dp_flower.training.noise import SecureGaussian, add_gaussian_noise_, make_noise_source

from fl_dp_flower.app.testing import run_local, tiny_config

torch.set_num_threads(1)


def _normal_quantile_upper(p: float) -> float:
    """z with P(Z > z) = p, by mpmath at 50 digits (independent of scipy's ndtri)."""
    mpmath.mp.dps = 50
    return float(mpmath.sqrt(2) * mpmath.erfinv(1 - 2 * mpmath.mpf(p)))


def test_each_normal_is_the_inverse_cdf_of_a_53_bit_uniform_with_a_random_sign(monkeypatch):
    # words: k = top 53 bits, sign = lowest bit
    cases = [(0, 0), (0, 1), (12345, 0), ((1 << 52), 1), ((1 << 53) - 1, 0)]
    words = np.array([(k << 11) | s for k, s in cases], dtype=np.uint64)
    monkeypatch.setattr(noise_module.os, "urandom", lambda n: words.tobytes()[:n])
    z = SecureGaussian().standard_normal(len(cases))
    for (k, s), got in zip(cases, z):
        p = (k + 1) / 2.0**54  # P(|Z| > |z|) / 2
        expected = 0.0 if p == 0.5 else _normal_quantile_upper(p)
        assert got == pytest.approx(-expected if s else expected, rel=1e-13, abs=1e-15), (k, s)
    assert SecureGaussian.max_abs == pytest.approx(_normal_quantile_upper(2.0**-54), rel=1e-13)
    assert SecureGaussian.max_abs > 8.29  # the standard float32 sampler stops near 5.77


def test_secure_normals_are_standard_normal_with_float64_resolution():
    z = SecureGaussian().standard_normal(200_000)
    assert stats.kstest(z, "norm").pvalue > 1e-6  # fails by chance with probability 1e-6
    assert abs(z.mean()) < 6 / math.sqrt(len(z)) and abs(z.std() - 1) < 6 / math.sqrt(2 * len(z))
    off_float32_grid = np.mean(z.astype(np.float32).astype(np.float64) != z)
    assert off_float32_grid > 0.99  # torch.randn(float32) draws all lie on the float32 grid


def test_secure_noise_on_a_model_is_added_in_float64_and_rounded_once():
    weights = torch.full((100_000,), 0.25, dtype=torch.float32)
    add_gaussian_noise_([weights], 0.5, make_noise_source("secure"))
    assert weights.dtype == torch.float32
    noise = weights.double() - 0.25
    assert abs(noise.std().item() - 0.5) < 6 * 0.5 / math.sqrt(2 * len(noise))
    exact = torch.zeros(100_000, dtype=torch.float64)
    add_gaussian_noise_([exact], 1.0, make_noise_source("secure"))
    assert (exact.float().double() != exact).float().mean() > 0.99  # float64 noise on float64 values


def test_secure_mode_takes_no_seed():
    with pytest.raises(ValueError, match="takes no seed"):
        make_noise_source("secure", "cpu", 3)
    with pytest.raises(ValueError, match="'standard' or 'secure'"):
        make_noise_source("discrete")
    assert isinstance(make_noise_source("standard", "cpu", 3), torch.Generator)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_secure_noise_lands_on_the_tensor_device():
    t = torch.zeros(1000, device="cuda")
    add_gaussian_noise_([t], 1.0, SecureGaussian())
    assert t.device.type == "cuda" and 0.8 < t.std().item() < 1.2


@pytest.mark.parametrize("cohort", [1, 3])
def test_secure_runs_pass_the_server_noise_check(tmp_path, cohort):
    """The ClientApp's secure noise through the real apps: every reply accepted, residual energy ~1."""
    cfg = tiny_config(tmp_path, **{"noise-mode": "secure", "seed": -1, "num-server-rounds": 1,
                                   "clients-per-node": cohort, "clients-per-round": 3 * cohort})
    out, _ = run_local(cfg, node_config={n: {"allow-fixed-seed": False} for n in (1, 2, 3)})
    assert out.accountant.records[0].clients == 3 * cohort
    energies = [e for _, _, e in out.strategy.residual_energies]
    assert len(energies) == 3 and all(abs(e - 1) < 5 * math.sqrt(2 / 61706) for e in energies), energies

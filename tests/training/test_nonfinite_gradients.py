"""Non-finite gradients (issue 16.10b): zeroed on the client before clipping and counted, so a NaN
sample neither turns the upload into NaN (which the server drops) nor escapes the clipping bound."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fl_dp_flower.app import clientapp as client_module
from fl_dp_flower.training import local_update
from fl_dp_flower.training.cohort import CohortSettings, Member, cohort_update

from fl_dp_flower.app.testing import run_local, tiny_config

torch.set_num_threads(1)
F64 = torch.float64


def _data(n: int = 8, bad: int | None = 3):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(n, 4, generator=gen, dtype=F64)
    y = torch.randint(0, 3, (n,), generator=gen)
    if bad is not None:
        x[bad, 1] = float("nan")
    return x, y


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Linear(4, 3).to(F64)


def _weights(model: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def test_per_sample_nan_gradient_is_zeroed_and_the_rest_kept():
    """K = 1 on the whole data (B = n): the update is -eta/B times the sum of the n - 1 finite clipped
    per-sample gradients, i.e. (B-1)/B times the update on the data without the bad sample."""
    x, y = _data()
    keep = [i for i in range(len(y)) if i != 3]
    with_nan, clean = _model(), _model()
    start = _weights(with_nan)
    stats = local_update(with_nan, x, y, step_sizes=[0.5], clip_norm=0.3, clipping="per-sample", batch_size=8,
                         generator=torch.Generator().manual_seed(0))
    local_update(clean, x[keep], y[keep], step_sizes=[0.5], clip_norm=0.3, clipping="per-sample", batch_size=7,
                 generator=torch.Generator().manual_seed(0))
    assert stats.nonfinite_gradients == 1
    assert torch.isfinite(_weights(with_nan)).all()
    torch.testing.assert_close(_weights(with_nan) - start, (_weights(clean) - start) * 7 / 8, rtol=1e-12, atol=1e-15)


def test_per_batch_nan_gradient_skips_the_step():
    x, y = _data()
    model = _model()
    start = _weights(model)
    stats = local_update(model, x, y, step_sizes=[0.5, 0.5], clip_norm=1.0, clipping="per-batch", batch_size=8,
                         generator=torch.Generator().manual_seed(0))
    assert stats.nonfinite_gradients == 2  # every batch holds the bad sample
    assert torch.equal(_weights(model), start)


def test_cohort_member_with_a_nan_gradient_stays_finite():
    model = _model()
    xs = [_data(bad=None), _data(bad=2)]
    members = [Member(x, y, torch.Generator().manual_seed(i), torch.Generator().manual_seed(10 + i))
               for i, (x, y) in enumerate(xs)]
    result = cohort_update(model, members, CohortSettings(step_sizes=[0.2, 0.2], clip_norm=1.0, batch_size=8,
                                                          sigma=1e-3, loss_fn=F.cross_entropy))
    assert result.nonfinite_gradients == 2
    assert all(torch.isfinite(t).all() for t in result.total.values())


def test_node_with_a_nan_sample_still_contributes_through_the_real_apps(tmp_path, monkeypatch, caplog):
    """Before: node 2's upload was NaN and the server dropped it every round."""
    real = client_module.load_partition

    def poisoned(dataset, data_dir, pid, *args):
        part = real(dataset, data_dir, pid, *args)
        if pid == 1:  # node 2
            x = part.x_train.clone()
            x[0, 0, 0, 0] = float("nan")
            part = part._replace(x_train=x)
        return part

    monkeypatch.setattr(client_module, "load_partition", poisoned)
    caplog.set_level(logging.WARNING)
    cfg = tiny_config(tmp_path, **{"batch-size": 4000, "num-server-rounds": 1})  # B > n: every batch holds it
    out, _ = run_local(cfg)
    assert sorted(out.accountant.records[0].node_ids) == [1, 2, 3]
    assert any("2 non-finite step gradient(s) this round were replaced by zero" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("value", [float("inf"), float("-inf")])
def test_infinite_gradients_are_zeroed_too(value):
    x, y = _data(bad=None)
    x[5, 0] = value
    model = _model()
    stats = local_update(model, x, y, step_sizes=[0.1], clip_norm=1.0, clipping="per-sample", batch_size=8,
                         generator=torch.Generator().manual_seed(0))
    assert stats.nonfinite_gradients == 1 and torch.isfinite(_weights(model)).all()

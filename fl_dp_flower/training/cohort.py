"""A cohort of clients trained at once: one SuperNode stands for many virtual clients.

Each member runs exactly the local update of :func:`~fl_dp_flower.training.local_update.local_update`
— K steps of its own mini-batch gradient, clipped to V over all parameters (per-batch: the mean
batch gradient; per-sample: every sample's gradient, then their mean), FedProx's pull added after
clipping — and then adds its own N(0, sigma^2) noise to every value, as the single-client
ClientApp does. The members' gradients are computed in one call (``torch.func.vmap`` of ``grad``
through ``functional_call``; per-sample: a second ``vmap`` over the batch): the first step at the
shared w_t (an ordinary batched forward pass), later steps on the members' stacked weights. A node
pays Flower's message, process and model-loading costs once per cohort, not once per client.

Host work (:func:`train_cohort`, the ClientApp's path): the members' data stays on the device
(:class:`~.cohort_data.CohortData`), a chunk's batch indices and per-member noise come from a few
chunk-wide draws (:class:`~.cohort_data.KeyedStreams`), and the counts are read once per round,
so a round's host-to-device copies, synchronisations and torch calls do not grow with the members
(tests/training/test_cohort_streams.py). With each member's own generators
(:func:`cohort_update`, :class:`~.cohort_data.MemberStreams`) the draws are the single-client
code's, in its order: the result equals ``local_update`` + ``add_gaussian_noise_`` once per
member (to float tolerance; tests/strategies/test_cohort.py, tests/training/test_cohort_trainer.py).

Speed: members are trained in chunks (``member_chunk`` members at a time, all K steps of a chunk
before the next), so each chunk's stacked parameters, activations and gradients stay small enough
for the CPU's caches and the allocator's reused memory; clipping and the step are fused into one
in-place pass per tensor, and with summed noise the last step adds the clipped gradients'
weighted sum (one matrix-vector product) instead of forming every member's weights; with one step
(K = 1) and only the sum needed, the members' gradients of linear layers are not formed at all
(ghost norms, :mod:`.ghost`; ``vmap`` where a model is not covered). Chunking
changes no result with member generators (members are independent); with keyed streams it
decides the keys.

Device-agnostic: the data, the stacked parameters and the draws live on the model's device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call, grad, vmap


from .cohort_data import CohortData, CohortStreams, KeyedStreams, MemberStreams
from .cohort_settings import CohortSettings
from .ghost import GhostStep, ghost_step
from .local_update import LossFn
from .noise import SecureGaussian, gaussian_noised

# Default chunk budgets (members per chunk = min(samples // B, values // stacked values per member)):
# on a CPU small enough for the caches, on a GPU large enough to fill it.
CPU_CHUNK_SAMPLES, CPU_CHUNK_VALUES = 256, 4_000_000
GPU_CHUNK_SAMPLES, GPU_CHUNK_VALUES = 16_384, 256_000_000
#: True: never read a count while training, on any device (the CUDA path; tests set it to check it on the CPU)
SYNC_FREE = False

Params = dict[str, torch.Tensor]

__all__ = ["CPU_CHUNK_SAMPLES", "CohortData", "CohortResult", "CohortSettings", "CohortStreams", "KeyedStreams", "Member",
           "MemberStreams", "cohort_update", "default_member_chunk", "train_cohort"]


@dataclass(frozen=True)
class Member:
    """One virtual client: its data and its two random streams (batch indices, noise). The noise
    stream is unused (may be None) when the cohort draws its summed noise at once."""

    x: torch.Tensor
    y: torch.Tensor
    batch_generator: torch.Generator
    noise_generator: torch.Generator | SecureGaussian | None = None


@dataclass(frozen=True)
class CohortResult:
    """``total``: name -> sum over members of their noisy uploads (what the node sends).
    ``members``: name -> [M, ...] each member's noisy upload (only with ``keep_members``).
    ``clipped_fraction``: share of clipped gradients (per-batch: of (member, step) gradients;
    per-sample: of (member, step, sample) gradients) whose norm exceeded V.
    ``nonfinite_gradients``: gradients (counted as for ``clipped_fraction``) that were not finite,
    replaced by zero."""

    total: dict[str, torch.Tensor]
    members: dict[str, torch.Tensor] | None
    clipped_fraction: float
    batch_sizes: tuple[int, ...]
    nonfinite_gradients: int = 0


@dataclass(frozen=True)
class _Step:
    """What every chunk shares: the gradient functions, the start weights and the step rule."""

    gradients: Callable[[Params, torch.Tensor, torch.Tensor], Params]  # members' own weights [c, ...]
    first_gradients: Callable[[Params, torch.Tensor, torch.Tensor], Params]  # step 0: the shared w_t
    start: Params
    etas: tuple[float, ...]
    clip_norm: float
    prox_alpha: float
    per_sample: bool
    ghost: GhostStep | None = None  # one step, summed: the clipped sum without each member's gradient (ghost.py)


GradientFn = Callable[[Params, torch.Tensor, torch.Tensor], Params]


def _gradient_functions(model: nn.Module, loss_fn: LossFn, per_sample: bool) -> tuple[GradientFn, GradientFn]:
    """(members' own weights, shared weights): params [c, ...] (or unbatched), x [c, B, ...], y [c, B]
    -> each member's batch gradient [c, ...] (per-batch) or per-sample gradients [c, B, ...]
    (per-sample: the loss of a batch of 1). With shared weights (step 0, every member at w_t) the
    forward pass is one ordinary batched pass: no per-member weight copies."""
    buffers = dict(model.named_buffers())

    def batch_loss(params, x, y):
        return loss_fn(functional_call(model, (params, buffers), (x,)), y)

    # x, y arrive sample-major ([B, c, ...]): the members' axis next to the channels, so that the
    # batched convolution's grouped input is a view, not a copy
    if not per_sample:
        return vmap(grad(batch_loss), in_dims=(0, 1, 1)), vmap(grad(batch_loss), in_dims=(None, 1, 1))

    def sample_loss(params, x, y):
        return batch_loss(params, x.unsqueeze(0), y.unsqueeze(0))

    samples = vmap(grad(sample_loss), in_dims=(None, 0, 0))
    return vmap(samples, in_dims=(0, 1, 1)), vmap(samples, in_dims=(None, 1, 1))


def default_member_chunk(batch_size: int, values_per_member: int, per_sample: bool,
                         device: torch.device | str = "cpu") -> int:
    """Members trained at once: about ``samples`` sample-gradients and ``values`` stacked gradient
    values per chunk (the budgets above for the device's type)."""
    gpu = torch.device(device).type != "cpu"
    samples, values = (GPU_CHUNK_SAMPLES, GPU_CHUNK_VALUES) if gpu else (CPU_CHUNK_SAMPLES, CPU_CHUNK_VALUES)
    stacked = values_per_member * (batch_size if per_sample else 1)
    return max(1, min(samples // max(1, batch_size), values // max(1, stacked)))


def _train_chunk(step: _Step, data: CohortData, index: torch.Tensor, counts: torch.Tensor,
                 summed: bool = False) -> Params:
    """All K steps of a chunk's members (equal batch size B). ``index``: [c, K, B] rows of
    ``data``. ``counts`` (device, int64 [2]) gains the clipped and the non-finite gradients. Returns
    the members' trained weights [c, ...], or with ``summed`` only their sum (the last step then
    adds the clipped gradients' weighted sum instead of forming each member's weights). No host
    synchronisation and no host-to-device copy, except on the CPU (where reading a count costs
    nothing) to skip zeroing when every gradient is finite."""
    params: Params = {}
    lead = 2 if step.per_sample else 1  # (member, sample) or (member,)
    c, bsz, last = index.shape[0], index.shape[-1], len(step.etas) - 1
    for k, eta in enumerate(step.etas):
        rows = index[:, k].t()  # [B, c]
        xb, yb = data.x[rows], data.y[rows]
        if summed and last == 0 and step.ghost is not None:
            ghosted = _ghost_chunk(step, xb, yb, counts, c, bsz, eta)
            if ghosted is not None:
                return ghosted
        grads = step.first_gradients(step.start, xb, yb) if k == 0 else step.gradients(params, xb, yb)
        g = [grads[n] for n in step.start]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(t.flatten(lead), dim=lead) for t in g]),
                                        dim=0)
        bad = ~torch.isfinite(norm)  # NaN/Inf gradient -> zero (its norm 0 <= V), counted on the device
        factor = torch.where(bad, 0.0, (step.clip_norm / norm.clamp_min(1e-30)).clamp(max=1.0))  # min(1, V/norm)
        counts[0] += (norm > step.clip_norm).sum()
        counts[1] += bad.sum()
        finite = not SYNC_FREE and xb.device.type == "cpu" and not bool(bad.any())  # CPU: skip the pass if all finite
        with torch.no_grad():
            for n, t in zip(step.start, g):
                if not finite:
                    t.nan_to_num_(0.0, 0.0, 0.0)  # a zeroed gradient's entries (factor 0) must not stay NaN
                pull = params[n] - step.start[n] if k and step.prox_alpha > 0 else None  # at the pre-step weights
                if summed and k == last:  # sum_i w_i - eta sum_i clip(g_i) (- eta alpha sum_i (w_i - w_t))
                    total = c * step.start[n] if k == 0 else params[n].sum(0)
                    weighted = factor.reshape(-1) @ t.reshape(factor.numel(), -1)  # one GEMV: sum_i f_i g_i
                    total.add_(weighted.view_as(total), alpha=-eta / (bsz if step.per_sample else 1))
                    if pull is not None:
                        total.add_(pull.sum(0), alpha=-eta * step.prox_alpha)
                    params[n] = total
                    continue
                if step.per_sample:  # eta/B sum_j clip(g_j)
                    clipped, scale = torch.einsum("cb,cb...->c...", factor, t), -eta / bsz
                    params[n] = torch.add(step.start[n], clipped, alpha=scale) if k == 0 else \
                        params[n].add_(clipped, alpha=scale)
                else:  # eta clip(g)
                    f = factor.view(-1, *([1] * (t.dim() - 1)))
                    params[n] = torch.addcmul(step.start[n], t, f, value=-eta) if k == 0 else \
                        params[n].addcmul_(t, f, value=-eta)
                if pull is not None:  # FedProx: the pull to w_t, added after clipping (zero at step 0)
                    params[n].add_(pull, alpha=-eta * step.prox_alpha)
    return params


def _ghost_chunk(step: _Step, xb: torch.Tensor, yb: torch.Tensor, counts: torch.Tensor, c: int, bsz: int,
                 eta: float) -> Params | None:
    """K = 1, summed: c w_t - eta sum_i clip(g_i) (per-sample: eta/B sum_ij clip(g_ij)) from ghost norms
    (ghost.py), counting as :func:`_train_chunk` does; None where the model does not allow it."""
    assert step.ghost is not None
    ghosted = step.ghost(xb, yb)
    if ghosted is None:
        return None
    sq, weighted = ghosted
    norm = sq.sqrt()
    bad = ~torch.isfinite(norm)
    factor = torch.where(bad, 0.0, (step.clip_norm / norm.clamp_min(1e-30)).clamp(max=1.0))
    counts[0] += (norm > step.clip_norm).sum()
    counts[1] += bad.sum()
    finite = not SYNC_FREE and xb.device.type == "cpu" and not bool(bad.any())
    with torch.no_grad():
        sums = weighted(factor, finite)
        scale = -eta / (bsz if step.per_sample else 1)
        return {n: (c * step.start[n]).add_(sums[n], alpha=scale) for n in step.start}


def train_cohort(
    model: nn.Module,
    data: CohortData,
    rows: Sequence[int] | np.ndarray,
    streams: CohortStreams,
    settings: CohortSettings,
    *,
    keep_members: bool = False,
    summed_noise: torch.Generator | SecureGaussian | None = None,
) -> CohortResult:
    """K clipped GD steps and Gaussian noise for the members ``rows`` of ``data`` (resident on the
    model's device), starting from ``model``'s weights, with ``settings`` (:class:`CohortSettings`:
    step sizes, V, B, sigma, FedProx alpha, clipping, loss, member chunk); member j of the round
    (``rows[j]``) draws from ``streams`` at position j. The host's work per round is a few calls per
    chunk, none per member; the only synchronisations are the two counts read at the end.

    ``model`` is not changed. Members whose data sizes give different batch sizes
    (B = min(batch_size, n_i)) are trained in groups of equal batch size. ``clipping``:
    "per-batch" (the mean batch gradient clipped to V) or "per-sample" (every sample's gradient
    clipped to V, then averaged over B), as in ``local_update``. ``member_chunk``: members trained
    at once (None: :func:`default_member_chunk`; memory and speed, and the chunks that
    :class:`KeyedStreams` keys its draws by).

    Noise: by default each member's N(0, sigma^2) per value comes from ``streams``. With
    ``summed_noise`` (a generator on the model's device, or SecureGaussian) the cohort draws the
    noise of its *sum* at once, sqrt(M) sigma N(0, 1) per value for M members: the sum of M
    independent N(0, sigma^2) has exactly this distribution, so the reply is distributed
    identically and every bound, the per-member curious-server bound included, holds unchanged
    (docs/MATH.md §14.2). Members' individual uploads are then never formed (``keep_members`` must
    be False).
    """
    if not isinstance(settings, CohortSettings):
        raise TypeError(f"settings must be a CohortSettings, got {type(settings).__name__}")
    etas, sigma, loss_fn = settings.step_sizes, settings.sigma, settings.loss_fn
    summed = summed_noise is not None
    if summed and keep_members:
        raise ValueError("keep_members needs per-member noise (summed_noise=None)")
    rows = np.asarray(rows, dtype=np.int64).reshape(-1)
    if len(rows) == 0:
        raise ValueError("a cohort needs at least one member")
    if rows.min() < 0 or rows.max() >= len(data):
        raise ValueError(f"rows must index the {len(data)} members of the data, got {rows.min()}..{rows.max()}")
    sizes = np.minimum(settings.batch_size, data.sizes[rows])
    if sizes.min() < 1:
        raise ValueError("every member needs data and batch_size >= 1")
    per_sample = settings.clipping == "per-sample"
    start = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    device = next(iter(start.values())).device
    if data.device != device:
        raise ValueError(f"the cohort's data is on {data.device}, the model on {device}: put both on one device")
    ghost = ghost_step(model, loss_fn, per_sample) if len(etas) == 1 and not keep_members else None
    step = _Step(*_gradient_functions(model, loss_fn, per_sample), start, etas, settings.clip_norm,
                 settings.prox_alpha, per_sample, ghost)
    values = sum(t.numel() for t in start.values())
    noise_order = [n for n, _ in model.named_parameters()]  # the order add_gaussian_noise_ draws in
    order = np.argsort(sizes, kind="stable")  # groups of equal B, members in their order within a group
    on_device = torch.as_tensor(rows[order], device=device)  # the round's one host-to-device copy
    offsets, data_sizes = data.offsets_on_device[on_device], data.sizes_on_device[on_device]
    total = {n: torch.zeros_like(start[n]) for n in start}
    kept = {n: torch.empty(len(rows), *start[n].shape, dtype=start[n].dtype, device=device) for n in start} \
        if keep_members else None
    positions = torch.as_tensor(order, device=device) if kept is not None else None
    counts = torch.zeros(2, dtype=torch.int64, device=device)  # clipped, non-finite
    counted = 0
    bounds = np.flatnonzero(np.diff(sizes[order])) + 1
    for lo_group, hi_group in zip([0, *bounds], [*bounds, len(rows)]):
        bsz = int(sizes[order[lo_group]])
        chunk = settings.member_chunk or default_member_chunk(bsz, values, per_sample, device)
        for lo in range(lo_group, hi_group, chunk):
            hi = min(lo + chunk, hi_group)
            pos = order[lo:hi]  # the chunk's positions in the round's member list
            local = streams.batches(pos, data.sizes[rows[pos]], data_sizes[lo:hi], bsz, len(etas))
            reduce = kept is None  # only the chunk's sum is needed: never form each member's weights
            trained = _train_chunk(step, data, local + offsets[lo:hi].view(-1, 1, 1), counts, reduce)
            counted += (hi - lo) * len(etas) * (bsz if per_sample else 1)
            if not summed and kept is not None:  # each member's own noise, on its upload
                streams.add_noise_(pos, trained, noise_order, sigma)
            elif not summed:  # each member's own noise (the same draws), summed
                for n, t in streams.noise_sum(pos, start, noise_order, sigma).items():
                    trained[n] += t
            for n, t in trained.items():
                total[n] += t if reduce else t.sum(0)
                if kept is not None and positions is not None:
                    kept[n].index_copy_(0, positions[lo:hi], t)
    if summed_noise is not None:
        scale = sigma * math.sqrt(len(rows))
        total = {n: gaussian_noised(total[n], scale, summed_noise) for n in noise_order}
    clipped, nonfinite = counts.tolist()  # the round's one synchronisation
    return CohortResult(
        total=total,
        members={n: kept[n] for n in noise_order} if kept is not None else None,
        clipped_fraction=clipped / counted,
        batch_sizes=tuple(int(b) for b in sizes),
        nonfinite_gradients=nonfinite,
    )


def cohort_update(
    model: nn.Module,
    members: Sequence[Member],
    settings: CohortSettings,
    *,
    keep_members: bool = False,
    summed_noise: torch.Generator | SecureGaussian | None = None,
) -> CohortResult:
    """:func:`train_cohort` for members that bring their own data and generators
    (:class:`~.cohort_data.MemberStreams`): stream for stream, each member's upload equals
    ``local_update`` + ``add_gaussian_noise_`` with its generators (to float tolerance). The data is
    copied to the model's device once per call; the generators are drawn member by member."""
    if not members:
        raise ValueError("a cohort needs at least one member")
    if summed_noise is None and any(m.noise_generator is None for m in members):
        raise ValueError("every member needs a noise_generator (or pass summed_noise)")
    device = next(p for p in model.parameters()).device
    data = CohortData.stack([m.x for m in members], [m.y for m in members], device)
    streams = MemberStreams([m.batch_generator for m in members], [m.noise_generator for m in members])
    return train_cohort(model, data, np.arange(len(members)), streams, settings, keep_members=keep_members,
                        summed_noise=summed_noise)

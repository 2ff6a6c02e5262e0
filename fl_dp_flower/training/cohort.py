"""A cohort of clients trained at once: one SuperNode stands for many virtual clients.

Each member runs exactly the local update of :func:`~fl_dp_flower.training.local_update.local_update`
— K steps of its own mini-batch gradient, clipped to V over all parameters (per-batch: the mean
batch gradient; per-sample: every sample's gradient, then their mean), FedProx's pull added after
clipping — and then adds its own N(0, sigma^2) noise to every value, as the single-client
ClientApp does. The members' parameters are stacked along a leading axis and their gradients
computed in one call (``torch.func.vmap`` of ``grad`` through ``functional_call``; per-sample: a
second ``vmap`` over the batch), so a node pays Flower's message, process and model-loading costs
once per cohort, not once per client. Members draw their batches and their noise from their own
generators, in the same order as the single-client code: with the same generators the result
equals running ``local_update`` + ``add_gaussian_noise_`` once per member (to float tolerance;
tests/strategies/test_cohort.py, tests/training/test_cohort_trainer.py).

Speed: members are trained in chunks (``member_chunk`` members at a time, all K steps of a chunk
before the next), so each chunk's stacked parameters, activations and gradients stay small enough
for the CPU's caches and the allocator's reused memory; clipping and the step are fused into one
in-place pass per tensor. Chunking changes no result: members are independent.

Device-agnostic: the stacked parameters live on the model's device, and each member's noise is
drawn there from its own generator.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from fl_dp_flower.vocabulary import CLIPPING_MODES

from .local_update import LossFn, zero_nonfinite
from .noise import SecureGaussian, gaussian_noised

# Default chunk budgets (members per chunk = min(samples // B, values // stacked values per member)):
# on a CPU small enough for the caches, on a GPU large enough to fill it.
CPU_CHUNK_SAMPLES, CPU_CHUNK_VALUES = 256, 4_000_000
GPU_CHUNK_SAMPLES, GPU_CHUNK_VALUES = 16_384, 256_000_000

Params = dict[str, torch.Tensor]


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
    """What every chunk shares: the gradient function, the start weights and the step rule."""

    gradients: Callable[[Params, torch.Tensor, torch.Tensor], Params]
    start: Params
    etas: tuple[float, ...]
    clip_norm: float
    prox_alpha: float
    per_sample: bool
    device: torch.device


def _gradient_function(model: nn.Module, loss_fn: LossFn, per_sample: bool
                       ) -> Callable[[Params, torch.Tensor, torch.Tensor], Params]:
    """params [c, ...], x [c, B, ...], y [c, B] -> each member's batch gradient [c, ...] (per-batch)
    or each member's per-sample gradients [c, B, ...] (per-sample: the loss of a batch of 1)."""
    buffers = dict(model.named_buffers())

    def batch_loss(params, x, y):
        return loss_fn(functional_call(model, (params, buffers), (x,)), y)

    if not per_sample:
        return vmap(grad(batch_loss))

    def sample_loss(params, x, y):
        return batch_loss(params, x.unsqueeze(0), y.unsqueeze(0))

    return vmap(vmap(grad(sample_loss), in_dims=(None, 0, 0)))


def default_member_chunk(batch_size: int, values_per_member: int, per_sample: bool,
                         device: torch.device | str = "cpu") -> int:
    """Members trained at once: about ``samples`` sample-gradients and ``values`` stacked gradient
    values per chunk (the budgets above for the device's type)."""
    gpu = torch.device(device).type != "cpu"
    samples, values = (GPU_CHUNK_SAMPLES, GPU_CHUNK_VALUES) if gpu else (CPU_CHUNK_SAMPLES, CPU_CHUNK_VALUES)
    stacked = values_per_member * (batch_size if per_sample else 1)
    return max(1, min(samples // max(1, batch_size), values // max(1, stacked)))


def _train_chunk(step: _Step, chunk: Sequence[Member], bsz: int) -> tuple[Params, int, int]:
    """All K steps of ``chunk``'s members (equal batch size B). Returns (their trained weights
    [c, ...], clipped gradients, non-finite gradients)."""
    c, device = len(chunk), step.device
    params = {n: t.expand(c, *t.shape).clone() for n, t in step.start.items()}
    xs = torch.cat([m.x.to(device) for m in chunk])
    ys = torch.cat([m.y.to(device) for m in chunk])
    offsets, batches = 0, []
    for m in chunk:  # the same K draws, from the same stream, in the same order as local_update
        gen, size = m.batch_generator, len(m.y)
        draws = [torch.randperm(size, generator=gen, device=gen.device)[:bsz].to(device) for _ in step.etas]
        batches.append(torch.stack(draws) + offsets)
        offsets += size
    index = torch.stack(batches)  # [c, K, B]: rows of xs
    clipped = nonfinite = 0
    for k, eta in enumerate(step.etas):
        idx = index[:, k]
        grads = step.gradients(params, xs[idx], ys[idx])
        lead = 2 if step.per_sample else 1  # (member, sample) or (member,)
        norm = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(grads[n].flatten(lead), dim=lead) for n in params]), dim=0)
        fixed, norm, bad = zero_nonfinite([grads[n] for n in params], norm)  # NaN/Inf -> 0
        factor = (step.clip_norm / norm.clamp_min(1e-30)).clamp(max=1.0)  # min(1, V / norm)
        clipped, nonfinite = clipped + int((norm > step.clip_norm).sum()), nonfinite + bad
        with torch.no_grad():
            for (n, p), g in zip(params.items(), fixed):
                pull = p - step.start[n] if step.prox_alpha > 0 else None  # FedProx, at the pre-step weights
                if step.per_sample:  # p -= eta/B sum_j clip(g_j)
                    p.add_(torch.einsum("cb,cb...->c...", factor, g), alpha=-eta / bsz)
                else:  # p -= eta clip(g)
                    p.addcmul_(g, factor.view(-1, *([1] * (g.dim() - 1))), value=-eta)
                if pull is not None:  # the pull to w_t, added after clipping
                    p.add_(pull, alpha=-eta * step.prox_alpha)
    return params, clipped, nonfinite


def _check(members: Sequence[Member], etas: Sequence[float], step_sizes: Sequence[float], clip_norm: float,
           sigma: float, prox_alpha: float, clipping: str, keep_members: bool, summed: bool,
           member_chunk: int | None) -> None:
    if not members:
        raise ValueError("a cohort needs at least one member")
    if not etas or not all(math.isfinite(e) and e > 0 for e in etas):
        raise ValueError(f"step_sizes must be a non-empty sequence of finite numbers > 0, got {step_sizes!r}")
    if not (math.isfinite(clip_norm) and clip_norm > 0):
        raise ValueError(f"clip_norm must be finite and > 0, got {clip_norm!r}")
    if not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be finite and > 0, got {sigma!r}")
    if not (math.isfinite(prox_alpha) and prox_alpha >= 0):
        raise ValueError(f"prox_alpha must be finite and >= 0, got {prox_alpha!r}")
    if clipping not in CLIPPING_MODES:
        raise ValueError(f"clipping must be one of {CLIPPING_MODES}, got {clipping!r}")
    if member_chunk is not None and (isinstance(member_chunk, bool) or not isinstance(member_chunk, int)
                                     or member_chunk < 1):
        raise ValueError(f"member_chunk must be None or an integer >= 1, got {member_chunk!r}")
    if summed and keep_members:
        raise ValueError("keep_members needs per-member noise (summed_noise=None)")
    if not summed and any(m.noise_generator is None for m in members):
        raise ValueError("every member needs a noise_generator (or pass summed_noise)")


def cohort_update(
    model: nn.Module,
    members: Sequence[Member],
    *,
    step_sizes: Sequence[float],
    clip_norm: float,
    batch_size: int,
    sigma: float,
    prox_alpha: float = 0.0,
    clipping: str = "per-batch",
    loss_fn: LossFn = F.cross_entropy,
    keep_members: bool = False,
    summed_noise: torch.Generator | SecureGaussian | None = None,
    member_chunk: int | None = None,
) -> CohortResult:
    """K clipped GD steps and Gaussian noise for every member, starting from ``model``'s weights.

    ``model`` is not changed. Members whose data sizes give different batch sizes
    (B = min(batch_size, n_i)) are trained in groups of equal batch size. ``clipping``:
    "per-batch" (the mean batch gradient clipped to V) or "per-sample" (every sample's gradient
    clipped to V, then averaged over B), as in ``local_update``. ``member_chunk``: members trained
    at once (None: :func:`default_member_chunk`; memory and speed only, the result is the same).

    Noise: by default each member draws N(0, sigma^2) per value from its own ``noise_generator``
    (the stream-for-stream equivalent of the single-client update). With ``summed_noise`` (a
    generator on the model's device) the cohort draws the noise of its *sum* at once,
    sqrt(M) sigma N(0, 1) per value for M members: the sum of M independent N(0, sigma^2) has
    exactly this distribution, so the reply is distributed identically and every bound, the
    per-member curious-server bound included, holds unchanged (docs/MATH.md §14.2). It costs one
    draw per value instead of M. Members' individual uploads are then never formed
    (``keep_members`` must be False).
    """
    etas = tuple(float(e) for e in step_sizes)
    summed = summed_noise is not None
    _check(members, etas, step_sizes, clip_norm, sigma, prox_alpha, clipping, keep_members, summed, member_chunk)
    sizes = [min(int(batch_size), len(m.y)) for m in members]
    if min(sizes) < 1:
        raise ValueError("every member needs data and batch_size >= 1")
    per_sample = clipping == "per-sample"
    start = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    device = next(iter(start.values())).device
    step = _Step(_gradient_function(model, loss_fn, per_sample), start, etas, float(clip_norm), float(prox_alpha),
                 per_sample, device)
    values = sum(t.numel() for t in start.values())
    noise_order = [n for n, _ in model.named_parameters()]  # the order add_gaussian_noise_ draws in
    total = {n: torch.zeros_like(start[n]) for n in start}  # summed noise: the noiseless sum, noised below
    kept: dict[int, Params] = {}
    clipped = nonfinite = counted = 0
    for bsz in sorted(set(sizes)):
        group = [i for i, s in enumerate(sizes) if s == bsz]
        chunk = member_chunk or default_member_chunk(bsz, values, per_sample, device)
        for lo in range(0, len(group), chunk):
            ids = group[lo:lo + chunk]
            trained, c, bad = _train_chunk(step, [members[i] for i in ids], bsz)
            clipped, nonfinite = clipped + c, nonfinite + bad
            counted += len(ids) * len(etas) * (bsz if per_sample else 1)
            if summed:
                for n, t in trained.items():
                    total[n] += t.sum(0)
                continue
            for j, i in enumerate(ids):  # each member's own noise, from its own stream
                source = members[i].noise_generator
                assert source is not None  # checked in _check
                noisy = {n: gaussian_noised(trained[n][j], float(sigma), source) for n in noise_order}
                for n, t in noisy.items():
                    total[n] += t
                if keep_members:
                    kept[i] = noisy
    if summed_noise is not None:
        scale = float(sigma) * math.sqrt(len(members))
        total = {n: gaussian_noised(total[n], scale, summed_noise) for n in noise_order}
    return CohortResult(
        total=total,
        members={n: torch.stack([kept[i][n] for i in range(len(members))]) for n in noise_order} if keep_members
        else None,
        clipped_fraction=clipped / counted,
        batch_sizes=tuple(sizes),
        nonfinite_gradients=nonfinite,
    )

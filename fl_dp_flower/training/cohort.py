"""A cohort of clients trained at once: one SuperNode stands for many virtual clients.

Each member runs exactly the local update of :func:`~fl_dp_flower.training.local_update.local_update`
with per-batch clipping — K steps of its own mini-batch gradient, clipped to V over all
parameters, FedProx's pull added after clipping — and then adds its own N(0, sigma^2) noise to
every value, as the single-client ClientApp does. The members' parameters are stacked along a
leading axis and their gradients computed in one call (``torch.func.vmap`` of ``grad`` through
``functional_call``), so a node pays Flower's message, process and model-loading costs once per
cohort, not once per client. Members draw their batches and their noise from their own
generators, in the same order as the single-client code: with the same generators the result
equals running ``local_update`` + ``add_gaussian_noise_`` once per member (to float tolerance;
tests/strategies/test_cohort.py).

Device-agnostic: the stacked parameters live on the model's device, and each member's noise is
drawn there from its own generator.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from .local_update import LossFn, zero_nonfinite
from .noise import SecureGaussian, gaussian_noised


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
    ``clipped_fraction``: share of (member, step) gradients whose norm exceeded V.
    ``nonfinite_gradients``: (member, step) gradients that were not finite, replaced by zero."""

    total: dict[str, torch.Tensor]
    members: dict[str, torch.Tensor] | None
    clipped_fraction: float
    batch_sizes: tuple[int, ...]
    nonfinite_gradients: int = 0


def cohort_update(
    model: nn.Module,
    members: Sequence[Member],
    *,
    step_sizes: Sequence[float],
    clip_norm: float,
    batch_size: int,
    sigma: float,
    prox_alpha: float = 0.0,
    loss_fn: LossFn = F.cross_entropy,
    keep_members: bool = False,
    summed_noise: torch.Generator | SecureGaussian | None = None,
) -> CohortResult:
    """K clipped GD steps and Gaussian noise for every member, starting from ``model``'s weights.

    ``model`` is not changed. Members whose data sizes give different batch sizes
    (B = min(batch_size, n_i)) are trained in groups of equal batch size.

    Noise: by default each member draws N(0, sigma^2) per value from its own ``noise_generator``
    (the stream-for-stream equivalent of the single-client update). With ``summed_noise`` (a
    generator on the model's device) the cohort draws the noise of its *sum* at once,
    sqrt(M) sigma N(0, 1) per value for M members: the sum of M independent N(0, sigma^2) has
    exactly this distribution, so the reply is distributed identically and every bound, the
    per-member curious-server bound included, holds unchanged (docs/MATH.md §14.2). It costs one
    draw per value instead of M. Members' individual uploads are then never formed
    (``keep_members`` must be False).
    """
    if not members:
        raise ValueError("a cohort needs at least one member")
    etas = [float(e) for e in step_sizes]
    if not etas or not all(math.isfinite(e) and e > 0 for e in etas):
        raise ValueError(f"step_sizes must be a non-empty sequence of finite numbers > 0, got {step_sizes!r}")
    if not (math.isfinite(clip_norm) and clip_norm > 0):
        raise ValueError(f"clip_norm must be finite and > 0, got {clip_norm!r}")
    if not (math.isfinite(sigma) and sigma > 0):
        raise ValueError(f"sigma must be finite and > 0, got {sigma!r}")
    names = [n for n, p in model.named_parameters() if p.requires_grad]
    start = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    buffers = dict(model.named_buffers())
    device = next(iter(start.values())).device
    if summed_noise is not None and keep_members:
        raise ValueError("keep_members needs per-member noise (summed_noise=None)")
    sizes = [min(int(batch_size), len(m.y)) for m in members]
    if min(sizes) < 1:
        raise ValueError("every member needs data and batch_size >= 1")

    def batch_loss(params, x, y):
        return loss_fn(functional_call(model, (params, buffers), (x,)), y)

    per_member_grad = vmap(grad(batch_loss))
    trained: dict[int, dict[str, torch.Tensor]] = {}
    noiseless = {n: torch.zeros_like(start[n]) for n in names}  # sum of the members' trained weights
    clipped, nonfinite = 0, 0
    for bsz in sorted(set(sizes)):
        group = [i for i, s in enumerate(sizes) if s == bsz]
        params = {n: start[n].expand(len(group), *start[n].shape).clone() for n in names}
        xs = [members[i].x.to(device) for i in group]
        ys = [members[i].y.to(device) for i in group]
        for eta in etas:
            batches = []
            for i, x in zip(group, xs):  # the same draw, from the same stream, as local_update
                gen = members[i].batch_generator
                batches.append(torch.randperm(len(members[i].y), generator=gen, device=gen.device)[:bsz].to(device))
            xb = torch.stack([x[idx] for x, idx in zip(xs, batches)])
            yb = torch.stack([y[idx] for y, idx in zip(ys, batches)])
            grads = per_member_grad(params, xb, yb)
            sq = sum(grads[n].flatten(1).pow(2).sum(1) for n in names)
            norm = torch.sqrt(sq)  # each member's gradient norm over all parameters
            fixed, norm, bad = zero_nonfinite([grads[n] for n in names], norm)  # NaN/Inf -> 0
            grads, nonfinite = dict(zip(names, fixed)), nonfinite + bad
            factor = (clip_norm / norm.clamp_min(1e-30)).clamp(max=1.0)
            clipped += int((norm > clip_norm).sum())
            with torch.no_grad():
                for n in names:
                    g = grads[n] * factor.view(-1, *([1] * (grads[n].dim() - 1)))
                    if prox_alpha > 0:  # FedProx: the pull to w_t, added after clipping
                        g = g + prox_alpha * (params[n] - start[n])
                    params[n] -= eta * g
        if summed_noise is None:  # each member's trained weights get their own noise below
            for j, i in enumerate(group):
                trained[i] = {n: params[n][j] for n in names}
        else:  # only the sum is noised and sent
            for n in names:
                noiseless[n] += params[n].sum(0)

    total = {n: torch.zeros_like(start[n]) for n in names}
    kept = {n: [] for n in names} if keep_members else None
    noise_order = [n for n, _ in model.named_parameters()]  # the order add_gaussian_noise_ draws in
    if summed_noise is not None:
        scale = float(sigma) * math.sqrt(len(members))
        for n in noise_order:
            t = noiseless[n]
            total[n] = gaussian_noised(t, scale, summed_noise)
        return CohortResult(total=total, members=None, clipped_fraction=clipped / (len(members) * len(etas)),
                            batch_sizes=tuple(sizes), nonfinite_gradients=nonfinite)
    if any(m.noise_generator is None for m in members):
        raise ValueError("every member needs a noise_generator (or pass summed_noise)")
    for i, member in enumerate(members):
        source = member.noise_generator
        assert source is not None  # checked above
        for n in noise_order:
            w = trained[i][n]
            noisy = gaussian_noised(w, float(sigma), source)
            total[n] += noisy
            if kept is not None:
                kept[n].append(noisy)
    return CohortResult(
        total=total,
        members={n: torch.stack(v) for n, v in kept.items()} if kept is not None else None,
        clipped_fraction=clipped / (len(members) * len(etas)),
        batch_sizes=tuple(sizes),
        nonfinite_gradients=nonfinite,
    )

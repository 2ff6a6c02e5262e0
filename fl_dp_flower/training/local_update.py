"""One client's local update: K steps of clipped mini-batch gradient descent (docs/MATH.md §2, §13).

Step k (k = 0..K-1, step size eta_k from ``privacy.schedules.step_sizes``):

    S_k   = B distinct indices of the local data (drawn with ``generator``, independent of the data)
          | every index independently with probability q = B/n   (batch_sampling="poisson", docs/MATH.md §23)
    g_k   = clip_V( (1/B) sum_{j in S_k} grad l(w_k; xi_j) )           per-batch  (paper Eq. 2)
          | (1/B) sum_{j in S_k} clip_V( grad l(w_k; xi_j) )           per-sample (DP-SGD style, §13)
    g_k   = clip_V( (1/B) sum_{j in S_k} clip_V( grad l(w_k; xi_j) ) ) Poisson: B is the EXPECTED size
    g_k  += alpha (w_k - w_t)                                          FedProx (Eq. 4), after clipping
    w_{k+1} = w_k - eta_k g_k

clip_V(g) = g * min(1, V / ||g||) with ||.|| the L2 norm over ALL trainable parameters jointly.
A gradient whose norm is not finite (NaN/Inf from an overflowing loss or a bad sample) is replaced
by zero before clipping (:func:`zero_nonfinite`; counted in ``nonfinite_gradients``): zero has norm
<= V, so every sensitivity bound still holds, and the upload stays finite.
Plain gradient descent: no momentum, no weight decay, no optimizer state. These are exactly the
assumptions of the sensitivity terms the accountant uses (per step, replacing one sample moves g_k by
at most 2V per-batch and 2V/B per-sample). Everything runs on the model's device.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call, grad, vmap

from fl_dp_flower.vocabulary import BATCH_SAMPLINGS, CLIPPING_MODES

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass(frozen=True)
class LocalUpdateStats:
    """loss: mean mini-batch loss over the K steps (at the pre-step weights);
    clipped_fraction: fraction of clipped gradients (of steps per-batch, of per-sample gradients
    per-sample); steps: K; batch_size: the B actually used; nonfinite_gradients: gradients (steps
    per-batch, per-sample gradients per-sample) that were not finite and were replaced by zero."""

    loss: float
    clipped_fraction: float
    steps: int
    batch_size: int
    nonfinite_gradients: int = 0


def zero_nonfinite(grads: Sequence[torch.Tensor], norm: torch.Tensor) -> tuple[list[torch.Tensor], torch.Tensor, int]:
    """Replace by zero every gradient whose norm is not finite.

    ``norm``: shape () (one gradient) or (N,) (N gradients stacked on the leading axis of every
    tensor of ``grads``). Returns (grads, norm with 0 for the replaced ones, how many were replaced).
    """
    bad = ~torch.isfinite(norm)
    count = int(bad.sum())
    if count == 0:
        return list(grads), norm, 0
    out = []
    for g in grads:
        mask = bad.reshape(*bad.shape, *([1] * (g.dim() - bad.dim())))
        out.append(torch.where(mask, torch.zeros((), dtype=g.dtype, device=g.device), g))
    return out, torch.where(bad, torch.zeros((), dtype=norm.dtype, device=norm.device), norm), count

def _clip_factor(norm: torch.Tensor, clip_norm: float) -> torch.Tensor:
    """min(1, V / norm), elementwise; 1 for a zero gradient."""
    return (clip_norm / norm.clamp_min(1e-30)).clamp(max=1.0)


def _per_batch_grad(model, names, params, xb, yb, loss_fn, clip_norm):
    """Clipped mean gradient of the batch. Returns (grads, loss, number_clipped, number_nonfinite)."""
    loss = loss_fn(model(xb), yb)
    grads = list(torch.autograd.grad(loss, params))
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))  # L2 over all parameters
    grads, norm, bad = zero_nonfinite(grads, norm)
    torch._foreach_mul_(grads, _clip_factor(norm, clip_norm))  # fresh tensors: scale in place
    return grads, float(loss.detach()), int(norm > clip_norm), bad


def _per_sample_grad(model, names, params, xb, yb, loss_fn, clip_norm, chunk, divisor=None):
    """Sum of per-sample clipped gradients over ``divisor`` (default: the batch's size; torch.func).
    Returns (grads, loss, number_clipped, number_nonfinite)."""
    buffers = dict(model.named_buffers())

    def sample_loss(p, x, y):
        out = functional_call(model, (p, buffers), (x.unsqueeze(0),))
        loss = loss_fn(out, y.unsqueeze(0))
        return loss, loss

    # randomness="different": a model with dropout draws each sample's own mask, as a plain forward pass would
    per_sample = vmap(grad(sample_loss, has_aux=True), in_dims=(None, 0, 0), randomness="different")
    p = {n: t.detach() for n, t in zip(names, params)}
    total = [torch.zeros_like(t) for t in params]
    loss_sum, clipped, nonfinite = 0.0, 0, 0
    for start in range(0, len(yb), chunk):
        g, losses = per_sample(p, xb[start : start + chunk], yb[start : start + chunk])
        g = [g[n] for n in names]
        norms = torch.sqrt(sum(gi.flatten(1).pow(2).sum(1) for gi in g))
        g, norms, bad = zero_nonfinite(g, norms)
        nonfinite += bad
        factor = _clip_factor(norms, clip_norm)
        for acc, gi in zip(total, g):
            acc += torch.einsum("b,b...->...", factor, gi)
        loss_sum += float(losses.sum())
        clipped += int((norms > clip_norm).sum())
    b = len(yb)
    return [t / (divisor or b) for t in total], loss_sum / max(b, 1), clipped, nonfinite


def _poisson_grad(model, names, params, xb, yb, loss_fn, clip_norm, chunk, expected):
    """Poisson batch (docs/MATH.md §23): clip_V( sum of per-sample clipped gradients / expected B ).

    The sum is over the realized batch (possibly empty: a zero step), the divisor is the expected size
    B, fixed whatever was drawn, and the outer clip (a projection) bounds the step by V whatever the
    batch's size, so one sample moves it by at most V/B and any two points' steps differ by at most 2V."""
    if len(yb) == 0:
        return [torch.zeros_like(p) for p in params], 0.0, 0, 0
    grads, loss, clipped, bad = _per_sample_grad(model, names, params, xb, yb, loss_fn, clip_norm, chunk, expected)
    norm = torch.linalg.vector_norm(torch.stack(torch._foreach_norm(grads)))
    torch._foreach_mul_(grads, _clip_factor(norm, clip_norm))
    return grads, loss, clipped, bad


def local_update(
    model: nn.Module,
    x: torch.Tensor,
    y: torch.Tensor,
    *,
    step_sizes: Sequence[float],
    clip_norm: float,
    clipping: str = "per-batch",
    batch_size: int,
    prox_alpha: float = 0.0,
    generator: torch.Generator | None,
    loss_fn: LossFn = F.cross_entropy,
    per_sample_chunk: int = 16,
    batches: torch.Tensor | None = None,
    batch_sampling: str = "fixed",
) -> LocalUpdateStats:
    """Run exactly K = len(step_sizes) clipped GD steps on ``model`` in place.

    x, y: the client's whole local data (moved to the model's device). clip_norm: V (L2, > 0).
    batch_size: B; if B > len(y) every batch is the whole data (B = len(y), reported in the
    stats). prox_alpha: FedProx alpha >= 0 (0 = FedAvg), anchored at the weights ``model`` holds
    on entry (w_t). generator: torch.Generator for the batch indices (any device).
    loss_fn(outputs, targets) must return the batch MEAN loss (per-sample: called on a batch of 1).
    per_sample_chunk: samples per vmap call (memory only; does not change the result).
    batches: optional [K, B] indices of the K batches, drawn elsewhere (the cohort trainer's
    :class:`~.cohort_data.KeyedStreams`; each row B distinct indices < len(y)), instead of
    ``randperm`` from ``generator`` (then unused).
    batch_sampling: "fixed" (B distinct indices per step) or "poisson" (every sample independently with
    probability q = B/n, per-sample clipping only, B <= n; docs/MATH.md §23). The draws stay here: the
    stats report B, never a realized batch.
    """
    if clipping not in CLIPPING_MODES:
        raise ValueError(f"clipping must be one of {CLIPPING_MODES}, got {clipping!r}")
    if batch_sampling not in BATCH_SAMPLINGS:
        raise ValueError(f"batch_sampling must be one of {BATCH_SAMPLINGS}, got {batch_sampling!r}")
    if batch_sampling == "poisson" and (clipping != "per-sample" or batch_size > len(y)):
        raise ValueError(f"batch_sampling 'poisson' needs per-sample clipping and batch_size <= the {len(y)} "
                         f"samples, got clipping {clipping!r} and batch_size {batch_size}")
    if not (math.isfinite(clip_norm) and clip_norm > 0):
        raise ValueError(f"clip_norm must be finite and > 0, got {clip_norm!r}")
    if not (math.isfinite(prox_alpha) and prox_alpha >= 0):
        raise ValueError(f"prox_alpha must be finite and >= 0, got {prox_alpha!r}")
    etas = [float(e) for e in step_sizes]
    if not etas or not all(math.isfinite(e) and e > 0 for e in etas):
        raise ValueError(f"step_sizes must be a non-empty sequence of finite numbers > 0, got {step_sizes!r}")
    n = len(y)
    if n == 0 or batch_size < 1:
        raise ValueError(f"need data (got {n} samples) and batch_size >= 1 (got {batch_size})")
    bsz = min(int(batch_size), n)
    if batches is not None and batch_sampling == "poisson":
        raise ValueError("batches (drawn elsewhere, B each) and batch_sampling 'poisson' exclude each other")
    if batches is None and generator is None:
        raise ValueError("local_update needs a generator (or the batches)")
    if batches is not None and (tuple(batches.shape) != (len(etas), bsz) or not bool((batches >= 0).all())
                                or not bool((batches < n).all())):
        raise ValueError(f"batches must be [K, B] = [{len(etas)}, {bsz}] indices in [0, {n - 1}], "
                         f"got shape {tuple(batches.shape)}")

    named = [(nm, p) for nm, p in model.named_parameters() if p.requires_grad]
    names, params = [nm for nm, _ in named], [p for _, p in named]
    device = params[0].device
    x, y = x.to(device), y.to(device)
    anchor = [p.detach().clone() for p in params] if prox_alpha > 0 else None

    losses, clipped, counted, nonfinite = [], 0, 0, 0
    rate = bsz / n
    for k, eta in enumerate(etas):
        if batches is not None:
            idx = batches[k].to(device)
        elif batch_sampling == "poisson":
            assert generator is not None  # checked above
            draw = torch.rand(n, generator=generator, device=generator.device) < rate
            idx = torch.nonzero(draw).flatten().to(device)
        else:
            assert generator is not None  # checked above
            idx = torch.randperm(n, generator=generator, device=generator.device)[:bsz].to(device)
        xb, yb = x[idx], y[idx]
        if batch_sampling == "poisson":
            grads, loss, c, bad = _poisson_grad(model, names, params, xb, yb, loss_fn, clip_norm, per_sample_chunk,
                                                bsz)
            counted += len(idx)
        elif clipping == "per-batch":
            grads, loss, c, bad = _per_batch_grad(model, names, params, xb, yb, loss_fn, clip_norm)
            counted += 1
        else:
            grads, loss, c, bad = _per_sample_grad(
                model, names, params, xb, yb, loss_fn, clip_norm, per_sample_chunk
            )
            counted += bsz
        clipped += c
        nonfinite += bad
        losses.append(loss)
        with torch.no_grad():
            if anchor is not None:  # proximal term added after clipping (Eq. 4)
                grads = [g + prox_alpha * (p - a) for g, p, a in zip(grads, params, anchor)]
            torch._foreach_add_(list[torch.Tensor](params), grads, alpha=-eta)
    return LocalUpdateStats(
        loss=sum(losses) / len(losses),
        clipped_fraction=clipped / max(counted, 1),
        steps=len(etas),
        batch_size=bsz,
        nonfinite_gradients=nonfinite,
    )


@torch.no_grad()
def evaluate_model(
    model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 512
) -> tuple[float, float]:
    """(mean cross-entropy loss, accuracy in [0, 1]) of ``model`` on (x, y), on the model's device."""
    if len(y) == 0:
        raise ValueError("evaluate_model needs at least one sample")
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    loss_sum, correct = 0.0, 0
    for s in range(0, len(y), batch_size):
        xb, yb = x[s : s + batch_size].to(device), y[s : s + batch_size].to(device)
        out = model(xb)
        loss_sum += float(F.cross_entropy(out, yb, reduction="sum"))
        correct += int((out.argmax(1) == yb).sum())
    model.train(was_training)
    return loss_sum / len(y), correct / len(y)

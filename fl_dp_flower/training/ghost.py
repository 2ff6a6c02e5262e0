"""The one-step summed update of a cohort without forming each member's gradient of a linear layer.

A cohort whose members take one step (K = 1) from the shared w_t and whose node sends only their sum
needs, per member, the norm of its gradient (to clip it) and then sum_i f_i g_i (f_i = min(1, V/||g_i||)).
``torch.func.vmap`` of ``grad`` forms every g_i: for the main job's tanh CNN, whose first linear layer
holds 16,384 of its 26,010 values, that is 64 KB written and read twice per member. Here one ordinary
batched forward and backward pass gives every linear and convolutional layer's input a and output
gradient go; then (Goodfellow's and Opacus's "ghost" identities)

- a linear layer's member gradient is G_i = sum_s go_s a_s^T over its B samples, whose squared norm
  is sum_{s,t} (a_s . a_t)(go_s . go_t) (B = 1: ||a||^2 ||go||^2), and sum_i f_i G_i is one matrix
  product (f-scaled go)^T a;
- a convolution's member gradient is formed (small: its kernels; from the input's patches), then
  summed with the f_i in one matrix-vector product.

The values are those of :func:`~.cohort._gradient_functions` up to float rounding (the same
gradients, summed in another order; tests/training/test_cohort_ghost.py). Used only where it
applies: every trainable parameter belongs to an ``nn.Linear`` on 2-D inputs or an ``nn.Conv2d``
(exactly these types; one group, numeric zero padding), each called once per forward pass and its
weights used only there (no tied weights), and the model has no buffers;
otherwise :func:`ghost_step` (or the step it returns) gives None and the caller keeps ``vmap``.

One pass over the whole chunk is the members' own passes only if the model's forward treats every
sample on its own: an operation across the batch (a mean over dim 0, a normalisation by batch
statistics) would let one member's data move another member's "gradient" past the clip, a privacy
leak that no numerical check of one chunk can rule out. So the ghost path is taken only for models
whose forward is known: the package's own (:class:`~.models.LeNet5`, :class:`~.models.TanhCNN`) and
an ``nn.Sequential`` of sample-wise layers (:data:`SAMPLEWISE`); a user's own module class keeps
``vmap``, which runs each member's forward pass separately (its cross-batch operations then act
within one member's batch, as in the single-client update).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import vmap

from .local_update import LossFn
from .models import LeNet5, TanhCNN

Params = dict[str, torch.Tensor]
#: (squared gradient norms [c] (per-batch) or [c, B] (per-sample), factors -> name -> sum of f-weighted gradients)
Weighted = Callable[[torch.Tensor, bool], Params]
GhostStep = Callable[[torch.Tensor, torch.Tensor], tuple[torch.Tensor, Weighted] | None]


class _Unsupported(Exception):
    pass


#: layers whose forward acts on each sample alone (the ghost path's nn.Sequential models)
SAMPLEWISE: tuple[type[nn.Module], ...] = (
    nn.Linear, nn.Conv2d, nn.Tanh, nn.ReLU, nn.Sigmoid, nn.ELU, nn.GELU, nn.LeakyReLU, nn.SiLU,
    nn.MaxPool2d, nn.AvgPool2d, nn.Identity)


def _forward_is_samplewise(model: nn.Module) -> bool:
    """True where the model's forward is known to treat each sample on its own (module docstring)."""
    if type(model) in (LeNet5, TanhCNN):  # the package's own models: forwards read in models.py
        return True
    if type(model) is not nn.Sequential:
        return False
    return all(type(m) in SAMPLEWISE or (type(m) is nn.Flatten and m.start_dim == 1)
               for m in model.children())


def _layers(model: nn.Module) -> list[tuple[str, nn.Module]] | None:
    """The model's parameterised layers, or None if a parameter lies outside the supported ones."""
    layers: list[tuple[str, nn.Module]] = []
    covered: set[int] = set()
    for prefix, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if not own:
            continue
        if type(module) is nn.Linear or (type(module) is nn.Conv2d and module.groups == 1  # exact types: a subclass may compute otherwise
                                         and module.padding_mode == "zeros" and not isinstance(module.padding, str)):
            layers.append((prefix, module))
            covered.update(id(p) for _, p in own)
        else:
            return None
    owners = [id(p) for _, m in model.named_modules(remove_duplicate=False) for p in m.parameters(recurse=False)]
    if len(owners) != len(set(owners)):  # a parameter shared by two modules (tied weights)
        return None
    params = list(model.parameters())
    if not layers or any(not p.requires_grad for p in params) or len(covered) != len(params) \
            or any(True for _ in model.buffers()):
        return None
    return layers


def _conv_sample_gradients(module: nn.Conv2d, a: torch.Tensor, go: torch.Tensor) -> torch.Tensor:
    """Every sample's weight gradient [N, out, in * kh * kw] from the layer's input a [N, in, H, W] and
    output gradient go [N, out, Lh, Lw]: the input's patches (strided views of the padded input, copied
    once into [N, Lh * Lw, in * kh * kw]) times go, one batched matrix product. (A grouped convolution
    with the samples as groups is faster on a CPU for one input channel, but loops over the groups on
    the host: its calls would grow with the members.)"""
    n, out = go.shape[:2]
    (kh, kw), (sh, sw), (dh, dw) = module.kernel_size, module.stride, module.dilation
    ph, pw = (int(v) for v in module.padding)  # numbers (a "same"/"valid" padding is not covered: _layers)
    padded = F.pad(a, (pw, pw, ph, ph)) if ph or pw else a
    lh, lw = go.shape[2:]
    # patch (p, q) of sample n: padded[n, :, sh p + dh i, sw q + dw j] for i < kh, j < kw
    st = padded.stride()
    patches = padded.as_strided((n, lh, lw, a.shape[1], kh, kw),
                                (st[0], sh * st[2], sw * st[3], st[1], dh * st[2], dw * st[3]))
    return torch.bmm(go.reshape(n, out, lh * lw), patches.reshape(n, lh * lw, -1))


def ghost_step(model: nn.Module, loss_fn: LossFn, per_sample: bool) -> GhostStep | None:
    """The gradient step at the model's own (shared) weights for x [B, c, ...], y [B, c] (sample-major),
    or None where it does not apply (above)."""
    layers = _layers(model) if _forward_is_samplewise(model) else None
    if layers is None:
        return None

    def sample_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return loss_fn(logits.unsqueeze(0), y.unsqueeze(0))

    members = vmap(vmap(sample_loss)) if per_sample else vmap(loss_fn, in_dims=(1, 1))

    def losses(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """The sum over members of their batch losses (per-sample: over every sample's loss)."""
        if loss_fn is F.cross_entropy:  # the same sum in one call (vmap runs the loss member by member)
            total = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1), reduction="sum")
            return total if per_sample else total / y.shape[0]
        return members(logits, y).sum()

    def name(prefix: str, param: str) -> str:
        return f"{prefix}.{param}" if prefix else param

    def step(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Weighted]:
        bsz, c = y.shape
        seen: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

        def keep(prefix: str) -> Callable[..., None]:
            def hook(module: nn.Module, inputs: tuple[torch.Tensor, ...], output: torch.Tensor) -> None:
                if prefix in seen or (isinstance(module, nn.Linear) and inputs[0].dim() != 2):
                    raise _Unsupported(prefix)
                seen[prefix] = (inputs[0].detach(), output)
            return hook

        handles = [module.register_forward_hook(keep(prefix)) for prefix, module in layers]
        try:
            with torch.enable_grad():
                logits = model(x.reshape(bsz * c, *x.shape[2:]))
                if len(seen) != len(layers):  # a layer's weights used without calling it
                    raise _Unsupported("a layer was not called")
                total = losses(logits.view(bsz, c, -1), y)
                grads = torch.autograd.grad(total, [seen[prefix][1] for prefix, _ in layers])
        finally:
            for h in handles:
                h.remove()
        sq = torch.zeros((c, bsz) if per_sample else (c,), dtype=logits.dtype, device=logits.device)
        parts: list[tuple[str, nn.Module, str, torch.Tensor, torch.Tensor]] = []
        for (prefix, module), go in zip(layers, grads):
            a = seen[prefix][0]
            bias = module.bias is not None
            if isinstance(module, nn.Linear):
                a3, g3 = a.view(bsz, c, -1), go.view(bsz, c, -1)
                if per_sample or bsz == 1:  # ||a go^T||^2 = ||a||^2 ||go||^2 (+ the bias's ||go||^2)
                    gg = torch.linalg.vector_norm(g3, dim=-1).square_()
                    term = torch.linalg.vector_norm(a3, dim=-1).square_().add_(1.0 if bias else 0.0).mul_(gg)
                    sq += term.t() if per_sample else term[0]
                else:  # sum_{s,t} (a_s . a_t)(go_s . go_t) over a member's samples
                    aa, gg = torch.einsum("sci,tci->cst", a3, a3), torch.einsum("sco,tco->cst", g3, g3)
                    sq += (aa.add_(1.0 if bias else 0.0) * gg).sum((1, 2))
                parts.append((prefix, module, "linear", a3, g3))
            else:
                assert isinstance(module, nn.Conv2d)
                g4 = go.reshape(bsz, c, go.shape[1], -1)
                samples = _conv_sample_gradients(module, a, go).view(bsz, c, go.shape[1], -1)
                grad_b = g4.sum(-1)
                if per_sample:  # [c, B, out, in k k]
                    grad_w, grad_b = samples.transpose(0, 1), grad_b.transpose(0, 1)
                else:  # [c, out, in k k]: the member's B samples summed
                    grad_w, grad_b = (samples[0], grad_b[0]) if bsz == 1 else (samples.sum(0), grad_b.sum(0))
                lead = 2 if per_sample else 1
                sq += torch.linalg.vector_norm(grad_w.flatten(lead), dim=-1).square_()
                if bias:
                    sq += torch.linalg.vector_norm(grad_b, dim=-1).square_()
                parts.append((prefix, module, "conv", grad_w, grad_b))

        def weighted(factor: torch.Tensor, finite: bool) -> Params:
            """name -> sum over members (and samples) of factor * gradient; ``finite``: no gradient was
            non-finite (else the zero-factor ones are zeroed before they are summed, as in the vmap path)."""
            out: Params = {}
            fw = factor.t() if per_sample else factor.view(1, c).expand(bsz, c)  # [B, c]
            for prefix, module, kind, first, second in parts:
                if kind == "linear":
                    scaled = second * fw.unsqueeze(-1)  # f-scaled go [B, c, out]
                    inputs = first
                    if not finite:
                        scaled, inputs = scaled.nan_to_num(0.0, 0.0, 0.0), inputs.nan_to_num(0.0, 0.0, 0.0)
                    flat = scaled.reshape(bsz * c, -1)
                    out[name(prefix, "weight")] = flat.t() @ inputs.reshape(bsz * c, -1)
                    if module.bias is not None:
                        out[name(prefix, "bias")] = flat.sum(0)
                else:
                    f = factor.reshape(-1)
                    for param, g in (("weight", first), ("bias", second)):
                        if param == "bias" and module.bias is None:
                            continue
                        if not finite:
                            g = g.nan_to_num(0.0, 0.0, 0.0)
                        out[name(prefix, param)] = (f @ g.reshape(f.numel(), -1)).view_as(getattr(module, param))
            return out

        return sq, weighted

    def guarded(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, Weighted] | None:
        try:
            return step(x, y)
        except _Unsupported:  # a layer called twice, or a linear layer on more than 2-D inputs
            return None

    return guarded

"""The worst-case canary run of the privacy audit, through the package's own training and aggregation.

The instance (docs/MATH.md §7.3, docs/audit.md): every client's loss is linear, l(w; x) = <x, w>,
so its gradient is the sample x itself. In world 0 the canary client's differing sample is x = +v,
in world 1 it is x = -v, with ||v|| = V; every other sample is the same in both worlds. No gradient
ever exceeds V, so clipping never acts, and each local step moves the differing client by exactly
2 eta V more in one world than in the other: the largest change the per-round terms allow.

- per-batch clipping: the canary's batch holds the differing sample scaled by B and B - 1 zeros,
  so its clipped mean gradient is exactly +-v (difference 2V per step, for any B);
- per-sample clipping: the differing sample is +-v and the other B - 1 are zeros, so the mean of the
  clipped gradients is +-v/B (difference 2V/B per step).
- every other client holds B copies of v (its update is the same in both worlds).

Trials are vectorised as rows: the model is one tensor W of shape [rows, 1], row j being trial j's
one-dimensional model, and each client's data is laid out per row. One call of
:func:`~fl_dp_flower.training.local_update.local_update` therefore trains every trial of every world
at once. Its clipping acts on the L2 norm over all parameters jointly; every row's gradient has norm
exactly V, so the joint norm is V sqrt(rows) and clipping at V sqrt(rows) is clipping every row at V
(the run asserts that nothing was clipped). Noise comes from
:func:`~fl_dp_flower.training.noise.add_gaussian_noise_` (i.i.d. per value, so per trial), and the
server's average from :func:`~fl_dp_flower.strategies.replies.average_arrays` with uniform weights,
as in a real round. A client's update is deterministic here (its batch is all of its data), so
the update of the m - 1 identical clients is computed once per round and each of them adds its own
noise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from flwr.common import Array, ArrayRecord, MetricRecord
from torch import nn

from fl_dp_flower.privacy.records import AccountantConfig
from fl_dp_flower.privacy.schedules import step_sizes
from fl_dp_flower.strategies.replies import Applied, Usable, average_arrays, weights_for
from fl_dp_flower.training.local_update import local_update
from fl_dp_flower.training.noise import add_gaussian_noise_

WORLDS = 2


class CanaryModel(nn.Module):
    """One linear model per trial: ``w`` has shape [rows, 1]; for x of shape [B, rows, 1] the output
    of sample b is sum_j <x_bj, w_j>, so the gradient of the batch-mean loss is the mean of x."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.w).sum(dim=(1, 2))


def linear_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The batch mean of the linear outputs (the targets carry no information)."""
    return outputs.mean()


@dataclass(frozen=True)
class CanaryRun:
    """Final models of both worlds. ``shadow[w]`` and ``evaluation[w]`` are [trials, 1] arrays
    of world w's final models (shadow trials fit the attack, evaluation trials measure it)."""

    shadow: tuple[np.ndarray, np.ndarray]
    evaluation: tuple[np.ndarray, np.ndarray]
    seconds: float
    rounds: int


def _client_data(config: AccountantConfig, signs: torch.Tensor, canary: bool) -> torch.Tensor:
    """[B, rows, 1] data of one client: the canary (world-dependent sign) or an ordinary client."""
    batch = config.batch_size or 1
    rows = len(signs)
    v = float(config.clip_norm)
    x = torch.zeros(batch, rows, 1, dtype=torch.float64, device=signs.device)
    if not canary:
        x.fill_(v)
    elif config.clipping == "per-sample":
        x[0, :, 0] = signs * v
    else:
        x[0, :, 0] = signs * v * batch
    return x


def run_canary(config: AccountantConfig, rounds: int, trials: int, shadow_trials: int, *,
               seed: int = 0, device: str | torch.device = "cpu") -> CanaryRun:
    """Run ``rounds`` rounds of m clients on the canary instance for both worlds at once.

    Rows are laid out [shadow world 0 | shadow world 1 | evaluation world 0 | evaluation world 1].
    ``config`` supplies algorithm, schedule, lr, K, V, m, sigma, FedProx alpha, clipping and B.
    """
    import time

    started = time.perf_counter()
    device = torch.device(device)
    rows = WORLDS * (shadow_trials + trials)
    signs = torch.ones(rows, dtype=torch.float64, device=device)
    signs[shadow_trials:WORLDS * shadow_trials] = -1.0  # shadow world 1
    signs[WORLDS * shadow_trials + trials:] = -1.0  # evaluation world 1
    canary_x = _client_data(config, signs, canary=True)
    other_x = _client_data(config, signs, canary=False)
    targets = torch.zeros(len(canary_x), dtype=torch.long, device=device)
    batch_size = config.batch_size or 1
    joint_clip = float(config.clip_norm) * math.sqrt(rows)  # every row's gradient has norm exactly V
    alpha = float(config.prox_alpha) if config.algorithm == "fedprox" else 0.0
    batch_gen = torch.Generator(device=device).manual_seed(seed)
    noise_gen = torch.Generator(device=device).manual_seed(seed + 1)
    w = torch.zeros(rows, 1, dtype=torch.float64, device=device)
    applied = Applied(sigma=config.sigma, clip_norm=config.clip_norm, local_steps=config.local_steps,
                      lr=config.lr, round_index=0, batch_size=config.batch_size,
                      prox_alpha=config.prox_alpha)
    reference = ArrayRecord({"w": Array(np.zeros((rows, 1)))})
    for t in range(rounds):
        etas = step_sizes(config.schedule, config.lr, t, config.local_steps)
        trained = {}
        for name, x in (("canary", canary_x), ("other", other_x)):
            model = CanaryModel(w.clone())
            stats = local_update(model, x, targets, step_sizes=etas, clip_norm=joint_clip,
                                 clipping=config.clipping, batch_size=batch_size, prox_alpha=alpha,
                                 generator=batch_gen, loss_fn=linear_loss)
            if stats.clipped_fraction != 0.0:
                raise AssertionError(f"round {t}: the canary's gradients were clipped ({stats.clipped_fraction})")
            trained[name] = model.w.detach()
        usable = []
        for client in range(config.clients):
            upload = (trained["canary"] if client == 0 else trained["other"]).clone()
            add_gaussian_noise_([upload], config.sigma, noise_gen)
            usable.append(Usable(node_id=client + 1, arrays=ArrayRecord({"w": Array(upload.cpu().numpy())}),
                                 metrics=MetricRecord({}), applied=applied, num_examples=batch_size,
                                 members=(client + 1,)))
        averaged = average_arrays(usable, weights_for(usable, "uniform"), reference)
        w = torch.from_numpy(averaged["w"].numpy()).to(device)
    final = w.cpu().numpy()
    s, n = shadow_trials, trials
    return CanaryRun(shadow=(final[:s], final[s:2 * s]), evaluation=(final[2 * s:2 * s + n], final[2 * s + n:]),
                     seconds=time.perf_counter() - started, rounds=rounds)

"""The canary runs of the privacy audit, through the package's own training and aggregation.

Two instances (docs/audit.md §1). A sample is a pair (a, c) with per-sample loss
l(w; (a, c)) = a w + c |w| on a one-dimensional model w; its gradient is a + c sign(w), with
sign(0) = 0 (torch's subgradient of |w| at 0).

- **linear** (docs/MATH.md §7.3): every loss is linear (c = 0). In world 0 the canary client's
  differing sample is a = +V, in world 1 a = -V; every other sample is the same in both worlds.
  No gradient exceeds V, so clipping never acts, and each local step moves the differing client by
  exactly 2 eta V more in one world than in the other (per-sample: 2 eta V / B). The steps are
  translations (L = 0, rho = 1).
- **kink**: the same differing sample, but the other samples have the concave kink loss -V |w|
  (c = -V): not L-smooth for any L. Starting from w = 0 a step pushes the model away from 0 in the
  direction it already has, so once the differing sample has moved the two worlds apart, every
  kink sample pushes them further apart. Per-sample clipping, one round from w = 0: the differing
  client's two runs end 2 eta V (1/B + K - 1) apart, not theta 2 eta V K with theta = min(1, kappa/B).
  Per-batch clipping: the canary client is the linear one (a batch mean mixing both kinds would be
  clipped differently per trial), the kink acts through the other clients, who push the global
  model away from 0 every round and so amplify the first round's difference (rho = infinity).

Layout of a client's data (B samples):

- per-batch clipping: the canary's batch holds the differing sample scaled by B and B - 1 zeros,
  so its clipped mean gradient is exactly +-V; per-sample clipping: the differing sample is +-V
  and the other B - 1 are zeros (linear) or kink samples (kink);
- every other client holds B copies of the same sample: a = V (linear) or the kink sample.

Trials are vectorised as rows: the model is one tensor W of shape [rows, 1], row j being trial j's
one-dimensional model. One call of :func:`~fl_dp_flower.training.local_update.local_update` trains
every trial at once. Its clipping acts on the L2 norm over all parameters jointly; every row's
gradient (per sample, or per batch) has the same norm, V or 0 (all rows are at w = 0 together
only at the start of round 1), so clipping at V sqrt(rows) is clipping every row at V (the run
asserts that nothing was clipped). Noise comes from
:func:`~fl_dp_flower.training.noise.add_gaussian_noise_` (i.i.d. per value, so per trial), and the
server's average from :func:`~fl_dp_flower.strategies.replies.average_arrays` with uniform weights,
as in a real round. A client's update is deterministic here (its batch is all of its data), so
the update of the m - 1 identical clients is computed once per round and each adds its own noise.

**Adversaries' statistics**, accumulated per row as the rounds run (docs/audit.md §2). Let f_b(w)
be the canary client's update from w in world b (computed for both worlds at every row's w_t, as a
white-box adversary can) and o(w) an ordinary client's. Given w_t, w_{t+1} is Gaussian with mean
M_b = (f_b(w_t) + (m - 1) o(w_t))/m and std s = sigma/sqrt(m), so the log likelihood ratio of the
all-rounds view (w_1, ..., w_T) is sum_t <w_{t+1} - (M_0 + M_1)/2, M_1 - M_0> / s^2: the exact
Neyman-Pearson statistic (s is the same every round here, so it is dropped). A participating client
(client 1, an ordinary one) also knows its own noise n_1 and subtracts its upload: w_{t+1} - n_1/m
has the same means and the smaller std sigma sqrt(m - 1)/m (docs/audit.md §2); its statistic is the
same sum with w_{t+1} - n_1/m in place of w_{t+1}.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from fl_dp_flower.privacy.records import AccountantConfig
from fl_dp_flower.privacy.schedules import step_sizes
from fl_dp_flower.training.local_update import local_update

from .trial import start_trial

WORLDS = 2
CANARIES = ("linear", "kink")
#: canary -> whether every loss of the instance is L-smooth for every L >= 0 (linear: L = 0)
SMOOTH = {"linear": True, "kink": False}


class CanaryModel(nn.Module):
    """One model per trial: ``w`` has shape [rows, 1]; a batch x has shape [B, rows, 2] and sample
    b's output is sum_j (x_bj0 w_j + x_bj1 |w_j|): its loss is the output (the batch mean)."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x[..., 0:1] * self.w + x[..., 1:2] * self.w.abs()).sum(dim=(1, 2))


def canary_loss(outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The batch mean of the outputs (the targets carry no information)."""
    return outputs.mean()


@dataclass(frozen=True)
class CanaryRun:
    """Both worlds' final models and the adversaries' statistics.

    ``final`` is [rows, 1], ``all_rounds`` and ``participant`` are [rows] (participant: None when
    m < 2); rows are [shadow world 0 | shadow world 1 | evaluation world 0 | evaluation world 1].
    """

    final: np.ndarray
    all_rounds: np.ndarray
    participant: np.ndarray | None
    shadow_trials: int
    trials: int
    seconds: float
    rounds: int
    canary: str

    def split(self, values: np.ndarray) -> tuple[tuple[np.ndarray, np.ndarray], tuple[np.ndarray, np.ndarray]]:
        """(shadow world 0, shadow world 1), (evaluation world 0, evaluation world 1) of ``values``."""
        s, n = self.shadow_trials, self.trials
        return (values[:s], values[s:2 * s]), (values[2 * s:2 * s + n], values[2 * s + n:])

    @property
    def shadow(self) -> tuple[np.ndarray, np.ndarray]:
        return self.split(self.final)[0]

    @property
    def evaluation(self) -> tuple[np.ndarray, np.ndarray]:
        return self.split(self.final)[1]


def _client_data(config: AccountantConfig, rows: int, sign: float, canary: str, role: str,
                 device: torch.device) -> torch.Tensor:
    """[B, rows, 2] data of one client: ``role`` "canary" (differing sample of sign ``sign``) or "other"."""
    batch = config.batch_size or 1
    v = float(config.clip_norm)
    x = torch.zeros(batch, rows, 2, dtype=torch.float64, device=device)
    if role == "other":
        if canary == "kink":
            x[..., 1] = -v
        else:
            x[..., 0] = v
    elif config.clipping == "per-sample":
        x[0, :, 0] = sign * v
        if canary == "kink":
            x[1:, :, 1] = -v
    else:
        x[0, :, 0] = sign * v * batch
    return x


def run_canary(config: AccountantConfig, rounds: int, trials: int, shadow_trials: int, *,
               canary: str = "linear", seed: int = 0, device: str | torch.device = "cpu",
               statistics: bool = True) -> CanaryRun:
    """Run ``rounds`` rounds of m clients on the ``canary`` instance for both worlds at once.

    ``config`` supplies algorithm, schedule, lr, K, V, m, sigma, FedProx alpha, clipping and B.
    ``statistics``: accumulate the all-rounds and participant statistics, which needs the canary
    client's update in both worlds at every row (one more local update per round); without it
    ``all_rounds`` is zeros and ``participant`` None (the final models are the same either way).
    """
    if canary not in CANARIES:
        raise ValueError(f"canary must be one of {CANARIES}, got {canary!r}")
    started = time.perf_counter()
    device = torch.device(device)
    m = config.clients
    rows = WORLDS * (shadow_trials + trials)
    world1 = torch.zeros(rows, 1, dtype=torch.bool, device=device)
    world1[shadow_trials:WORLDS * shadow_trials] = True  # shadow world 1
    world1[WORLDS * shadow_trials + trials:] = True  # evaluation world 1
    plus = _client_data(config, rows, 1.0, canary, "canary", device)  # world 0
    minus = _client_data(config, rows, -1.0, canary, "canary", device)  # world 1
    other = _client_data(config, rows, 0.0, canary, "other", device)
    if statistics:
        data = {"plus": plus, "minus": minus, "other": other}
    else:  # each row's own world only
        data = {"actual": torch.where(world1[None], minus, plus), "other": other}
    targets = torch.zeros(len(other), dtype=torch.long, device=device)
    batch_size = config.batch_size or 1
    # every row's gradient has norm exactly V (or 0): the joint norm is at most V sqrt(rows)
    joint_clip = float(config.clip_norm) * math.sqrt(rows) * (1.0 + 1e-12)
    trial = start_trial(config, rows, seed, device)
    w, all_rounds, participant = trial.w, trial.all_rounds, trial.participant
    for t in range(rounds):
        etas = step_sizes(config.schedule, config.lr, t, config.local_steps)
        trained = {}
        for name, x in data.items():
            model = CanaryModel(w.clone())
            stats = local_update(model, x, targets, step_sizes=etas, clip_norm=joint_clip,
                                 clipping=config.clipping, batch_size=batch_size, prox_alpha=trial.prox_alpha,
                                 generator=trial.batch_gen, loss_fn=canary_loss)
            if stats.clipped_fraction != 0.0:
                raise AssertionError(f"round {t}: the canary's gradients were clipped ({stats.clipped_fraction})")
            trained[name] = model.w.detach()
        canary_update = (torch.where(world1, trained["minus"], trained["plus"]) if statistics
                         else trained["actual"])
        w, own_noise = trial.noisy_average(canary_update, trained["other"], batch_size)
        if not statistics:
            continue
        # the adversaries' log likelihood ratios (times s^2), world 1 against world 0
        gap = (trained["minus"] - trained["plus"]) / m
        middle = ((trained["plus"] + trained["minus"]) / 2 + (m - 1) * trained["other"]) / m
        all_rounds += ((w - middle) * gap).sum(dim=1)
        if own_noise is not None:
            participant += ((w - own_noise / m - middle) * gap).sum(dim=1)
    return CanaryRun(final=w.cpu().numpy(), all_rounds=all_rounds.cpu().numpy(),
                     participant=participant.cpu().numpy() if m >= 2 and statistics else None,
                     shadow_trials=shadow_trials, trials=trials,
                     seconds=time.perf_counter() - started, rounds=rounds, canary=canary)

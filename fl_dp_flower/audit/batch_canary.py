"""The batch-sampled canary: one canary SAMPLE in one site whose batches are Poisson-sampled on the site
(docs/audit.md §7, docs/MATH.md §23).

The run is a linear canary (every loss a w, gradient a whatever w is) trained by the node's own update,
:func:`~fl_dp_flower.training.local_update.local_update` with ``batch_sampling="poisson"``: each of its K
steps includes each sample independently with probability q = B/n from the node's own draw, clips every
per-sample gradient, divides the sum by the expected B and clips the step again. The canary site's
differing sample is a = +V in world 0 and a = -V in world 1; its other samples have loss 0. Every other
site holds samples of loss 0 only, so its update is w_t exactly (it is not computed; it adds its own
noise). Noise and average are the package's (``add_gaussian_noise_``, ``average_arrays``).

**Vectorised trials with independent draws.** A Poisson draw is one Bernoulli per *sample index*, so the
trials must not share an index: the rows (trials) are cut into groups of n rows, and a group is one
call of the node's update on a model of n rows whose n samples are (j, a_j): sample j has loss a_j w_j,
it touches row j only. The draw of that call includes row j's canary with probability q independently
of every other row, and each group (and each round, and each step) draws afresh. So a group's site
holds n samples and an expected batch B' = q n; its clip norm is scaled to V' = V B'/B, so that one
sample moves its row by eta V'/B' = eta V/B, the planned per-sample step. Every per-sample gradient has
norm exactly V' (never clipped), and a step's gradient has norm V' sqrt(|S|)/B' <= V' because
|S| <= n <= B'^2 (the outer clip never acts). The run checks both: every row's movement is one of the
2^K values the inclusion patterns allow.

**The adversaries' statistics.** Given w_t, the next global model is w_t + Delta/m + N(0, s^2) with
Delta = -+ sum_{k in P} eta_k V/B over the steps P whose batch took the canary (FedProx: the same
recursion with its pull), P having probability q^|P| (1 - q)^(K - |P|), and s = sigma/sqrt(m) for an
outside observer (sigma sqrt(m - 1)/m for a participating site that subtracts its own upload). The exact
log likelihood ratio of every round's model is the sum over rounds of the log ratio of the two
mixtures: the Neyman-Pearson test of the all-rounds view (docs/audit.md §7).
"""

from __future__ import annotations

import itertools
import math
import time
from fractions import Fraction

import numpy as np
import torch
from torch import nn

from fl_dp_flower.privacy.records import AccountantConfig
from fl_dp_flower.privacy.schedules import step_sizes
from fl_dp_flower.training.local_update import local_update

from .canary import WORLDS, CanaryRun, canary_loss
from .trial import start_trial

#: rows (trials) per call of the node's update: one Poisson draw over this many sample indices
GROUP = 1000
#: the largest group the canary accepts (a small rate needs n >= 1/q^2 so that the outer clip never acts)
MAX_GROUP = 50_000
#: the most local steps whose 2^K inclusion patterns the statistic enumerates
MAX_STEPS = 12


class IndexedCanaryModel(nn.Module):
    """Row j of ``w`` ([n, 1]) is trial j's one-dimensional model; a sample x = (j, a) has loss a w_j."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = nn.Parameter(w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, 1] * self.w[:, 0].index_select(0, x[:, 0].long())


def group_layout(rate: float, group: int = GROUP) -> tuple[int, int]:
    """(n, B'): rows per group and the group's expected batch, with B'/n = ``rate`` exactly when the rate is
    a fraction of denominator <= :data:`MAX_GROUP` (else B' = ceil(rate n), a rate a hair above), and
    n <= B'^2 so that a step's gradient is never clipped."""
    if not (isinstance(rate, float | int) and 0.0 < rate <= 1.0):
        raise ValueError(f"batch_rate must be in (0, 1], got {rate!r}")
    frac = Fraction(rate).limit_denominator(MAX_GROUP)
    need = max(group, math.ceil(1.0 / rate ** 2))
    if float(frac) == rate:
        n = frac.denominator * max(1, math.ceil(need / frac.denominator))
        batch = n * frac.numerator // frac.denominator
    else:
        n = need
        batch = math.ceil(rate * n)
    if n > MAX_GROUP:
        raise ValueError(f"batch_rate {rate!r} is too small for the batch-sampled canary: a group of "
                         f"{n} > {MAX_GROUP} rows would be needed (rate >= {1 / math.sqrt(MAX_GROUP):.3g})")
    return n, batch


def inclusion_patterns(etas: list[float], rate: float, step: float, alpha: float) -> tuple[np.ndarray, np.ndarray]:
    """(log probabilities, movements): every pattern of the K steps whose batch took the canary, the
    movement of its site's model (for a = +V: one sample's gradient ``step`` = V/B per step it is in,
    FedProx's pull ``alpha`` after), nonnegative and measured against the direction of -a."""
    if len(etas) > MAX_STEPS:
        raise ValueError(f"the batch-sampled canary enumerates 2^K inclusion patterns: local_steps must be "
                         f"<= {MAX_STEPS}, got {len(etas)}")
    logs, moves = [], []
    for pattern in itertools.product((False, True), repeat=len(etas)):
        drift = 0.0
        for eta, taken in zip(etas, pattern):
            drift += eta * (step * taken - alpha * drift)
        hits = sum(pattern)
        logs.append(hits * math.log(rate) + ((len(etas) - hits) * math.log1p(-rate) if rate < 1.0 else
                                             (0.0 if hits == len(etas) else -math.inf)))
        moves.append(drift)
    return np.array(logs), np.array(moves)


def _mixture_llr(y: torch.Tensor, logs: torch.Tensor, moves: torch.Tensor, s: float) -> torch.Tensor:
    """log p_1(y) - log p_0(y) per row: world b's density is sum_P pi_P N(-+ moves_P, s^2)."""
    one = torch.logsumexp(logs - (y[:, None] - moves) ** 2 / (2 * s * s), dim=1)
    zero = torch.logsumexp(logs - (y[:, None] + moves) ** 2 / (2 * s * s), dim=1)
    return one - zero


def run_batch_canary(config: AccountantConfig, rounds: int, trials: int, shadow_trials: int, *, seed: int = 0,
                     device: str | torch.device = "cpu", statistics: bool = True, group: int = GROUP) -> CanaryRun:
    """Run ``rounds`` rounds of m sites, the canary sample in site 0, every site's batches Poisson-sampled
    at the rate :func:`realized_rate` (per-sample clipping), for both worlds at once; rows as in
    :class:`~fl_dp_flower.audit.canary.CanaryRun`. Raises AssertionError if a gradient was clipped or a row
    moved by an amount no inclusion pattern gives (the analysis of the statistics would not hold)."""
    if config.batch_rate is None or config.clipping != "per-sample":
        raise ValueError("the batch-sampled canary needs batch_rate (Poisson batches) and per-sample clipping")
    started = time.perf_counter()
    device = torch.device(device)
    m, rate = config.clients, float(config.batch_rate)
    n, batch = group_layout(rate, group)
    rows = WORLDS * (shadow_trials + trials)
    groups = math.ceil(rows / n)
    padded = groups * n
    world1 = torch.zeros(padded, dtype=torch.bool, device=device)
    world1[shadow_trials:WORLDS * shadow_trials] = True  # shadow world 1
    world1[WORLDS * shadow_trials + trials:rows] = True  # evaluation world 1 (rows past ``rows``: padding)
    v_scaled = float(config.clip_norm) * batch / float(config.batch_size or 1)  # eta V'/B' = eta V/B
    sign = torch.where(world1, -1.0, 1.0).to(torch.float64)
    index = torch.arange(n, dtype=torch.float64, device=device)
    data = [torch.stack([index, sign[g * n:(g + 1) * n] * v_scaled], dim=1) for g in range(groups)]
    targets = torch.zeros(n, dtype=torch.long, device=device)
    step = float(config.clip_norm) / float(config.batch_size or 1)
    trial = start_trial(config, padded, seed, device, batch_rate=batch / n)
    alpha, w, all_rounds, participant = trial.prox_alpha, trial.w, trial.all_rounds, trial.participant
    for t in range(rounds):
        etas = [float(e) for e in step_sizes(config.schedule, config.lr, t, config.local_steps)]
        logs, moves = (torch.from_numpy(a).to(device) for a in inclusion_patterns(etas, batch / n, step, alpha))
        canary = torch.empty_like(w)
        for g in range(groups):
            rows_g = slice(g * n, (g + 1) * n)
            model = IndexedCanaryModel(w[rows_g].clone())
            stats = local_update(model, data[g], targets, step_sizes=etas, clip_norm=v_scaled * (1.0 + 1e-12),
                                 clipping="per-sample", batch_size=batch, prox_alpha=alpha, generator=trial.batch_gen,
                                 loss_fn=canary_loss, per_sample_chunk=n, batch_sampling="poisson")
            if stats.clipped_fraction != 0.0:
                raise AssertionError(f"round {t}: a per-sample gradient was clipped ({stats.clipped_fraction})")
            canary[rows_g] = model.w.detach()
        movement = (w - canary)[:, 0] * sign  # >= 0: how far each row moved against its sample's sign
        off = (movement[:, None] - moves).abs().min(dim=1).values
        if float(off.max()) > 1e-9 * (float(moves.max()) + 1e-300):
            raise AssertionError(f"round {t}: a row moved by no inclusion pattern's amount (off by {float(off.max())})")
        # every other site's samples have loss 0: its update is w_t
        averaged, own_noise = trial.noisy_average(canary, w, n)
        if statistics:
            increment = (averaged - w)[:, 0]
            all_rounds += _mixture_llr(increment, logs, moves / m, config.sigma / math.sqrt(m))
            if own_noise is not None:
                participant += _mixture_llr(increment - own_noise[:, 0] / m, logs, moves / m,
                                            config.sigma * math.sqrt(m - 1) / m)
        w = averaged
    return CanaryRun(final=w[:rows].cpu().numpy(), all_rounds=all_rounds[:rows].cpu().numpy(),
                     participant=participant[:rows].cpu().numpy() if m >= 2 and statistics else None,
                     shadow_trials=shadow_trials, trials=trials, seconds=time.perf_counter() - started,
                     rounds=rounds, canary="linear")


def realized_rate(config: AccountantConfig, group: int = GROUP) -> float:
    """The rate B'/n the canary's site draws at (``config.batch_rate`` itself when it is a fraction of
    denominator <= :data:`MAX_GROUP`, else a hair above): the rate its bound is planned at."""
    if config.batch_rate is None:
        raise ValueError("the batch-sampled canary needs batch_rate")
    n, batch = group_layout(float(config.batch_rate), group)
    return batch / n

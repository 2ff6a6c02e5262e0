"""What every canary run of the audit sets up alike, and its clients' noisy round (docs/audit.md §1, §7).

Both canaries (:func:`~fl_dp_flower.audit.canary.run_canary`,
:func:`~fl_dp_flower.audit.batch_canary.run_batch_canary`) train rows of one-dimensional models (one row a
trial) through the package's own update, noise and average: :func:`start_trial` builds what they share
before round 1, :meth:`CanaryTrial.noisy_average` one round's uploads and the server's average.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from flwr.common import Array, ArrayRecord, MetricRecord

from fl_dp_flower.privacy.records import AccountantConfig
from fl_dp_flower.strategies.echo import Applied
from fl_dp_flower.strategies.replies import Usable, average_arrays, weights_for
from fl_dp_flower.training.noise import add_gaussian_noise_


@dataclass(frozen=True)
class CanaryTrial:
    """A canary run's state at the start of round 1, for ``rows`` trials (rows of the model).

    ``prox_alpha``: FedProx's alpha in the local update (0 for FedAvg); ``batch_gen``, ``noise_gen``: the
    run's two generators on its device, seeded ``seed`` (batches) and ``seed + 1`` (every client's noise);
    ``w`` ([rows, 1]), ``all_rounds`` and ``participant`` ([rows]): float64 zeros, the start model and the
    adversaries' accumulated statistics; ``applied``: the settings every client echoes; ``reference``: the
    average's template; ``clients``, ``sigma``: m and the noise's standard deviation per value."""

    prox_alpha: float
    batch_gen: torch.Generator
    noise_gen: torch.Generator
    w: torch.Tensor
    all_rounds: torch.Tensor
    participant: torch.Tensor
    applied: Applied
    reference: ArrayRecord
    clients: int
    sigma: float

    def noisy_average(self, canary: torch.Tensor, other: torch.Tensor,
                      num_examples: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One round: client 0 uploads ``canary``, every other client ``other`` (the clean updates, [rows, 1]),
        each with its own N(0, sigma^2) per value from ``noise_gen`` in client order; the server's uniform
        average (``average_arrays``) on the updates' device, and client 1's own noise (None when m < 2),
        which a participating client subtracts."""
        usable, own_noise = [], None
        for client in range(self.clients):
            clean = canary if client == 0 else other
            upload = clean.clone()
            add_gaussian_noise_([upload], self.sigma, self.noise_gen)
            if client == 1:
                own_noise = upload - clean  # what the participating client knows of its own upload
            usable.append(Usable(node_id=client + 1, arrays=ArrayRecord({"w": Array(upload.cpu().numpy())}),
                                 metrics=MetricRecord({}), applied=self.applied, num_examples=num_examples,
                                 members=(client + 1,)))
        averaged = average_arrays(usable, weights_for(usable, "uniform"), self.reference)
        return torch.from_numpy(averaged["w"].numpy()).to(canary.device), own_noise


def start_trial(config: AccountantConfig, rows: int, seed: int, device: torch.device,
                batch_rate: float | None = None) -> CanaryTrial:
    """The shared state of a canary run of ``rows`` rows (:class:`CanaryTrial`); ``batch_rate``: the Poisson
    batch rate the clients echo (None: not Poisson-sampled)."""
    alpha = float(config.prox_alpha) if config.algorithm == "fedprox" and config.prox_alpha is not None else 0.0
    applied = Applied(sigma=config.sigma, clip_norm=config.clip_norm, local_steps=config.local_steps,
                      lr=config.lr, round_index=0, batch_size=config.batch_size, prox_alpha=config.prox_alpha,
                      batch_rate=batch_rate)
    return CanaryTrial(
        prox_alpha=alpha,
        batch_gen=torch.Generator(device=device).manual_seed(seed),
        noise_gen=torch.Generator(device=device).manual_seed(seed + 1),
        w=torch.zeros(rows, 1, dtype=torch.float64, device=device),
        all_rounds=torch.zeros(rows, dtype=torch.float64, device=device),
        participant=torch.zeros(rows, dtype=torch.float64, device=device),
        applied=applied,
        reference=ArrayRecord({"w": Array(np.zeros((rows, 1)))}),
        clients=config.clients,
        sigma=config.sigma,
    )

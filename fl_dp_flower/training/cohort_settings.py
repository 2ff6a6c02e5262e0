"""The local-update settings a cohort's members share, checked once (training/cohort.py, training/cohort_secure.py).

:func:`~.cohort.train_cohort`, :func:`~.cohort.cohort_update`, :func:`~.cohort_secure.clean_members` and
:func:`~.cohort_secure.secure_cohort_upload` take one :class:`CohortSettings`: every member of the round runs
the same K clipped steps (the single client's ``local_update``) and adds noise of the same scale.
"""

from __future__ import annotations

import numbers
from dataclasses import dataclass

import torch.nn.functional as F

from fl_dp_flower.privacy.validate import choice, int_at_least, nonnegative, positive
from fl_dp_flower.vocabulary import CLIPPING_MODES

from .local_update import LossFn

__all__ = ["CohortSettings"]


@dataclass(frozen=True)
class CohortSettings:
    """One round's local update for every member of a cohort; bad values raise ``ValueError`` naming the field.

    - ``step_sizes``: eta_0 .. eta_{K-1}, the K local step sizes (``privacy.schedules.step_sizes``); K >= 1,
      each a finite number > 0 (a step moves the weights by eta times the clipped gradient). Kept as a tuple
      of floats.
    - ``clip_norm``: V, the L2 bound of a clipped gradient over all parameters (per-batch: the mean batch
      gradient; per-sample: each sample's); finite, > 0, in the gradient's units.
    - ``batch_size``: B, samples per local step, an integer >= 1 (a member with n_i < B samples uses B = n_i).
    - ``sigma``: the noise's standard deviation per value per member, in parameter units; finite, > 0:
      N(0, sigma^2) for :func:`~.cohort.train_cohort` and :func:`~.cohort.cohort_update`, Skellam noise of
      variance sigma^2 for :func:`~.cohort_secure.secure_cohort_upload`; :func:`~.cohort_secure.clean_members`
      adds none and does not read it.
    - ``prox_alpha``: FedProx's alpha, the pull -eta alpha (w - w_t) added after clipping; finite, >= 0
      (0: FedAvg).
    - ``clipping``: "per-batch" or "per-sample" (``vocabulary.CLIPPING_MODES``).
    - ``loss_fn``: loss(outputs, targets), the batch mean.
    - ``member_chunk``: members trained at once, an integer >= 1, or None for
      :func:`~.cohort.default_member_chunk` (memory and speed; with keyed streams it also decides the keys).
    """

    step_sizes: tuple[float, ...]
    clip_norm: float
    batch_size: int
    sigma: float
    prox_alpha: float = 0.0
    clipping: str = "per-batch"
    loss_fn: LossFn = F.cross_entropy
    member_chunk: int | None = None

    def __post_init__(self) -> None:
        etas = self.step_sizes
        if isinstance(etas, (str, bytes)) or not hasattr(etas, "__len__") or len(etas) == 0:
            raise ValueError(f"CohortSettings.step_sizes must be a non-empty sequence of finite numbers > 0, "
                             f"got {etas!r}")
        chunk = self.member_chunk
        if chunk is not None and (isinstance(chunk, bool) or not isinstance(chunk, numbers.Integral) or chunk < 1):
            raise ValueError(f"CohortSettings.member_chunk must be None or an integer >= 1, got {chunk!r}")
        if not callable(self.loss_fn):
            raise ValueError(f"CohortSettings.loss_fn must be callable (outputs, targets) -> loss, got {self.loss_fn!r}")
        fields = {
            "step_sizes": tuple(positive(f"CohortSettings.step_sizes[{k}]", e) for k, e in enumerate(etas)),
            "clip_norm": positive("CohortSettings.clip_norm", self.clip_norm),
            "batch_size": int_at_least("CohortSettings.batch_size", self.batch_size, 1),
            "sigma": positive("CohortSettings.sigma", self.sigma),
            "prox_alpha": nonnegative("CohortSettings.prox_alpha", self.prox_alpha),
            "clipping": choice("CohortSettings.clipping", self.clipping, CLIPPING_MODES),
            "member_chunk": None if chunk is None else int(chunk),
        }
        for name, value in fields.items():
            object.__setattr__(self, name, value)

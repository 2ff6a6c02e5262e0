"""Learning-rate schedules eta_{k,t} of the paper (Table 2), pure Python.

This is the single source of truth for step sizes: the client's local update
(``fl_dp_flower.training``) and the accountant both call :func:`step_sizes`, so
what is trained and what is accounted can never disagree.

Indices are 0-based: ``t`` is the communication round (server round - 1) and
``k = 0..K-1`` the local step.

| schedule    | eta_{k,t}           |
|-------------|---------------------|
| constant    | lr                  |
| cyclic      | lr / (k + 1)        |
| stage       | lr / (t + 1)        |
| iterative   | lr / (t K + k + 1)  |
"""

from __future__ import annotations

import math

from fl_dp_flower.vocabulary import SCHEDULES, Schedule

__all__ = ["SCHEDULES", "Schedule", "step_size", "step_sizes"]


def _check(schedule: str, lr: float, t: int, local_steps: int) -> None:
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    if not (isinstance(lr, (int, float)) and math.isfinite(lr) and lr > 0):
        raise ValueError(f"lr must be a finite number > 0, got {lr!r}")
    if not (isinstance(t, int) and t >= 0):
        raise ValueError(f"round index t must be an integer >= 0, got {t!r}")
    if not (isinstance(local_steps, int) and local_steps >= 1):
        raise ValueError(f"local_steps (K) must be an integer >= 1, got {local_steps!r}")


def step_size(schedule: Schedule, lr: float, k: int, t: int, local_steps: int) -> float:
    """Step size eta_{k,t} for local step ``k`` of round ``t`` (both 0-based)."""
    _check(schedule, lr, t, local_steps)
    if not (isinstance(k, int) and 0 <= k < local_steps):
        raise ValueError(f"local step k must be in [0, {local_steps - 1}], got {k!r}")
    if schedule == "constant":
        return float(lr)
    if schedule == "cyclic":
        return lr / (k + 1)
    if schedule == "stage":
        return lr / (t + 1)
    return lr / (t * local_steps + k + 1)


def step_sizes(schedule: Schedule, lr: float, t: int, local_steps: int) -> tuple[float, ...]:
    """All K step sizes of round ``t`` (0-based), in order k = 0..K-1."""
    _check(schedule, lr, t, local_steps)
    return tuple(step_size(schedule, lr, k, t, local_steps) for k in range(local_steps))

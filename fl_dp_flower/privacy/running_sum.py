"""A compensated (Neumaier) running sum: the accountant's per-round terms add up with an error
independent of the number of rounds."""

from __future__ import annotations

import math

__all__ = ["RunningSum"]


class RunningSum:
    """Compensated running sum (error independent of the number of terms)."""

    def __init__(self) -> None:
        self.total = 0.0
        self.compensation = 0.0

    def add(self, value: float) -> None:
        if math.isinf(value) or math.isinf(self.total):
            self.total += value
            return
        t = self.total + value
        if abs(self.total) >= abs(value):
            self.compensation += (self.total - t) + value
        else:
            self.compensation += (value - t) + self.total
        self.total = t

    @property
    def value(self) -> float:
        return self.total + self.compensation

    def value_with(self, value: float) -> float:
        """The value after ``add(value)``, without adding it."""
        trial = RunningSum()
        trial.total, trial.compensation = self.total, self.compensation
        trial.add(value)
        return trial.value

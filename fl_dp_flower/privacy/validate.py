"""The one set of argument checks of the privacy layer (records, terms, bounds).

Each returns the value as a Python number and raises ``ValueError`` whose message names the
argument and the allowed range, e.g. ``clip_norm must be a finite number > 0, got -1.0``.
Booleans are never numbers here.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable


def positive(name: str, value: object, *, allow_inf: bool = False) -> float:
    """A number > 0 (finite unless ``allow_inf``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a number > 0, got {value!r}")
    v = float(value)
    if math.isnan(v) or v <= 0 or (not allow_inf and math.isinf(v)):
        raise ValueError(f"{name} must be a {'' if allow_inf else 'finite '}number > 0, got {value!r}")
    return v


def nonnegative(name: str, value: object) -> float:
    """A finite number >= 0."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    v = float(value)
    if not math.isfinite(v) or v < 0:
        raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
    return v


def int_at_least(name: str, value: object, minimum: int) -> int:
    """An integer >= ``minimum`` (integral floats such as 3.0 are not integers here)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or int(value) < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def choice(name: str, value: object, allowed: Iterable[str]) -> str:
    """One of ``allowed``."""
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    return str(value)


#: the largest delta accepted anywhere: a guarantee at delta >= 0.1 allows publishing a tenth of the records
MAX_DELTA = 0.1


def plausible_delta(name: str, value: object, clients: int | None = None) -> float:
    """delta of an (epsilon, delta) guarantee: in (0, 0.1), and below 1/clients when the number of
    clients per round is known. An (epsilon, delta)-DP mechanism may publish each record in the clear
    with probability delta, so delta must stay well below 1/n, n the number of records; n is at least
    the number of clients, so delta >= 1/clients (or >= 0.1) is never a meaningful guarantee. Use
    delta well below 1/n (1e-5 is usual)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 < float(value) < MAX_DELTA:
        raise ValueError(f"{name} must be a number in (0, {MAX_DELTA}) (well below 1/n for n records; 1e-5 is "
                         f"usual), got {value!r}")
    if clients is not None and float(value) >= 1.0 / clients:
        raise ValueError(f"{name} = {value!r} must be below 1/clients = {1.0 / clients:.6g} (a guarantee at "
                         "delta >= 1/n may publish a record in the clear; use delta well below 1/n for n records)")
    return float(value)

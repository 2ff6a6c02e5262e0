"""Round-by-round composition of privacy-loss distributions (PLDs): the one owner of the machinery the
PLD accountants share (:mod:`sampled`, :mod:`client_sampling`, :mod:`sample_sampling`).

Standard library only: it never imports dp-accounting, it only calls ``compose``, ``self_compose``,
``get_epsilon_for_delta`` and ``get_delta_for_epsilon`` on the PLDs the caller's ``single`` returns.
Units: epsilon in nats (the natural log of the likelihood ratio's bound), delta a probability in [0, 1].
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Hashable, Sequence, TypeVar

__all__ = ["ABANDONED", "CACHE_SIZE", "MU_PLD_LIMIT", "RoundByRoundPLD", "compose_runs", "epsilon_at", "too_wide"]

#: single-round PLDs kept for reuse (rounds of a run mostly repeat a few keys); the cache is cleared when full
CACHE_SIZE = 256

K = TypeVar("K", bound=Hashable)


class _Abandoned:
    """The composition of rounds one of which was too wide to compose (:class:`RoundByRoundPLD`'s
    ``too_wide``): its epsilon is inf and its delta 1, so the bound certifies nothing and the report's
    certified guarantee is the smallest of the other sound bounds (an upper bound: never an under-count)."""

    def __repr__(self) -> str:
        return "ABANDONED"


ABANDONED = _Abandoned()

#: a round whose pair (p, mu) has mu above this (and p > 0) is not composed by PLD: the bound is given up
#: (epsilon inf, ABANDONED) and the run is certified by its other sound bounds. One such round
#: costs epsilon > 13 at delta 1e-5 even at p = 0.01 (16.7 unamplified), and its loss spans millions of grid steps.
MU_PLD_LIMIT = 3.0


def too_wide(key: tuple[float, float]) -> bool:
    """Whether the round (p, mu) is beyond :data:`MU_PLD_LIMIT` (p > 0: a round nobody can be in is free)."""
    return key[0] > 0.0 and key[1] > MU_PLD_LIMIT


def epsilon_at(composed: Any, delta: float) -> float:
    """epsilon (nats, >= 0) at ``delta`` (a probability) of the PLD ``composed``; 0 for None (no round)."""
    return 0.0 if composed is None else max(0.0, float(composed.get_epsilon_for_delta(delta)))


def compose_runs(keys: Sequence[K], single: Callable[[K], Any]) -> Any:
    """The PLD of the rounds ``keys`` composed (None for no round), each run of equal keys self-composed
    (fast for planned runs; equal to round-by-round composition up to the discretisation)."""
    composed: Any = None
    i = 0
    while i < len(keys):
        j = i
        while j < len(keys) and keys[j] == keys[i]:
            j += 1
        block = single(keys[i])
        block = block.self_compose(j - i) if j - i > 1 else block
        composed = block if composed is None else composed.compose(block)
        i = j
    return composed


class RoundByRoundPLD(Generic[K]):
    """The composed PLD of the rounds so far, one convolution per round.

    ``single(key)`` is the PLD of one round (cached by ``key``, at most ``cache_size`` kept); ``push(key)``
    accounts a round, ``peek(key)`` the composition after one more without changing anything (the result is
    kept, so the ``push`` with the same key that usually follows reuses it). ``count``: rounds pushed.
    ``too_wide(key)``: a round the PLD is not built for (its privacy loss spans so many grid steps that
    composing it takes seconds to minutes a round); from such a round on the composition is
    :data:`ABANDONED` (epsilon inf), which gives the bound up instead of stalling the run.
    """

    def __init__(self, single: Callable[[K], Any], cache_size: int = CACHE_SIZE,
                 too_wide: Callable[[K], bool] | None = None) -> None:
        self._make = single
        self._too_wide = too_wide
        self._cache_size = max(1, int(cache_size))
        self._cache: dict[K, Any] = {}
        self._pld: Any = None
        self._trial: tuple[int, K, Any] | None = None
        self.count = 0

    def single(self, key: K) -> Any:
        """The PLD of one round with ``key`` (cached)."""
        if key not in self._cache:
            if len(self._cache) >= self._cache_size:
                self._cache.clear()
            self._cache[key] = self._make(key)
        return self._cache[key]

    @property
    def abandoned(self) -> bool:
        """Whether a pushed round was too wide to compose (the bound is then given up: epsilon inf)."""
        return self._pld is ABANDONED

    def peek(self, key: K) -> Any:
        """The composed PLD after one more round with ``key``; nothing changes but the kept trial.
        :data:`ABANDONED` once a round (this one or an earlier) is ``too_wide``."""
        if self._pld is ABANDONED or (self._too_wide is not None and self._too_wide(key)):
            return ABANDONED
        if self._trial is not None and self._trial[0] == self.count and self._trial[1] == key:
            return self._trial[2]
        single = self.single(key)
        composed = single if self._pld is None else self._pld.compose(single)
        self._trial = (self.count, key, composed)
        return composed

    def push(self, key: K) -> None:
        """Account one more round with ``key``."""
        self._pld = self.peek(key)
        self.count += 1
        self._trial = None

    def epsilon(self, delta: float, pld: Any = None) -> float:
        """epsilon (nats, >= 0) at ``delta`` (a probability) of the rounds so far, or of ``pld`` (e.g. a
        :meth:`peek`); 0 before any round."""
        composed = self._pld if pld is None else pld
        return float("inf") if composed is ABANDONED else epsilon_at(composed, delta)

    def delta(self, epsilon: float) -> float:
        """delta (a probability) at ``epsilon`` (nats) of the rounds so far; 0 before any round."""
        if self._pld is ABANDONED:
            return 1.0
        return 0.0 if self._pld is None else float(self._pld.get_delta_for_epsilon(epsilon))

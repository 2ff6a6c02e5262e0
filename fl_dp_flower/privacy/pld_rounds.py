"""Round-by-round composition of privacy-loss distributions (PLDs): the one owner of the machinery the
PLD accountants share (:mod:`sampled`, :mod:`client_sampling`, :mod:`sample_sampling`).

Standard library only: it never imports dp-accounting, it only calls ``compose``, ``self_compose``,
``get_epsilon_for_delta`` and ``get_delta_for_epsilon`` on the PLDs the caller's ``single`` returns.
Units: epsilon in nats (the natural log of the likelihood ratio's bound), delta a probability in [0, 1].
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Hashable, Sequence, TypeVar

__all__ = ["ABANDONED", "CACHE_SIZE", "TRIALS", "MU_PLD_LIMIT", "RoundByRoundPLD", "compose_runs", "epsilon_at", "too_wide"]

#: single-round PLDs kept for reuse (rounds of a run mostly repeat a few keys); the cache is cleared when full
CACHE_SIZE = 256
#: peeked compositions kept for the round being decided (planned round, replies that arrived, a guard's trials)
TRIALS = 4

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
    accounts a round, ``peek(key)`` the composition after one more without changing anything (the results
    for this round's keys are kept, at most :data:`TRIALS`, so a second ``peek`` with a key already peeked
    (the planned round, the replies that arrived) and the ``push`` that follows reuse them). ``count``: rounds
    pushed. ``epsilon(delta, pld)`` of the composition so far or of a kept trial is remembered per (PLD,
    delta): the budget check, the report after the round and the next round's "before" ask the same PLD the
    same question and get the value the first query computed (the same float: nothing is approximated).
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
        self._trials: dict[K, Any] = {}  # key -> composed PLD after one more round with key (this round only)
        self._epsilons: dict[tuple[int, float], float] = {}  # (id of _pld or a kept trial, delta) -> epsilon
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
        if key in self._trials:
            return self._trials[key]
        single = self.single(key)
        composed = single if self._pld is None else self._pld.compose(single)
        if len(self._trials) >= TRIALS:
            self._forget(self._trials.pop(next(iter(self._trials))))
        self._trials[key] = composed
        return composed

    def push(self, key: K) -> None:
        """Account one more round with ``key``."""
        composed = self.peek(key)
        for other, trial in self._trials.items():
            if other != key:
                self._forget(trial)
        self._forget(self._pld)
        self._pld = composed
        self.count += 1
        self._trials = {}

    def _forget(self, pld: Any) -> None:
        """Drop the remembered epsilons of ``pld`` (no longer the composition nor a kept trial)."""
        if pld is not None and pld is not ABANDONED:
            for entry in [e for e in self._epsilons if e[0] == id(pld)]:
                del self._epsilons[entry]

    def epsilon(self, delta: float, pld: Any = None) -> float:
        """epsilon (nats, >= 0) at ``delta`` (a probability) of the rounds so far, or of ``pld`` (e.g. a
        :meth:`peek`); 0 before any round. Remembered for the composition and the kept trials."""
        composed = self._pld if pld is None else pld
        if composed is ABANDONED:
            return float("inf")
        kept = composed is self._pld or any(composed is t for t in self._trials.values())
        if not kept or composed is None:
            return epsilon_at(composed, delta)
        entry = (id(composed), float(delta))
        if entry not in self._epsilons:
            self._epsilons[entry] = epsilon_at(composed, delta)
        return self._epsilons[entry]

    def delta(self, epsilon: float) -> float:
        """delta (a probability) at ``epsilon`` (nats) of the rounds so far; 0 before any round."""
        if self._pld is ABANDONED:
            return 1.0
        return 0.0 if self._pld is None else float(self._pld.get_delta_for_epsilon(epsilon))

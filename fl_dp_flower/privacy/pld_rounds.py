"""Round-by-round composition of privacy-loss distributions (PLDs): the one owner of the machinery the
PLD accountants share (:mod:`sampled`, :mod:`client_sampling`, :mod:`sample_sampling`).

Standard library only: it never imports dp-accounting, it only calls ``compose``, ``self_compose``,
``get_epsilon_for_delta`` and ``get_delta_for_epsilon`` on the PLDs the caller's ``single`` returns.
Units: epsilon in nats (the natural log of the likelihood ratio's bound), delta a probability in [0, 1].
"""

from __future__ import annotations

from typing import Any, Callable, Generic, Hashable, Sequence, TypeVar

__all__ = ["CACHE_SIZE", "RoundByRoundPLD", "compose_runs", "epsilon_at"]

#: single-round PLDs kept for reuse (rounds of a run mostly repeat a few keys); the cache is cleared when full
CACHE_SIZE = 256

K = TypeVar("K", bound=Hashable)


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
    """

    def __init__(self, single: Callable[[K], Any], cache_size: int = CACHE_SIZE) -> None:
        self._make = single
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

    def peek(self, key: K) -> Any:
        """The composed PLD after one more round with ``key``; nothing changes but the kept trial."""
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
        return epsilon_at(self._pld if pld is None else pld, delta)

    def delta(self, epsilon: float) -> float:
        """delta (a probability) at ``epsilon`` (nats) of the rounds so far; 0 before any round."""
        return 0.0 if self._pld is None else float(self._pld.get_delta_for_epsilon(epsilon))

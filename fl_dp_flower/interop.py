"""Our exact Gaussian-DP accounting behind Flower's own ``PrivacyAccountant`` protocol.

Flower's ``DifferentialPrivacyClientSideFixedClipping`` / ``DifferentialPrivacyServerSideFixedClipping``
clip each client's update to L2 norm C and add N(0, (z C / m)^2) to the average of the m sampled
updates, i.e. N(0, (z C)^2) to their sum. Adding or removing one client moves that sum by at most C,
so one release is exactly the Gaussian mechanism with sensitivity C and noise std z C: (1/z)-GDP
(Dong, Roth, Su 2022). T releases compose exactly to mu = sqrt(sum_t count_t / z_t^2)-GDP, and
(epsilon, delta) is read off the Gaussian trade-off curve (``privacy.gdp``, docs/MATH.md), with no
RDP conversion loss. Sampling amplification is not claimed: only
``SamplingMethod.NO_AMPLIFICATION`` is accepted (what Flower's fixed-clipping wrappers require).

What it certifies: Flower's wrappers clip each *client's* whole update, so the guarantee is
**client-level** (add/remove-one client: all of one client's data), not the sample-level
(one sample of one client) epsilon of this package's own accountant; the two are not comparable.

Use (``population_size``: the clients Flower samples from, at least ``num_sampled_clients``; Flower
checks it every round, and it is required here so that mistake fails at construction)::

    accountant = FlowerGDPAccountant(target_delta=1e-5, population_size=100)
    strategy = DifferentialPrivacyClientSideFixedClipping(FedAvg(...), noise_multiplier=1.0,
                                                         clipping_norm=1.0, num_sampled_clients=10,
                                                         accountant=accountant)

Flower's client-side wrapper certifies clipped updates whether or not the ClientApps run ``fixedclipping_mod``
(the server is never told); :class:`CheckedClientSideFixedClipping` is the same wrapper that checks every
reply's update norm before aggregating, so a ClientApp without the mod stops the run instead of voiding
the number.
"""

from __future__ import annotations

import math

from collections.abc import Iterable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord
from flwr.serverapp import Grid, NeighboringRelation, PrivacyConfig, PrivacySpent, SamplingMethod
from flwr.serverapp.strategy import DifferentialPrivacyClientSideFixedClipping
from flwr.supercore.privacy_accounting import GaussianPrivacyEvent

from .errors import FlDpError
from .privacy import gdp

__all__ = ["CheckedClientSideFixedClipping", "FlowerGDPAccountant", "UnclippedUpdate"]

ACCOUNTING_METHOD = "gaussian-dp"
STATE_KIND = "fl-dp-flower/gaussian-dp"
STATE_VERSION = 1


class FlowerGDPAccountant:
    """Implements ``flwr.serverapp.PrivacyAccountant`` with exact mu-GDP composition.

    ``config`` (a Flower ``PrivacyConfig``) or its fields: target_delta (the default delta of
    reports, in (0, 1)), population_size (required: the clients sampled from, >= the wrapper's
    ``num_sampled_clients``; no amplification is claimed), max_epsilon (optional budget for
    ``would_exceed``). The guarantee is client-level (:attr:`RELATION`).
    """

    #: the neighbouring relation certified: one whole client added or removed (Flower's wrappers clip per client)
    RELATION = "client-level add/remove-one (one client's whole dataset)"

    def __init__(self, config: PrivacyConfig | None = None, *, target_delta: float = 1e-5,
                 population_size: int | None = None, max_epsilon: float | None = None) -> None:
        if config is None:
            if population_size is None:
                raise ValueError("population_size is required: the number of clients Flower's DP wrapper samples "
                                 "from (>= its num_sampled_clients; Flower refuses a round whose sample exceeds it)")
            config = PrivacyConfig(target_delta=target_delta, population_size=population_size,
                                   neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                   sampling_method=SamplingMethod.NO_AMPLIFICATION, max_epsilon=max_epsilon)
        if not isinstance(config, PrivacyConfig):
            raise TypeError(f"config must be a flwr PrivacyConfig, got {type(config).__name__}")
        if config.sampling_method is not SamplingMethod.NO_AMPLIFICATION:
            raise ValueError(f"sampling_method must be 'no-amplification' (exact GDP claims no amplification "
                             f"by sampling), got {config.sampling_method.value!r}")
        self._config = config
        self._releases: dict[float, int] = {}  # noise multiplier z -> releases composed with it
        self._mu_squared = 0.0

    @property
    def config(self) -> PrivacyConfig:
        return self._config

    @property
    def num_releases(self) -> int:
        return sum(self._releases.values())

    @property
    def mu(self) -> float:
        """The composed mu of every release so far (mu-GDP, add/remove-one client)."""
        return math.sqrt(self._mu_squared)

    @staticmethod
    def _cost(event: GaussianPrivacyEvent, count: int) -> float:
        if not isinstance(event, GaussianPrivacyEvent):
            raise TypeError(f"event must be a GaussianPrivacyEvent, got {type(event).__name__}")
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ValueError(f"count must be an integer >= 1, got {count!r}")
        return count / event.noise_multiplier ** 2

    def compose(self, event: GaussianPrivacyEvent, count: int = 1) -> None:
        """Compose ``count`` releases of a Gaussian mechanism with noise multiplier z: mu^2 += count / z^2."""
        self._mu_squared += self._cost(event, count)
        z = float(event.noise_multiplier)
        self._releases[z] = self._releases.get(z, 0) + count

    def get_epsilon(self, delta: float) -> float:
        return gdp.epsilon(self.mu, delta) if self._mu_squared > 0 else 0.0

    def get_delta(self, epsilon: float) -> float:
        return gdp.delta(self.mu, epsilon) if self._mu_squared > 0 else 0.0

    def get_privacy_spent(self, delta: float | None = None) -> PrivacySpent:
        d = self._config.target_delta if delta is None else delta
        return PrivacySpent(epsilon=self.get_epsilon(d), delta=d, num_releases=self.num_releases,
                            accounting_method=ACCOUNTING_METHOD)

    def would_exceed(self, event: GaussianPrivacyEvent, max_epsilon: float | None = None, count: int = 1) -> bool:
        """Whether composing ``count`` such events would push epsilon (at ``target_delta``) past the limit."""
        limit = self._config.max_epsilon if max_epsilon is None else max_epsilon
        if limit is None:
            raise ValueError("would_exceed needs max_epsilon (argument or config)")
        mu = math.sqrt(self._mu_squared + self._cost(event, count))
        return gdp.epsilon(mu, self._config.target_delta) > limit

    def state_dict(self) -> dict[str, object]:
        """Serializable state: the config and every (noise multiplier, count) composed."""
        c = self._config
        return {
            "kind": STATE_KIND, "version": STATE_VERSION,
            "config": {"target_delta": c.target_delta, "population_size": c.population_size,
                       "neighboring_relation": c.neighboring_relation.value,
                       "sampling_method": c.sampling_method.value, "max_epsilon": c.max_epsilon},
            "releases": [[z, n] for z, n in sorted(self._releases.items())],
        }

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Restore :meth:`state_dict`'s output; refuses another accountant's state or another config."""
        if not isinstance(state, dict) or state.get("kind") != STATE_KIND or state.get("version") != STATE_VERSION:
            raise ValueError(f"not a {STATE_KIND} v{STATE_VERSION} state: {state!r:.200}")
        if state.get("config") != self.state_dict()["config"]:
            raise ValueError(f"state config {state.get('config')!r} differs from this accountant's "
                             f"{self.state_dict()['config']!r}")
        releases = state.get("releases")
        if not isinstance(releases, list):
            raise ValueError("state 'releases' must be a list of [noise_multiplier, count]")
        restored: dict[float, int] = {}
        mu_squared = 0.0
        for item in releases:
            if not (isinstance(item, list) and len(item) == 2):
                raise ValueError(f"state release {item!r} must be [noise_multiplier, count]")
            z, n = item
            event = GaussianPrivacyEvent(noise_multiplier=z, sample_size=1, population_size=1)
            mu_squared += self._cost(event, n)
            restored[float(z)] = restored.get(float(z), 0) + n
        self._releases, self._mu_squared = restored, mu_squared


class UnclippedUpdate(FlDpError, ValueError):
    """A reply to Flower's client-side fixed-clipping wrapper whose update exceeds the clipping norm."""


def update_norm(reply: list[np.ndarray], broadcast: list[np.ndarray]) -> tuple[float, float]:
    """(L2 norm of reply - broadcast, the rounding it may carry): a client's update clipped to C and added to the
    model in the weights' dtype reads back within eps (|reply| + |broadcast|) of a vector of norm C, eps the
    dtype's machine epsilon (the error of each value is at most eps times its size)."""
    if len(reply) != len(broadcast):
        raise UnclippedUpdate(f"a reply has {len(reply)} arrays, the broadcast model {len(broadcast)}")
    squares, sizes = 0.0, 0.0
    eps = 0.0
    for new, old in zip(reply, broadcast, strict=True):
        if new.shape != old.shape:
            raise UnclippedUpdate(f"a reply's array has shape {new.shape}, the broadcast model's {old.shape}")
        a, b = new.astype(np.float64), old.astype(np.float64)
        squares += float(np.sum((a - b) ** 2))
        sizes += float(np.sum(a * a)) + float(np.sum(b * b))
        eps = max([eps, *(float(np.finfo(x.dtype).eps) for x in (new, old) if x.dtype.kind == "f")])
    return math.sqrt(squares), eps * 2 * math.sqrt(sizes)


class CheckedClientSideFixedClipping(DifferentialPrivacyClientSideFixedClipping):
    """Flower's ``DifferentialPrivacyClientSideFixedClipping`` that checks what its accountant certifies: before
    aggregating, every reply's update (reply minus the broadcast model) must have L2 norm at most
    ``clipping_norm`` (plus float rounding), which only ``fixedclipping_mod`` in the ClientApp guarantees.
    Otherwise :class:`UnclippedUpdate` (naming the node) stops the run before the round's aggregate is released;
    Flower's own wrapper would aggregate the unclipped update and certify it as clipped. Arguments as Flower's."""

    _broadcast: list[np.ndarray] | None = None

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        self._broadcast = arrays.to_numpy_ndarrays()
        return super().configure_train(server_round, arrays, config, grid)

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        replies = list(replies)
        if self._broadcast is None:
            raise RuntimeError("aggregate_train before configure_train: no broadcast model to check updates against")
        for reply in replies:
            if reply.has_error():
                continue
            for record in reply.content.array_records.values():
                norm, slack = update_norm(record.to_numpy_ndarrays(), self._broadcast)
                if norm > self.clipping_norm * (1 + 1e-6) + slack:
                    raise UnclippedUpdate(
                        f"round {server_round}: node {reply.metadata.src_node_id}'s update has L2 norm {norm:.6g} > "
                        f"clipping_norm {self.clipping_norm:g}: its ClientApp does not clip (add fixedclipping_mod: "
                        "ClientApp(mods=[fixedclipping_mod])); nothing of this round was aggregated or accounted")
        return super().aggregate_train(server_round, replies)

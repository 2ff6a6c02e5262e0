"""What the accountant reports (:class:`PrivacyReport` after every round, :class:`PrivacySpent`, shaped like
Flower's) and the :class:`Budget` it is checked against; epsilons in nats, delta a probability.
Defined here, used by :mod:`.accountant` (which re-exports them)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from . import gdp
from .bounds import RELATION, BoundValue
from .screening_charge import MAX_PLANNED_CHARGE_SHARE
from .secure_aggregation import REAL_SUM_LABEL
from .validate import plausible_delta

ACCOUNTING_METHOD = "gaussian-dp"
REPORT_RDP_ORDERS: tuple[float, ...] = (1.5, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0)


@dataclass(frozen=True)
class Budget:
    """A privacy budget (epsilon, delta) checked against the certified guarantee."""

    epsilon: float
    delta: float

    def __post_init__(self) -> None:
        if not (isinstance(self.epsilon, (int, float)) and self.epsilon > 0 and math.isfinite(self.epsilon)):
            raise ValueError(f"budget epsilon must be a finite number > 0, got {self.epsilon!r}")
        plausible_delta("budget delta", self.delta)

    def exceeded_by(self, report: "PrivacyReport") -> bool:
        """Whether ``report`` (the guarantee after a round) is past this budget: its certified epsilon above
        ``epsilon``, or the delta that epsilon holds at, the screening drops' charge included (docs/MATH.md §17.1),
        above (1 + MAX_PLANNED_CHARGE_SHARE) x ``delta``: the rule the run's budget stop and the planner share."""
        return (report.certified.epsilon > self.epsilon
                or report.delta_total > (1.0 + MAX_PLANNED_CHARGE_SHARE) * self.delta)


@dataclass(frozen=True)
class PrivacyReport:
    """The running guarantee after ``rounds`` rounds (``round`` = last round's number)."""

    round: int
    rounds: int
    delta: float
    threat_model: str
    clients: int
    bounds: dict[str, BoundValue]
    certified_bound: str
    rdp_orders: tuple[float, ...] = field(default=REPORT_RDP_ORDERS)
    rounds_applied: int | None = None  # rounds in the final-model bound (None: all rounds)
    colluders: int | None = None
    #: the certified guarantee under add/remove-one (docs/MATH.md §16): bound, mu, epsilon
    add_remove: dict[str, Any] = field(default_factory=dict)
    #: Poisson client sampling (docs/MATH.md §19): rate, the unamplified epsilon, mu_clt; {} without it
    sampling: dict[str, Any] = field(default_factory=dict)
    #: the certified bound's RDP curve (orders, nats) where it comes from RDP (the Skellam secure sum), else None
    rdp_curve: tuple[tuple[int, ...], tuple[float, ...]] | None = None
    screening: dict[str, Any] = field(default_factory=dict)  # drops charged to delta (MATH §17.1), or {}
    #: Poisson batch sampling on the nodes (docs/MATH.md §23): max rate, the unamplified epsilon; {} without it
    batch_sampling: dict[str, Any] = field(default_factory=dict)

    @property
    def delta_total(self) -> float:  # the delta the certified epsilon holds at, screening drops included
        return float(self.screening.get("delta_total", self.delta))

    @property
    def certified(self) -> BoundValue:
        return self.bounds[self.certified_bound]

    def to_dict(self) -> dict[str, Any]:
        mu = self.certified.mu
        orders, rdp_values = self.rdp_curve or (self.rdp_orders, [gdp.rdp(mu, order) for order in self.rdp_orders])
        rdp_eps = (self.certified.epsilon if self.rdp_curve else gdp.rdp_epsilon(mu, self.delta)[0]) if self.rounds else 0.0
        return {
            "round": self.round,
            "rounds": self.rounds,
            "delta": self.delta,
            "threat_model": self.threat_model,
            "clients": self.clients,
            "rounds_applied": self.rounds if self.rounds_applied is None else self.rounds_applied,
            "colluders": self.colluders,
            "bounds": {name: value.to_dict() for name, value in self.bounds.items()},
            "certified": {"bound": self.certified_bound, "mu": mu, "epsilon": self.certified.epsilon,
                          "assumes": list(self.certified.assumes),
                          **({"planning_only": True} if REAL_SUM_LABEL in self.certified.assumes else {})},
            "rdp": {"orders": list(orders), "values": list(rdp_values), "epsilon": rdp_eps},
            "relation": RELATION,
            "add_remove": dict(self.add_remove),
            **({"sampling": dict(self.sampling)} if self.sampling else {}),
            **({"screening": dict(self.screening)} if self.screening else {}),
            **({"batch_sampling": dict(self.batch_sampling)} if self.batch_sampling else {}),
        }


@dataclass(frozen=True)
class PrivacySpent:
    """Cumulative certified spend, shaped like Flower's ``PrivacySpent``."""

    epsilon: float
    delta: float
    num_releases: int
    accounting_method: str
    mu: float
    bound: str
    planning_only: bool = False  # True: the real-valued secure sum's bound, not a certificate (MATH §20.2)

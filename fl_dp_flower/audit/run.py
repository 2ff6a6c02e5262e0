"""``fl-dp-flower audit``: the canary run, the attack, and a verdict for every printed bound.

A bound (mu_B, and epsilon_B at delta) is *violated* when the attack's empirical lower bound
exceeds it: mu_lower > mu_B or epsilon_lower > epsilon_B. Both lower bounds hold with probability
>= ``confidence`` (docs/audit.md), so a violation is a finding at that confidence. A bound that
holds has survived this attack: evidence, not a proof. Every bound the package prints bounds the
privacy of the final model (composition and local DP cover the final model by post-processing),
so each one can be checked against an attack on the final model.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fl_dp_flower.privacy.planning import Plan, plan
from fl_dp_flower.privacy.records import AccountantConfig

from .attack import DEFAULT_FPRS, AttackResult, audit_attack
from .canary import run_canary


@dataclass(frozen=True)
class Verdict:
    bound: str
    mu: float
    epsilon: float
    sound: bool
    violated: bool


@dataclass(frozen=True)
class AuditReport:
    config: AccountantConfig
    rounds: int
    trials: int
    seed: int
    plan: Plan
    attack: AttackResult
    verdicts: tuple[Verdict, ...]
    seconds: float

    def verdict(self, bound: str) -> Verdict:
        return next(v for v in self.verdicts if v.bound == bound)

    def to_dict(self) -> dict[str, Any]:
        a = self.attack
        return {
            "config": dataclasses.asdict(self.config),
            "rounds": self.rounds,
            "trials_per_world": self.trials,
            "seed": self.seed,
            "seconds": self.seconds,
            "confidence": a.confidence,
            "delta": a.delta,
            "mu_lower": a.mu_lower,
            "epsilon_lower": a.epsilon_lower,
            "mu_estimate": a.mu_estimate,
            "operating_points": [dataclasses.asdict(o) for o in a.operating],
            "certified_bound": self.plan.certified_bound,
            "verdicts": [dataclasses.asdict(v) for v in self.verdicts],
        }


def run_audit(config: AccountantConfig, rounds: int, *, trials: int = 100_000, seed: int = 0,
              confidence: float = 0.95, fprs=DEFAULT_FPRS, device: str = "cpu") -> AuditReport:
    """Audit every bound of ``plan(config, rounds)`` with ``trials`` evaluation (and as many shadow)
    trials per world."""
    if not (isinstance(trials, int) and trials >= 10):
        raise ValueError(f"trials must be an integer >= 10, got {trials!r}")
    planned = plan(config, rounds)
    run = run_canary(config, rounds, trials, trials, seed=seed, device=device)
    attack = audit_attack(run.shadow, run.evaluation, delta=config.delta, fprs=fprs, confidence=confidence)
    verdicts = []
    for name, value in planned.bounds.items():
        verdicts.append(Verdict(bound=name, mu=value.mu, epsilon=value.epsilon, sound=value.sound,
                                violated=attack.mu_lower > value.mu or attack.epsilon_lower > value.epsilon))
    cert = planned.certified
    verdicts.append(Verdict(bound="certified", mu=cert.mu, epsilon=cert.epsilon, sound=True,
                            violated=attack.mu_lower > cert.mu or attack.epsilon_lower > cert.epsilon))
    return AuditReport(config=config, rounds=rounds, trials=trials, seed=seed, plan=planned, attack=attack,
                       verdicts=tuple(verdicts), seconds=run.seconds)

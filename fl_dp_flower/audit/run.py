"""``fl-dp-flower audit``: a canary run, one adversary's attack, and a verdict for every printed bound.

Adversaries (docs/audit.md §2):

- ``final-model``: sees the final global model only (the projection test fitted on shadow trials);
  every bound the package prints covers this view (composition and local DP by post-processing).
- ``all-rounds``: an outside observer who sees every round's global model (the exact likelihood-ratio
  test of canary.py). Covered by composition and local DP; final_model and paper cover the final
  model only, so they are *not applicable* to it.
- ``participant``: one participating client who sees every global model and subtracts its own upload
  (docs/audit.md §2). Covered by local DP, and by composition when composition counts only the noise of
  clients outside the adversary (``AccountantConfig.colluders`` >= 1).

A config with a batch rate (Poisson batches on the nodes) runs the batch-sampled canary instead
(batch_canary.py, docs/audit.md §7: a canary sample in one site, drawn by the node's own sampler), planned
at the rate its sites draw at; ``batch_sampled`` then covers every view that composition covers.

Verdicts (``Verdict.outcome``), for a bound (mu_B, epsilon_B at delta) and the attack's lower bounds
(mu_lower, epsilon_lower, both at ``confidence``), "exceeded" meaning mu_lower > mu_B or
epsilon_lower > epsilon_B:

- ``not applicable``: the bound does not cover this adversary's view.
- ``holds``: not exceeded (evidence, not a proof).
- ``VIOLATED``: a sound bound is exceeded although the instance meets everything it assumes: a
  package bug. The command exits 1.
- ``exceeded: not a guarantee``: the paper's stated bound (marked not sound) is exceeded.
- ``assumption violated``: the bound rests on an assumption this instance breaks (an L-smooth loss
  for the kink canary; an outside observer, colluders = 0, for the participant) and is exceeded. The
  bound is wrong for this instance, but it never claimed to cover it: not a package bug, exit 0.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from fl_dp_flower.privacy.planning import Plan, plan
from fl_dp_flower.privacy.records import AccountantConfig

from .attack import DEFAULT_FPRS, AttackResult, audit_attack, threshold_attack
from .batch_canary import realized_rate, run_batch_canary
from .canary import CANARIES, SMOOTH, run_canary

ADVERSARIES = ("final-model", "all-rounds", "participant")
#: adversary -> the bounds that claim to cover its view
COVERS = {
    "final-model": ("paper", "composition", "final_model", "local_dp", "batch_sampled"),
    "all-rounds": ("composition", "local_dp", "batch_sampled"),
    "participant": ("composition", "local_dp", "batch_sampled"),
}
OUTCOMES = ("not applicable", "holds", "VIOLATED", "exceeded: not a guarantee", "assumption violated")


@dataclass(frozen=True)
class Verdict:
    """One bound against the attack. ``violated``: the bound applies and the attack exceeds it;
    ``broken``: the assumptions of the bound that this instance breaks (why it is not a bug)."""

    bound: str
    mu: float
    epsilon: float
    sound: bool
    applies: bool
    violated: bool
    assumes: tuple[str, ...]
    broken: tuple[str, ...]
    outcome: str


@dataclass(frozen=True)
class AuditReport:
    config: AccountantConfig
    rounds: int
    trials: int
    seed: int
    canary: str
    adversary: str
    plan: Plan
    attack: AttackResult
    verdicts: tuple[Verdict, ...]
    seconds: float

    def verdict(self, bound: str) -> Verdict:
        return next(v for v in self.verdicts if v.bound == bound)

    @property
    def package_bug(self) -> bool:
        """Some sound bound is violated on an instance that meets its assumptions (exit status 1)."""
        return any(v.outcome == "VIOLATED" for v in self.verdicts)

    def to_dict(self) -> dict[str, Any]:
        a = self.attack
        return {
            "config": dataclasses.asdict(self.config),
            "rounds": self.rounds,
            "canary": self.canary,
            "adversary": self.adversary,
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
            "package_bug": self.package_bug,
        }


def broken_assumptions(assumes: tuple[str, ...], canary: str, adversary: str, colluders: int) -> tuple[str, ...]:
    """The assumptions in ``assumes`` (and the implicit outside-observer one of colluders = 0) that
    the instance breaks: L-smoothness for a canary whose losses are not smooth; no participating
    adversary when the participant attacks a bound computed for colluders = 0."""
    broken = tuple(a for a in assumes if "smooth" in a.lower() and not SMOOTH[canary])
    if adversary == "participant" and colluders == 0:
        broken += ("an outside observer (colluders = 0): no participating client is the adversary",)
    return broken


def _verdict(name: str, mu: float, epsilon: float, sound: bool, assumes: tuple[str, ...], applies: bool,
             attack: AttackResult, canary: str, adversary: str, colluders: int) -> Verdict:
    exceeded = applies and (attack.mu_lower > mu or attack.epsilon_lower > epsilon)
    broken = broken_assumptions(assumes, canary, adversary, colluders) if applies else ()
    if not applies:
        outcome = "not applicable"
    elif not exceeded:
        outcome = "holds"
    elif not sound:
        outcome = "exceeded: not a guarantee"
    elif broken:
        outcome = "assumption violated"
    else:
        outcome = "VIOLATED"
    return Verdict(bound=name, mu=mu, epsilon=epsilon, sound=sound, applies=applies, violated=exceeded,
                   assumes=assumes, broken=broken, outcome=outcome)


def run_audit(config: AccountantConfig, rounds: int, *, canary: str = "linear", adversary: str = "final-model",
              trials: int = 100_000, seed: int = 0, confidence: float = 0.95, fprs=DEFAULT_FPRS,
              device: str = "cpu") -> AuditReport:
    """Audit every bound of ``plan(config, rounds)`` against ``adversary`` on ``canary``, with
    ``trials`` evaluation (and as many shadow) trials per world."""
    if not (isinstance(trials, int) and trials >= 10):
        raise ValueError(f"trials must be an integer >= 10, got {trials!r}")
    if canary not in CANARIES:
        raise ValueError(f"canary must be one of {CANARIES}, got {canary!r}")
    if adversary not in ADVERSARIES:
        raise ValueError(f"adversary must be one of {ADVERSARIES}, got {adversary!r}")
    if adversary == "participant" and config.clients < 2:
        raise ValueError(f"the participant adversary needs clients >= 2 (one besides the canary), got {config.clients}")
    if config.batch_rate is not None:  # a canary sample in one site, its batches Poisson-sampled there
        if canary != "linear":
            raise ValueError(f"batch sampling is audited with the linear canary only, got canary {canary!r}")
        config = dataclasses.replace(config, batch_rate=realized_rate(config))  # the rate the site draws at
        run = run_batch_canary(config, rounds, trials, trials, seed=seed, device=device,
                               statistics=adversary != "final-model")
    else:
        run = run_canary(config, rounds, trials, trials, canary=canary, seed=seed, device=device,
                         statistics=adversary != "final-model")
    planned = plan(config, rounds)
    if adversary == "final-model":
        attack = audit_attack(run.shadow, run.evaluation, delta=config.delta, fprs=fprs, confidence=confidence)
    else:
        scores = run.all_rounds if adversary == "all-rounds" else run.participant
        assert scores is not None  # clients >= 2 was checked
        (s0, _), (e0, e1) = run.split(scores)
        attack = threshold_attack(s0, e0, e1, delta=config.delta, fprs=fprs, confidence=confidence)
    colluders = config.colluders
    verdicts = []
    for name, value in planned.bounds.items():
        verdicts.append(_verdict(name, value.mu, value.epsilon, value.sound, value.assumes,
                                 name in COVERS[adversary], attack, canary, adversary, colluders))
    cert = planned.certified
    verdicts.append(_verdict("certified", cert.mu, cert.epsilon, True, cert.assumes,
                             planned.certified_bound in COVERS[adversary], attack, canary, adversary, colluders))
    return AuditReport(config=config, rounds=rounds, trials=trials, seed=seed, canary=canary, adversary=adversary,
                       plan=planned, attack=attack, verdicts=tuple(verdicts), seconds=run.seconds)

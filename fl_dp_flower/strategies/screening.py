"""Checks of one train reply against the round's plan: what a hostile or broken node can send.

:func:`~fl_dp_flower.strategies.replies.screen` runs these on every reply that is well formed
(keys, shapes, finite values, echoes parse). A reply that fails one is dropped and counted as a
*refusal* of its node (``max-node-refusals`` consecutive ones exclude it), never per run:

1. **Echo bounds** (:func:`check_echo`): the echoed settings must lie within a factor
   ``echo-tolerance`` of the plan (``1`` = exactly the plan), the round index must be the
   planned one, and ``dp.local-steps`` may not exceed ``floor(local-steps * echo-tolerance)``
   (so no size the server allocates comes from a reply). FedProx echoes must meet the
   preconditions of the FedProx terms (alpha > L, every eta_k <= 1/alpha), as the ClientApp's
   own instruction check does: for the echo's own alpha and steps and for the least private combination
   of plan and echo the round is charged at (issue 34). Under per-sample clipping the echoed batch size
   may not exceed the reply's num-examples (:func:`check_batch`).
2. **Update magnitude** (:func:`check_magnitude`): the M members summed in a reply each moved
   at most ``V * sum_k eta_k`` from the broadcast model w_t (every clipped step has norm <= V,
   FedProx's pull only shrinks the distance since eta_k alpha <= 1), and their summed noise
   ``n ~ N(0, M sigma^2 I_d)`` has ``||n||^2 / (M sigma^2) ~ chi2_d``. So an honest reply meets

       ||reply - M w_t|| <= M V sum_k eta_k + sigma sqrt(M chi2_d.isf(beta))

   except with probability <= beta (``update-bound-alpha``); a farther reply is rejected.
3. **Residual noise** (:func:`check_residual_noise`): the residual energy
   ``E = ||reply - M w_t||^2 / (d M sigma^2)`` of an honest reply is ``chi2_d(lambda) / d``,
   lambda = ||sum of updates||^2 / (M sigma^2): a noncentral chi-square, which stochastically
   dominates the central chi2_d. Rejecting ``E < chi2_d.ppf(alpha) / d`` therefore drops an
   honest reply with probability <= alpha (``noise-check-alpha``, 0 = off). Both checks' levels are
   charged to delta (:attr:`ScreeningRules.drop_probability`, docs/MATH.md §17.1). A node that sent
   no noise (or much less than it claims) has E close to ``lambda / d``, far below 1, and is
   caught. The check cannot catch noise a little below the claimed sigma (the threshold for
   d = 61,706 and alpha = 1e-12 is E >= 0.960, so a node adding 0.98 sigma passes), and it is
   weak for small d (the chi2_d quantile spreads as sqrt(2/d)). docs/MATH.md §17 states the
   honest-node assumption every bound rests on.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import TYPE_CHECKING

import numpy as np
from flwr.app import ArrayRecord
from scipy.stats import chi2

from fl_dp_flower import protocol
from fl_dp_flower.errors import FlDpError
from fl_dp_flower.privacy.records import check_prox
from fl_dp_flower.privacy.schedules import step_sizes
from fl_dp_flower.reply_checks import ReplyChecks
from fl_dp_flower.vocabulary import Schedule

from .ndarrays import array_values

if TYPE_CHECKING:
    from fl_dp_flower.privacy.records import AccountantConfig
    from fl_dp_flower.settings import DPSettings

    from .echo import Applied

REL = 1e-9  # relative slack of echo comparisons (echoes are the instruction's own floats)
FLOAT_SLACK = 1e-5  # relative slack of the magnitude bound for float32 rounding of the uploads


class Rejected(FlDpError, ValueError):
    """A well-formed reply that a screening rule rejects (counted as a refusal of its node)."""


@dataclass(frozen=True)
class ScreeningRules:
    """The round's plan and the knobs of the three checks (run-config keys in parentheses)."""

    planned: Applied
    schedule: Schedule
    fedprox: bool
    smoothness: float
    per_sample: bool
    echo_tolerance: float = ReplyChecks.echo_tolerance  # (echo-tolerance) >= 1
    noise_check_alpha: float = ReplyChecks.noise_check_alpha  # (noise-check-alpha) false-alarm rate; 0 = off
    update_bound_alpha: float = ReplyChecks.update_bound_alpha  # (update-bound-alpha) tail probability
    #: secure aggregation: every reply holds w_t + the average of the secure sum, not one upload, so only the
    #: echoes are checked (the magnitude and residual-noise checks describe one client's upload)
    secure_sum: bool = False
    #: the run asserts L-smooth losses: FedProx's alpha must then exceed L (plan_rules.check_prox)
    assume_smooth_losses: bool = True

    @property
    def drop_probability(self) -> float:
        """Bound on the probability that the data-dependent checks drop one honest reply: alpha + beta (the
        residual energy dominates chi2_d, the distance stays within the magnitude bound but with probability
        beta); 0 when they do not run. Charged to delta (docs/MATH.md §17.1)."""
        return 0.0 if self.secure_sum else self.noise_check_alpha + self.update_bound_alpha


def rules_for(planned: Applied, settings: DPSettings, plan: AccountantConfig, checks: ReplyChecks) -> ScreeningRules:
    """The round's reply checks: the plan, what every client does, and the checks' knobs."""
    return ScreeningRules(planned=planned, schedule=settings.schedule, fedprox=settings.algorithm == "fedprox",
                          smoothness=plan.smoothness, per_sample=settings.clipping == "per-sample",
                          echo_tolerance=checks.echo_tolerance, noise_check_alpha=checks.noise_check_alpha,
                          update_bound_alpha=checks.update_bound_alpha,
                          secure_sum=plan.threat_model == "secure-aggregation",
                          assume_smooth_losses=plan.assume_smooth_losses)


def _within(name: str, echoed: float, planned: float, tolerance: float) -> None:
    low, high = planned / tolerance, planned * tolerance
    if not (low * (1 - REL) <= echoed <= high * (1 + REL)):
        span = f"= {planned!r}" if tolerance == 1 else f"in [{low:.6g}, {high:.6g}]"
        raise Rejected(f"echoed {name} = {echoed!r} is outside the plan (must be {span}; echo-tolerance "
                       f"= {tolerance:g})")


def check_echo(echoed: Applied, rules: ScreeningRules) -> None:
    """Raise :class:`Rejected` unless the echo lies within the plausible bounds of the plan."""
    p, tol = rules.planned, rules.echo_tolerance
    if echoed.round_index != p.round_index:
        raise Rejected(f"echoed {protocol.ROUND_INDEX} = {echoed.round_index} answers another round than the "
                       f"planned {p.round_index}")
    max_steps = math.floor(p.local_steps * tol * (1 + REL))
    if echoed.local_steps > max_steps:
        raise Rejected(f"echoed {protocol.LOCAL_STEPS} = {echoed.local_steps} exceeds the plan's {p.local_steps} "
                       f"(at most {max_steps} with echo-tolerance = {tol:g})")
    _within(protocol.SIGMA, echoed.sigma, p.sigma, tol)
    _within(protocol.CLIP_NORM, echoed.clip_norm, p.clip_norm, tol)
    _within(protocol.LR, echoed.lr, p.lr, tol)
    if echoed.batch_size is not None and p.batch_size is not None:
        if echoed.batch_size > p.batch_size * tol * (1 + REL):  # per-batch: min(B, n) may be smaller
            raise Rejected(f"echoed {protocol.BATCH_SIZE} = {echoed.batch_size} exceeds the plan's {p.batch_size}")
        if rules.per_sample:
            _within(protocol.BATCH_SIZE, echoed.batch_size, p.batch_size, tol)
    if rules.fedprox:
        if echoed.prox_alpha is None:
            raise Rejected(f"a fedprox reply must echo {protocol.PROX_ALPHA}")
        if p.prox_alpha is not None:
            _within(protocol.PROX_ALPHA, echoed.prox_alpha, p.prox_alpha, tol)
        # the preconditions (alpha > L, every eta_k <= 1/alpha) must hold for what the node says it ran (its
        # own alpha and steps: issue 34, lr 0.4 with alpha 4 inside a tolerance of 4) and for what the round
        # is charged at, the least private of plan and echo (smallest alpha, element-wise largest steps)
        own = step_sizes(rules.schedule, echoed.lr, echoed.round_index, echoed.local_steps)
        alpha = min(a for a in (echoed.prox_alpha, p.prox_alpha) if a is not None)
        for what, a, etas in (("echoed", echoed.prox_alpha, own),
                              ("charged (least private of plan and echo)", alpha, worst_step_sizes(echoed, rules))):
            try:
                check_prox("fedprox", a, rules.smoothness, max(etas), rules.assume_smooth_losses)
            except ValueError as err:
                raise Rejected(f"{what} FedProx settings break the preconditions of its bound: {err}") from None


def check_batch(echoed: Applied, num_examples: int, rules: ScreeningRules) -> None:
    """Per-sample clipping: the echoed batch size B must fit the examples the reply claims (a client with
    fewer samples than B averages over fewer than B clipped gradients, so 2V/B would understate it)."""
    if rules.per_sample and echoed.batch_size is not None and echoed.batch_size > num_examples:
        raise Rejected(f"echoed {protocol.BATCH_SIZE} = {echoed.batch_size} exceeds the reply's num-examples = "
                       f"{num_examples}: per-sample clipping over fewer samples than the B it is charged at")


def worst_step_sizes(echoed: Applied, rules: ScreeningRules) -> tuple[float, ...]:
    """Element-wise largest step sizes of plan and echo (call after the local-steps bound)."""
    p = rules.planned
    mine = step_sizes(rules.schedule, echoed.lr, echoed.round_index, echoed.local_steps)
    plan = step_sizes(rules.schedule, p.lr, p.round_index, p.local_steps)
    longer, shorter = (mine, plan) if len(mine) >= len(plan) else (plan, mine)
    return tuple(max(a, shorter[k]) if k < len(shorter) else a for k, a in enumerate(longer))


def residual_sq(arrays: ArrayRecord, reference: ArrayRecord, members: int) -> tuple[float, int]:
    """(||reply - M w_t||^2, d) in float64 over every value of the reply (numpy's own sum of products:
    a BLAS dot spreads 26,010 values over its threads, 20 ms a reply on a loaded 2-core machine)."""
    total, count = 0.0, 0
    for key, ref in reference.items():
        diff = (array_values(arrays[key]).astype(np.float64) - members * array_values(ref).astype(np.float64)).ravel()
        total += float(np.einsum("i,i->", diff, diff))
        count += diff.size
    return total, count


def reference_norm(reference: ArrayRecord) -> float:
    """||w_t|| in float64."""
    return math.sqrt(sum(float(np.sum(np.square(array_values(a).astype(np.float64)))) for a in reference.values()))


@lru_cache(maxsize=64)
def _chi2_ppf(q: float, d: int) -> float:
    return float(chi2.ppf(q, d))


@lru_cache(maxsize=64)
def _chi2_isf(q: float, d: int) -> float:
    return float(chi2.isf(q, d))


def residual_threshold(d: int, alpha: float) -> float:
    """The smallest residual energy E an honest reply reaches except with probability alpha."""
    return _chi2_ppf(alpha, d) / d


def magnitude_bound(members: int, d: int, clip_norm: float, etas: Iterable[float], sigma: float,
                    alpha: float) -> float:
    """M V sum_k eta_k + sigma sqrt(M chi2_d.isf(alpha)): the farthest an honest reply lies from M w_t
    except with probability alpha (units of the weights)."""
    return members * clip_norm * math.fsum(etas) + sigma * math.sqrt(members * _chi2_isf(alpha, d))


def check_magnitude(distance_sq: float, d: int, members: int, echoed: Applied, rules: ScreeningRules,
                    w_norm: float) -> None:
    """Raise :class:`Rejected` if the reply lies farther from M w_t than clipping and noise allow."""
    p = rules.planned
    bound = magnitude_bound(members, d, max(p.clip_norm, echoed.clip_norm), worst_step_sizes(echoed, rules),
                            max(p.sigma, echoed.sigma), rules.update_bound_alpha)
    slack = FLOAT_SLACK * (bound + members * w_norm)
    distance = math.sqrt(distance_sq)
    if not distance <= bound + slack:
        raise Rejected(f"upload lies {distance:.6g} from {members} x the broadcast model, farther than "
                       f"clipping and noise allow ({bound:.6g} = M V sum(eta) + a noise norm bound "
                       f"exceeded with probability {rules.update_bound_alpha:g})")


def check_residual_noise(distance_sq: float, d: int, members: int, echoed: Applied,
                         rules: ScreeningRules) -> float:
    """The residual energy E of the reply; raise :class:`Rejected` when it is below the chi2_d
    quantile at ``noise-check-alpha`` (too little noise for the sigma it is accounted at)."""
    sigma = min(rules.planned.sigma, echoed.sigma)  # the sigma the round accounts for this reply
    energy = distance_sq / (d * members * sigma * sigma)
    alpha = rules.noise_check_alpha
    if alpha > 0:
        threshold = residual_threshold(d, alpha)
        if not energy >= threshold:
            raise Rejected(f"residual energy ||reply - M w_t||^2 / (d M sigma^2) = {energy:.4g} is below "
                           f"{threshold:.4g}, the chi2_{d} quantile at noise-check-alpha = {alpha:g}: the "
                           f"upload carries less noise than sigma = {sigma:g} (honest replies give about 1)")
    return energy


def check_reply(arrays: ArrayRecord, reference: ArrayRecord, members: int, echoed: Applied,
                rules: ScreeningRules, w_norm: float) -> float:
    """All three checks; returns the residual energy E (for tests and the operator's DEBUG log); under
    ``rules.secure_sum`` only the echo check (E is then nan)."""
    check_echo(echoed, rules)
    if rules.secure_sum:
        return math.nan
    distance_sq, d = residual_sq(arrays, reference, members)
    check_magnitude(distance_sq, d, members, echoed, rules, w_norm)
    return check_residual_noise(distance_sq, d, members, echoed, rules)

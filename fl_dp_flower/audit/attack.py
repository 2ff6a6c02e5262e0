"""The audit's attack and its statistics (numpy/scipy only): the likelihood-ratio test on the final
model, Clopper-Pearson intervals, and the empirical lower bounds on mu and on epsilon(delta).

The final models of the two worlds are Gaussian with one shared isotropic covariance (the noise is
i.i.d. and the canary's updates are translations), so the Neyman-Pearson most powerful test
thresholds the projection of w_T on the difference of the two worlds' means. The means are
estimated on *shadow* trials and every threshold is the shadow world-0 score quantile at a target
false-positive rate; the rates are then counted on fresh *evaluation* trials, so the counts are
binomial and Clopper-Pearson applies without any selection effect.

Lower bounds (docs/audit.md). Any test of a mu-GDP mechanism satisfies FNR >= T_G(mu)(FPR) =
Phi(Phi^{-1}(1 - FPR) - mu); T_G(mu) decreases in FPR, so with upper confidence bounds FPR_u, FNR_u,

    mu >= Phi^{-1}(1 - FPR_u) - Phi^{-1}(FNR_u),

and any (epsilon, delta)-DP mechanism satisfies FPR + e^eps FNR >= 1 - delta and its mirror, so

    epsilon >= max(log((1 - delta - FNR_u) / FPR_u), log((1 - delta - FPR_u) / FNR_u)).

All 2J one-sided bounds (J target rates) hold together with probability >= ``confidence``
(Bonferroni), so the maxima over the J rates are lower bounds at that confidence.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from scipy import special, stats

DEFAULT_FPRS = (0.001, 0.01, 0.05, 0.1, 0.25, 0.5)


def clopper_pearson(successes: int, trials: int, confidence: float) -> tuple[float, float]:
    """Two-sided Clopper-Pearson interval for a binomial proportion (exact, conservative)."""
    if not (0 <= successes <= trials) or trials < 1:
        raise ValueError(f"need 0 <= successes <= trials and trials >= 1, got {successes}/{trials}")
    tail = (1.0 - confidence) / 2.0
    lo = 0.0 if successes == 0 else float(stats.beta.ppf(tail, successes, trials - successes + 1))
    hi = 1.0 if successes == trials else float(stats.beta.ppf(1.0 - tail, successes + 1, trials - successes))
    return lo, hi


def upper_bound(successes: int, trials: int, confidence: float) -> float:
    """One-sided Clopper-Pearson upper bound at ``confidence``."""
    return clopper_pearson(successes, trials, 2.0 * confidence - 1.0)[1]


def lr_scores(shadow0: np.ndarray, shadow1: np.ndarray, *models: np.ndarray) -> tuple[np.ndarray, ...]:
    """Project models ([n, d]) on the shadow worlds' mean difference: larger means world 1."""
    direction = shadow1.mean(axis=0) - shadow0.mean(axis=0)
    norm = float(np.linalg.norm(direction))
    if not norm > 0:
        raise ValueError("the shadow worlds have the same mean: no direction to test along")
    direction = direction / norm
    return tuple(np.asarray(m, dtype=np.float64) @ direction for m in (shadow0, shadow1, *models))


@dataclass(frozen=True)
class Operating:
    """One threshold of the test: the target FPR it was fitted for, the evaluation counts, the
    rates with two-sided ``confidence`` intervals, and its contributions to the lower bounds."""

    target_fpr: float
    threshold: float
    false_positives: int
    true_positives: int
    trials: int
    fpr: float
    fpr_interval: tuple[float, float]
    tpr: float
    tpr_interval: tuple[float, float]
    mu_lower: float
    epsilon_lower: float


@dataclass(frozen=True)
class AttackResult:
    operating: tuple[Operating, ...]
    mu_lower: float
    epsilon_lower: float
    mu_estimate: float
    confidence: float
    delta: float
    curve_fpr: np.ndarray
    curve_fnr: np.ndarray


def _mu_from(fpr_u: float, fnr_u: float) -> float:
    return float(special.ndtri(1.0 - fpr_u) - special.ndtri(fnr_u)) if fnr_u < 1.0 and fpr_u < 1.0 else -math.inf


def _eps_from(fpr_u: float, fnr_u: float, delta: float) -> float:
    best = -math.inf
    for a, b in ((fpr_u, fnr_u), (fnr_u, fpr_u)):
        if 1.0 - delta - b > 0.0 and a > 0.0:
            best = max(best, math.log((1.0 - delta - b) / a))
    return best


def audit_attack(shadow: tuple[np.ndarray, np.ndarray], evaluation: tuple[np.ndarray, np.ndarray], *,
                 delta: float, fprs: Sequence[float] = DEFAULT_FPRS, confidence: float = 0.95) -> AttackResult:
    """Fit the projection test on ``shadow`` final models and measure it on ``evaluation`` (world 0, world 1)."""
    s0, _, e0, e1 = lr_scores(shadow[0], shadow[1], evaluation[0], evaluation[1])
    return threshold_attack(s0, e0, e1, delta=delta, fprs=fprs, confidence=confidence)


def threshold_attack(shadow0: np.ndarray, evaluation0: np.ndarray, evaluation1: np.ndarray, *, delta: float,
                     fprs: Sequence[float] = DEFAULT_FPRS, confidence: float = 0.95) -> AttackResult:
    """Threshold a score (larger means world 1) at the shadow world-0 quantiles of ``fprs`` and count
    the errors on the evaluation scores of world 0 and world 1 (1-D arrays)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    if not fprs or not all(0.0 < f < 1.0 for f in fprs):
        raise ValueError(f"fprs must be rates in (0, 1), got {fprs!r}")
    s0, e0, e1 = (np.asarray(x, dtype=np.float64).ravel() for x in (shadow0, evaluation0, evaluation1))
    n0, n1 = len(e0), len(e1)
    each = 1.0 - (1.0 - confidence) / (2 * len(fprs))  # Bonferroni over the 2J one-sided bounds
    rows = []
    for target in fprs:
        threshold = float(np.quantile(s0, 1.0 - target))
        fp, tp = int((e0 > threshold).sum()), int((e1 > threshold).sum())
        fpr_u, fnr_u = upper_bound(fp, n0, each), upper_bound(n1 - tp, n1, each)
        tpr_lo, tpr_hi = clopper_pearson(tp, n1, confidence)
        rows.append(Operating(target_fpr=float(target), threshold=threshold, false_positives=fp,
                              true_positives=tp, trials=n0, fpr=fp / n0,
                              fpr_interval=clopper_pearson(fp, n0, confidence), tpr=tp / n1,
                              tpr_interval=(tpr_lo, tpr_hi), mu_lower=_mu_from(fpr_u, fnr_u),
                              epsilon_lower=_eps_from(fpr_u, fnr_u, delta)))
    # The empirical trade-off curve: FNR at every FPR the evaluation scores can realise.
    order = np.sort(e0)[::-1]
    thresholds = order[np.unique(np.geomspace(1, n0, 400).astype(int)) - 1]
    curve_fpr = np.array([(e0 > t).mean() for t in thresholds])
    curve_fnr = np.array([(e1 <= t).mean() for t in thresholds])
    spread = math.sqrt((e0.var(ddof=1) + e1.var(ddof=1)) / 2.0)
    return AttackResult(operating=tuple(rows), mu_lower=max(0.0, max(r.mu_lower for r in rows)),
                        epsilon_lower=max(0.0, max(r.epsilon_lower for r in rows)),
                        mu_estimate=float((e1.mean() - e0.mean()) / spread), confidence=confidence,
                        delta=delta, curve_fpr=curve_fpr, curve_fnr=curve_fnr)

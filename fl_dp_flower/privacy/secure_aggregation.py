"""The ``secure_aggregation`` bound: a curious server that sees only the secure sum (docs/MATH.md §20).

Threat model ``secure-aggregation``: the server follows the secure-aggregation protocol (Flower's
SecAgg+) honestly but is curious; each round it learns only the sum of the noisy uploads whose
masked inputs entered the sum (and who they were), plus every global model it computes from those
sums. A coalition of at most c participants colludes with it and subtracts its own uploads.

In sum units, round t releases S_t = sum_i p_i u_i (uniform weights: p_i = 1/m_t, a fixed rescaling
of sum_i u_i). Replacing one sample of the target k moves S_t by at most p_k Gamma_t (Gamma_t: the
sensitivity of one client's upload, :func:`terms.round_terms`), and the noise the coalition cannot
subtract has std sigma * sqrt(p_k^2 + sum of the honest others' p_j^2), for uniform weights
sigma * sqrt(m_t - c)/m_t. The ratio is the all-rounds composition term of the same round
(``gamma_t / target_noise_std_t``, average units, :meth:`RoundRecord.hidden_noise_stds`): uniform
weights give Gamma_t / (sigma * sqrt(m_t - c)). The rounds compose as Gaussian DP, so

    mu = sqrt(sum_t (Gamma_t / (sigma_t * sqrt(m_t - c)))^2),

the composition mu, here certified against the server itself. A round with m_t <= c leaves the
target's own noise (c_eff = m_t - 1): it costs that round's local-DP term Gamma_t / sigma_t, never
more (SecAgg+ with more colluders than its threshold reveals single uploads: local DP still holds).

**Integer sums (runs).** SecAgg+ sums integers, so a run's clients put their clean update on a grid
of step s and add integer Skellam noise of variance sigma^2 (training/secure_sum.py); the server
sees the exact integer sum modulo 2^32. Then round t is a multi-dimensional Skellam mechanism with
variance (m_t - c_eff) sigma_t^2 / s^2 and sensitivity Gamma_t / s + sqrt(d) grid units, accounted
by RDP (:mod:`.skellam`, Agarwal-Kairouz-Liu 2021), composed over rounds and converted to epsilon:
:class:`SecureSumAccount`, used whenever the accountant's config names the grid
(``sum_grid_step``, ``sum_dimension``). That bound has no Gaussian-DP parameter: its ``mu`` is
reported as inf (no f-DP claim) and its epsilon and RDP curve come from RDP. Without a grid (plans
for the real-valued sum) the bound is composition's mu, as above: planning only (the label says so).

The final-model bound is never combined with it (the server sees every sum), and Poisson client
sampling is refused (the server draws the sample and could bias it: no amplification is claimed;
:func:`records.sampling_problems`).
The bound rests on :func:`secure_aggregation_assumption`, printed wherever it is.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

import numpy as np

from .bounds import BoundValue
from .skellam import ORDERS, SkellamRound, epsilon_from_rdp, honest_clients, log_clamp_bound, skellam_assumption
from .validate import int_at_least, positive

__all__ = ["NOT_YET_CERTIFIABLE", "REAL_SUM_LABEL", "SECURE_AGGREGATION_BOUND", "SECURE_AGGREGATION_THREAT",
           "SecureSumAccount", "amend_secure_aggregation", "rdp_delta", "secure_aggregation_assumption"]

#: the name of the bound in a report's ``bounds``
SECURE_AGGREGATION_BOUND = "secure_aggregation"
#: the threat model it answers
SECURE_AGGREGATION_THREAT = "secure-aggregation"
#: why a plan without the integer grid certifies nothing (the reason behind the app's and the library's refusal)
NOT_YET_CERTIFIABLE = ("a run certifies the integer secure sum, which needs the grid (the accountant's sum_grid_step "
                       "and sum_dimension, and the strategy on a SecAggGrid with the same step: docs/MATH.md §20.4)")
#: the label of the real-valued-sum bound (plans without a grid)
REAL_SUM_LABEL = "real-valued secure sum: planning only (a run certifies the integer sum's Skellam bound)"


def secure_aggregation_assumption(colluders: int) -> str:
    """The trust assumption of the ``secure_aggregation`` bound, printed next to it (``BoundValue.assumes``)."""
    c = int_at_least("colluders", colluders, 0)
    return (f"secure aggregation (SecAgg+): an honest-but-curious server that follows the protocol and sees only "
            f"the sum of the uploads that entered it; at most c = {c} colluding participants, fewer than SecAgg+'s "
            "reconstruction threshold; every client adds its own noise before masking (docs/MATH.md §20)")


class SecureSumAccount:
    """The running Skellam RDP of the integer secure sum, replace-one and add/remove-one, at
    :data:`.skellam.ORDERS`, and the log of a bound on P(some client clamped some value), which widens
    delta (module docstring; docs/MATH.md §20.4)."""

    def __init__(self, step: float, dimension: int, colluders: int, clients_per_upload: int = 1) -> None:
        self.step, self.dimension = positive("sum_grid_step", step), int_at_least("sum_dimension", dimension, 1)
        self.colluders = int_at_least("colluders", colluders, 0)
        #: the most clients one integer upload sums (a cohort node's members; docs/MATH.md §20.6): the clamp's range
        self.clients_per_upload = int_at_least("sum_clients_per_upload", clients_per_upload, 1)
        self.rdp = np.zeros(len(ORDERS))
        self.rdp_add_remove = np.zeros(len(ORDERS))
        self.log_clamp = -math.inf

    def curves(self, clients: int, sigma: float, sensitivity: float, sensitivity_add_remove: float,
               update_bound: float) -> Curves:
        """One round's RDP curves (replace-one, add/remove-one) and log clamp bound (clients x d values whose
        clean part is at most ``update_bound`` = V sum_k eta_k, summed up to ``clients_per_upload`` per upload);
        zeros / -inf when nothing entered the sum. ``clients`` counts clients (a cohort's members), each of
        which added its own Skellam noise: the honest variance is (clients - c_eff) sigma^2, c in clients."""
        if clients == 0:
            return np.zeros(len(ORDERS)), np.zeros(len(ORDERS)), -math.inf
        honest = honest_clients(clients, self.colluders)
        ro, ar = (SkellamRound(g, sigma, honest, self.step, self.dimension).rdp()
                  for g in (sensitivity, sensitivity_add_remove))
        return ro, ar, log_clamp_bound(self.step, sigma, update_bound, clients, self.dimension,
                                          min(self.clients_per_upload, clients))

    def add(self, curves: Curves) -> None:
        self.rdp = self.rdp + curves[0]
        self.rdp_add_remove = self.rdp_add_remove + curves[1]
        self.log_clamp = float(np.logaddexp(self.log_clamp, curves[2]))

    def amend(self, bounds: dict[str, BoundValue], add_remove: dict[str, Any], delta: float,
              trial: Curves | None = None) -> tuple[tuple[int, ...], tuple[float, ...]]:
        """Replace the ``secure_aggregation`` bound (and its add/remove-one entry) by the Skellam bound, with
        ``trial`` (a round's curves) added when given, and mark the Gaussian bounds as not describing this
        run; return the certified RDP curve (orders, nats)."""
        rdp, rdp_ar, log_clamp = (self.rdp, self.rdp_add_remove, self.log_clamp) if trial is None else (
            self.rdp + trial[0], self.rdp_add_remove + trial[1], float(np.logaddexp(self.log_clamp, trial[2])))
        value = bounds[SECURE_AGGREGATION_BOUND]
        replaced = (REAL_SUM_LABEL, secure_aggregation_assumption(self.colluders))
        label = (*(a for a in value.assumes if a not in replaced), skellam_assumption(self.colluders))
        for name, other in list(bounds.items()):
            if name != SECURE_AGGREGATION_BOUND:
                bounds[name] = BoundValue(mu=other.mu, epsilon=other.epsilon, sound=False,
                                          assumes=(*other.assumes, GAUSSIAN_ONLY))
        bounds[SECURE_AGGREGATION_BOUND] = BoundValue(mu=math.inf, epsilon=_epsilon(rdp, delta, log_clamp),
                                                      sound=value.sound, assumes=label)
        if add_remove.get("bound") == SECURE_AGGREGATION_BOUND:
            add_remove.update(mu=math.inf, epsilon=_epsilon(rdp_ar, delta, log_clamp))
        return ORDERS, tuple(float(v) for v in rdp)


Curves = tuple[np.ndarray, np.ndarray, float]
#: the label added to the Gaussian bounds of a run whose noise is Skellam (they do not describe it)
GAUSSIAN_ONLY = "Gaussian noise: not this run's integer Skellam noise (only secure_aggregation describes it)"
#: the share of delta set aside for a client's clamp (docs/MATH.md §20.4)
CLAMP_SHARE = 1e-6


def _epsilon(rdp: np.ndarray, delta: float, log_clamp: float) -> float:
    """epsilon of the RDP curve at delta (1 - CLAMP_SHARE), valid at delta when the clamps fit the rest:
    (1 + e^eps) P(clamp) <= CLAMP_SHARE delta (a coupling: the clamped mechanism differs from the Skellam
    one only on the clamp event); inf (no claim) otherwise."""
    if not np.any(rdp):
        return 0.0
    eps = epsilon_from_rdp(rdp, ORDERS, delta * (1.0 - CLAMP_SHARE))[0]
    fits = float(np.logaddexp(0.0, eps)) + log_clamp <= math.log(CLAMP_SHARE * delta)
    return eps if fits else math.inf


def rdp_delta(rdp: tuple[float, ...], orders: tuple[int, ...], epsilon: float, log_clamp: float = -math.inf) -> float:
    """The smallest delta at ``epsilon`` from an RDP curve by the conversion of :func:`.skellam.epsilon_from_rdp`
    solved for delta, log delta = (a - 1)(r - eps + log(1 - 1/a)) - log a minimised over the orders, plus
    (1 + e^eps) P(clamp) (``log_clamp``: its log)."""
    a, r = np.asarray(orders, dtype=np.float64), np.asarray(rdp, dtype=np.float64)
    log_delta = (a - 1.0) * (r - epsilon + np.log1p(-1.0 / a)) - np.log(a)
    clamp = float(np.logaddexp(0.0, epsilon)) + log_clamp
    return float(min(1.0, math.exp(float(np.logaddexp(min(0.0, float(np.min(log_delta))), min(0.0, clamp))))))


def amend_secure_aggregation(threat_model: str, colluders: int, bounds: dict[str, BoundValue],
                             assumes: dict[str, tuple[str, ...]], ar_mus: dict[str, float],
                             real_valued: bool = True) -> None:
    """Add the ``secure_aggregation`` bound to a report's ``bounds`` (and its add/remove-one mu and
    assumptions) when the threat model is secure-aggregation; nothing otherwise.

    Its mu and epsilon (at the report's delta) are composition's (module docstring): the real-valued
    sum, labelled planning only when ``real_valued``; :meth:`SecureSumAccount.amend` then replaces
    them by the integer sum's Skellam bound."""
    if threat_model != SECURE_AGGREGATION_THREAT:
        return
    composition = bounds["composition"]
    label = (*assumes["composition"], secure_aggregation_assumption(colluders), *((REAL_SUM_LABEL,) * real_valued))
    bounds[SECURE_AGGREGATION_BOUND] = BoundValue(mu=composition.mu, epsilon=composition.epsilon,
                                                  sound=composition.sound, assumes=label)
    assumes[SECURE_AGGREGATION_BOUND] = label
    ar_mus[SECURE_AGGREGATION_BOUND] = ar_mus["composition"]


def warn_planning_only(threat_model: str, sum_grid_step: float | None) -> None:
    """Warn that an accountant under secure-aggregation without the integer grid reports the real-valued sum's
    bound, planning only (issue 28 item 5; its reports and get_privacy_spent() say ``planning_only``)."""
    if threat_model == SECURE_AGGREGATION_THREAT and sum_grid_step is None:
        warnings.warn(f"threat_model 'secure-aggregation' without sum_grid_step: {REAL_SUM_LABEL}; its epsilon is not "
                      "sound for a run (reports and get_privacy_spent() say planning_only)", stacklevel=3)

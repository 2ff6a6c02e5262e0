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

The final-model bound is never combined with it (the server sees every sum), and Poisson client
sampling is refused (the server draws the sample and could bias it: no amplification is claimed;
:func:`records.sampling_problems`).
The bound rests on :func:`secure_aggregation_assumption`, printed wherever it is.
"""

from __future__ import annotations

from .bounds import BoundValue
from .validate import int_at_least

__all__ = ["NOT_YET_CERTIFIABLE", "SECURE_AGGREGATION_BOUND", "SECURE_AGGREGATION_THREAT", "amend_secure_aggregation",
           "secure_aggregation_assumption"]

#: the name of the bound in a report's ``bounds``
SECURE_AGGREGATION_BOUND = "secure_aggregation"
#: the threat model it answers
SECURE_AGGREGATION_THREAT = "secure-aggregation"
#: why no run and no strategy certifies the bound yet (the one reason behind the app's and the library's refusal)
NOT_YET_CERTIFIABLE = ("its bound is for the real-valued secure sum, while SecAgg+ quantizes every upload and the "
                       "rounding term is not certified (docs/MATH.md §20.4)")


def secure_aggregation_assumption(colluders: int) -> str:
    """The trust assumption of the ``secure_aggregation`` bound, printed next to it (``BoundValue.assumes``)."""
    c = int_at_least("colluders", colluders, 0)
    return (f"secure aggregation (SecAgg+): an honest-but-curious server that follows the protocol and sees only "
            f"the sum of the uploads that entered it; at most c = {c} colluding participants, fewer than SecAgg+'s "
            "reconstruction threshold; every client adds its own noise before masking (docs/MATH.md §20)")


def amend_secure_aggregation(threat_model: str, colluders: int, bounds: dict[str, BoundValue],
                             assumes: dict[str, tuple[str, ...]], ar_mus: dict[str, float]) -> None:
    """Add the ``secure_aggregation`` bound to a report's ``bounds`` (and its add/remove-one mu and
    assumptions) when the threat model is secure-aggregation; nothing otherwise.

    Its mu and epsilon (at the report's delta) are composition's (module docstring)."""
    if threat_model != SECURE_AGGREGATION_THREAT:
        return
    composition = bounds["composition"]
    label = (*assumes["composition"], secure_aggregation_assumption(colluders))
    bounds[SECURE_AGGREGATION_BOUND] = BoundValue(mu=composition.mu, epsilon=composition.epsilon,
                                                  sound=composition.sound, assumes=label)
    assumes[SECURE_AGGREGATION_BOUND] = label
    ar_mus[SECURE_AGGREGATION_BOUND] = ar_mus["composition"]

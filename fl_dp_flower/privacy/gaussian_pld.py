"""The PLD of one Gaussian mechanism, built as dp-accounting builds it, with its grid evaluated in one array.

``gaussian_pld(mu, interval)`` returns the same object, bit for bit, as dp-accounting's
``from_gaussian_mechanism(1.0, sensitivity=mu, value_discretization_interval=interval)`` (pessimistic
connect-the-dots, log mass truncation -50, no subsampling, add/remove relation): it runs the library's own
construction (``_create_pld_pmf_from_monotone_privacy_loss``) on the library's own ``GaussianPrivacyLoss``.
The one difference: the library's ``get_delta_for_epsilon`` finds each grid point's cutoff
x = -mu/2 - eps / mu (its ``_inverse_privacy_loss_without_subsampling_remove``) in a Python loop, one
call per grid point (about 150,000 for mu near 1 at 1e-4 nats: most of a build's time); here the same formula,
a subtraction, a product and a quotient of IEEE doubles, is evaluated on the whole array at once, which
rounds every element exactly as the loop does. Nothing is approximated and no number changes
(tests/privacy/test_gaussian_pld.py compares the PMFs and epsilons with the library's, bit for bit).

Where the library's internals differ from what this module expects (another dp-accounting version), it falls
back to ``from_gaussian_mechanism`` itself: slower, never different.
"""

from __future__ import annotations

from typing import Any

import numpy as np

__all__ = ["gaussian_pld"]


def _fast_loss_class() -> Any:
    from dp_accounting.pld import privacy_loss_mechanism as plm

    class _ArrayGaussianLoss(plm.GaussianPrivacyLoss):  # type: ignore[misc]
        """``GaussianPrivacyLoss`` whose ``get_delta_for_epsilon`` evaluates the cutoffs as one array
        (sampling probability 1, REMOVE adjacency: the library's own formula, elementwise); otherwise the library's."""

        def get_delta_for_epsilon(self, epsilon: Any) -> Any:
            if (self.sampling_prob != 1.0 or self.adjacency_type != plm.AdjacencyType.REMOVE
                    or np.ndim(epsilon) != 1):
                return super().get_delta_for_epsilon(epsilon)
            epsilons = np.asarray(epsilon)
            x_cutoffs = np.asarray(self._inverse_privacy_loss_without_subsampling_remove(epsilons), dtype=float)
            deltas = np.zeros_like(epsilons, dtype=float)
            deltas[:] = self.mu_upper_cdf(x_cutoffs) - np.exp(epsilons + self.mu_lower_log_cdf(x_cutoffs))
            return np.clip(deltas, 0, 1)

    return _ArrayGaussianLoss


_LOSS: Any = None


def gaussian_pld(mu: float, interval: float) -> Any:
    """dp-accounting's PLD of the Gaussian mechanism with noise 1 and sensitivity ``mu`` (> 0), discretised
    pessimistically (connect-the-dots) at ``interval`` nats: equal to ``from_gaussian_mechanism(1.0,
    sensitivity=mu, value_discretization_interval=interval)``, built faster."""
    global _LOSS
    from dp_accounting.pld import privacy_loss_distribution as pld
    from dp_accounting.pld import privacy_loss_mechanism as plm

    create = getattr(pld, "_create_pld_pmf_from_monotone_privacy_loss", None)
    if create is None:  # another dp-accounting layout: the library's own builder
        return pld.from_gaussian_mechanism(1.0, sensitivity=mu, value_discretization_interval=interval)
    if _LOSS is None:
        _LOSS = _fast_loss_class()
    loss = _LOSS(1.0, sensitivity=mu, pessimistic_estimate=True, log_mass_truncation_bound=-50,
                 sampling_prob=1.0, adjacency_type=plm.AdjacencyType.REMOVE)
    pmf = create(loss, pessimistic_estimate=True, value_discretization_interval=interval, use_connect_dots=True)
    return pld.PrivacyLossDistribution(pmf)

"""Privacy math and accounting. Imports numpy/scipy only (no torch, no flwr).

Submodules: ``schedules`` (step sizes), ``records`` (validated inputs), ``gdp``
(Gaussian-DP numerics), ``terms`` (per-round sensitivities), ``bounds`` (the four
bounds), ``accountant`` (the stateful accountant), ``planning`` (calibration).
Names are re-exported lazily so importing one submodule never pulls in the rest.
"""

from importlib import import_module
from typing import Any

_EXPORTS = {
    "AccountantConfig": "records",
    "RoundRecord": "records",
    "SCHEDULES": "schedules",
    "step_size": "schedules",
    "step_sizes": "schedules",
    "BOUND_NAMES": "accountant",
    "Budget": "accountant",
    "BoundValue": "accountant",
    "PrivacyAccountant": "accountant",
    "PrivacyReport": "accountant",
    "PrivacySpent": "accountant",
    "calibrate": "planning",
    "plan": "planning",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(import_module(f"{__name__}.{module}"), name)

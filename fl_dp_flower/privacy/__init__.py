"""Privacy math and accounting. Imports numpy/scipy only (no torch, no flwr, no pydantic).

Submodules: ``validate`` (argument checks), ``schedules`` (step sizes), ``records`` (validated
inputs), ``gdp`` (Gaussian-DP numerics), ``terms`` / ``planned_terms`` (per-round sensitivities,
recorded / planned), ``bounds`` (composition, local DP, the certified rule), ``closed_forms``,
``final_model``, ``planned_bounds`` (the other bounds), ``accountant`` (the stateful accountant), ``planning``
(planned runs, calibration), ``skellam`` (RDP of an integer secure sum with Skellam noise; not wired in yet). The math is in docs/MATH.md.
"""

from fl_dp_flower.vocabulary import BOUND_NAMES, SCHEDULES

from .accountant import Budget, PrivacyAccountant, PrivacyReport, PrivacySpent
from .bounds import BoundValue, certified_bound
from .planning import Calibration, Plan, PlannedRun, SigmaCalibration, calibrate, calibrate_sigma, plan, planned_run
from .records import AccountantConfig, RoundRecord
from .schedules import step_size, step_sizes

__all__ = [
    "BOUND_NAMES",
    "SCHEDULES",
    "AccountantConfig",
    "BoundValue",
    "Budget",
    "Calibration",
    "Plan",
    "PlannedRun",
    "PrivacyAccountant",
    "PrivacyReport",
    "PrivacySpent",
    "RoundRecord",
    "SigmaCalibration",
    "calibrate",
    "calibrate_sigma",
    "certified_bound",
    "plan",
    "planned_run",
    "step_size",
    "step_sizes",
]

"""fl-dp-flower: differentially private federated learning (Noisy-FedAvg / Noisy-FedProx) on Flower.

Two floors (docs/ARCHITECTURE.md has the data flow). The library, at this package's root and in its folders:

- ``fl_dp_flower.vocabulary``  every user-facing name, defined once (standard library only)
- ``fl_dp_flower.privacy``     the math and the accountant (numpy/scipy only; docs/MATH.md)
- ``fl_dp_flower.training``    models, data, local update, noise (torch)
- ``fl_dp_flower.settings``    DPSettings, FederationSettings; ``protocol``, ``node``, ``client``: the wire
  contract, a node's guardrails and the client side (``dp_train``)
- ``fl_dp_flower.strategies``  the Flower strategies (flwr)
- ``fl_dp_flower.reporting``   ledger, log lines, Prometheus, plot, sinks (no torch, no flwr)
- ``fl_dp_flower.audit``       attacks and measurements of the real code

The reference app, in ``fl_dp_flower.app`` (never imported by the library): its run config, presets,
ServerApp and ClientApp, ``fl-dp-flower run`` and the planning commands.

The public API (below, ``__all__``) is what your own Flower app uses: settings, the strategies,
the client side (``dp_train``), the accountant and planning, the sinks, secure aggregation
(``SecAggGrid`` around your Grid, ``secure_aggregation_mod`` in your ClientApp, ``plan_grid``), and an
adapter for Flower's own DP wrappers. Names are imported lazily, so ``import fl_dp_flower`` stays cheap
(no torch, no flwr until a name that needs them is used).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

#: public name -> module that defines it
_PUBLIC = {
    "DPSettings": "fl_dp_flower.settings",
    "FederationSettings": "fl_dp_flower.settings",
    "NoisyFedAvg": "fl_dp_flower.strategies.noisy",
    "NoisyFedProx": "fl_dp_flower.strategies.noisy",
    "dp_train": "fl_dp_flower.client",
    "TrainInstruction": "fl_dp_flower.protocol",
    "PrivacyAccountant": "fl_dp_flower.privacy.accountant",
    "Budget": "fl_dp_flower.privacy.accountant",
    "plan": "fl_dp_flower.privacy.planning",
    "calibrate": "fl_dp_flower.privacy.planning",
    "calibrate_sigma": "fl_dp_flower.privacy.planning",
    "preflight_notes": "fl_dp_flower.privacy.preflight",
    "PrivacySink": "fl_dp_flower.reporting.rounds",
    "RoundOutcome": "fl_dp_flower.reporting.rounds",
    "LedgerSink": "fl_dp_flower.reporting.rounds",
    "ConsoleSink": "fl_dp_flower.reporting.rounds",
    "PrometheusSink": "fl_dp_flower.reporting.rounds",
    "open_ledger": "fl_dp_flower.reporting.rounds",
    "ModelCheckpoint": "fl_dp_flower.checkpoint",
    "FlowerGDPAccountant": "fl_dp_flower.interop",
    "FlDpError": "fl_dp_flower.errors",
    "SecAggGrid": "fl_dp_flower.strategies.secagg",
    "secure_aggregation_mod": "fl_dp_flower.secagg_mod",
    "plan_grid": "fl_dp_flower.training.secure_sum",
}

__all__ = [
    "Budget",
    "ConsoleSink",
    "DPSettings",
    "FederationSettings",
    "FlDpError",
    "FlowerGDPAccountant",
    "LedgerSink",
    "ModelCheckpoint",
    "NoisyFedAvg",
    "NoisyFedProx",
    "PrivacyAccountant",
    "PrivacySink",
    "PrometheusSink",
    "RoundOutcome",
    "SecAggGrid",
    "TrainInstruction",
    "calibrate",
    "calibrate_sigma",
    "dp_train",
    "open_ledger",
    "plan",
    "plan_grid",
    "preflight_notes",
    "secure_aggregation_mod",
]

if TYPE_CHECKING:
    from fl_dp_flower.secagg_mod import secure_aggregation_mod
    from fl_dp_flower.checkpoint import ModelCheckpoint
    from fl_dp_flower.client import dp_train
    from fl_dp_flower.errors import FlDpError
    from fl_dp_flower.interop import FlowerGDPAccountant
    from fl_dp_flower.privacy.accountant import Budget, PrivacyAccountant
    from fl_dp_flower.privacy.planning import calibrate, calibrate_sigma, plan
    from fl_dp_flower.privacy.preflight import preflight_notes
    from fl_dp_flower.protocol import TrainInstruction
    from fl_dp_flower.reporting.rounds import (ConsoleSink, LedgerSink, PrivacySink, PrometheusSink, RoundOutcome,
                                               open_ledger)
    from fl_dp_flower.settings import DPSettings, FederationSettings
    from fl_dp_flower.strategies.noisy import NoisyFedAvg, NoisyFedProx
    from fl_dp_flower.strategies.secagg import SecAggGrid
    from fl_dp_flower.training.secure_sum import plan_grid


def __getattr__(name: str) -> Any:
    module = _PUBLIC.get(name)
    if module is None:
        raise AttributeError(f"module 'fl_dp_flower' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))

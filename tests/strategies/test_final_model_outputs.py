"""Under the final-model threat model nothing derived from an intermediate global model may be published (docs/MATH.md
§15): the reference app evaluates such a run once at the end (app/threat.py), and library use is refused the same way
(review R2). Before: ``NoisyFedAvg.start(evaluate_fn=...)`` and ``fraction_evaluate > 0`` were accepted without a word,
each round's metrics went into its ledger line, and the run certified the final-model epsilon (0.365 on the linear canary's
stage-wise run) where only composition (1.077) describes what it published."""

from __future__ import annotations

import pytest
from flwr.app import ArrayRecord, MetricRecord

from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.records import AccountantConfig
from fl_dp_flower.settings import DPSettings, FederationSettings
from fl_dp_flower.strategies import NoisyFedAvg


def _strategy(threat_model: str, fraction_evaluate: float = 0.0) -> NoisyFedAvg:
    settings = DPSettings(sigma=0.5, clip_norm=1.0, local_steps=1)
    colluders = 0 if threat_model == "final-model" else 1
    acct = PrivacyAccountant(settings.accountant_config(clients=3, threat_model=threat_model,
                                                        assume_smooth_losses=True, colluders=colluders))
    return NoisyFedAvg(settings, acct, federation=FederationSettings(clients_per_round=3),
                       fraction_evaluate=fraction_evaluate)


def _evaluate(server_round: int, arrays: ArrayRecord) -> MetricRecord:
    return MetricRecord({"accuracy": 0.5})


def test_final_model_refuses_a_per_round_evaluation_in_library_use():
    with pytest.raises(ValueError, match="evaluate_fn must be None under threat_model 'final-model'"):
        _strategy("final-model").start(grid=None, initial_arrays=ArrayRecord(), num_rounds=1,  # type: ignore[arg-type]
                                       evaluate_fn=_evaluate)


def test_final_model_refuses_a_federated_evaluation_in_library_use():
    with pytest.raises(ValueError, match="fraction_evaluate = 0.5 must be 0 under threat_model 'final-model'"):
        _strategy("final-model", 0.5).start(grid=None, initial_arrays=ArrayRecord(), num_rounds=1)  # type: ignore[arg-type]


def test_what_the_refusal_protects():
    """The linear canary's stage-wise run (docs/MATH.md §14.2a): the final-model bound certifies 0.365, a third of the
    composition (1.077) that describes a run publishing a function of every round's model."""
    cfg = AccountantConfig(schedule="stage", lr=0.05, local_steps=5, clients=20, sigma=0.5, threat_model="final-model",
                           colluders=0, assume_smooth_losses=True)
    acct = PrivacyAccountant(cfg)
    for t in range(1, 1001):
        report = acct.step(cfg.planned_round(t))
    bounds = report.to_dict()["bounds"]
    assert report.certified_bound in ("final_model", "paper")
    assert report.certified.epsilon == pytest.approx(0.3646, abs=1e-3)
    assert report.certified.epsilon < 0.4 * bounds["composition"]["epsilon"]

"""What the configured threat model lets a run publish, and what its certificate assumes
(docs/MATH.md §15; issue 16 item 5)."""

from __future__ import annotations

from fl_dp_flower.config import AppConfig, ConfigError
from fl_dp_flower.privacy.bounds import smoothness_assumption
from fl_dp_flower.privacy.secure_aggregation import NOT_YET_CERTIFIABLE
from fl_dp_flower.reporting.console import FINAL_MODEL_ASSUMES


def publishes_per_round_models(config: AppConfig) -> bool:
    """Whether the run publishes model-derived per-round outputs (accuracy, loss, federated evaluation).

    Not under the final-model threat model: its bound covers the released model only, so the run
    evaluates that model once at the end and publishes nothing derived from the intermediate global
    models. Every sampled client still receives every global model: the bound assumes that
    participants do not reveal them.
    """
    return config.threat_model != "final-model"


def final_model_assumptions(config: AppConfig) -> list[str]:
    """What a final-model certificate assumes, printed next to it (log, summary.json)."""
    return [FINAL_MODEL_ASSUMES, smoothness_assumption(config.smoothness)]


def node_assumptions(config: AppConfig) -> list[str]:
    """What every certified number assumes of the nodes and their sampler (printed with it)."""
    return [
        "honest nodes: every aggregated client ran the update it echoes and added its own N(0, sigma^2) "
        f"(replies screened for it at noise-check-alpha = {config.noise_check_alpha:g}; docs/MATH.md §17)",
        f"an exact Gaussian sampler (noise-mode = {config.noise_mode!r}: truncated at "
        f"{'8.29' if config.noise_mode == 'secure' else '5.77'} sigma; docs/MATH.md §18)",
    ]


def require_runnable_threat_model(config: AppConfig) -> None:
    """Refuse a run whose threat model the run cannot deliver (ConfigError naming the key).

    ``secure-aggregation`` certifies against a server that sees only the secure sum of the uploads
    (docs/MATH.md §20). Runs do not mask their uploads (the SecAgg+ bridge is experimental and library
    only), so the server would see every noisy upload, and even masked sums are quantized
    (:data:`~fl_dp_flower.privacy.secure_aggregation.NOT_YET_CERTIFIABLE`): the threat model is for
    planning and calibration until then. The library strategy refuses it for the same reason.
    """
    if config.threat_model == "secure-aggregation":
        raise ConfigError("'threat-model' = 'secure-aggregation': runs do not use secure aggregation yet, so the "
                          "server would see every noisy upload and the secure-aggregation bound would not hold; "
                          "use it to plan and calibrate only, and run with 'curious-server' to be certified against "
                          f"the server (docs/MATH.md §20); and {NOT_YET_CERTIFIABLE}")

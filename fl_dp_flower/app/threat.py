"""What the configured threat model lets a run publish, and what its certificate assumes
(docs/MATH.md §15; issue 16 item 5)."""

from __future__ import annotations

from fl_dp_flower.app.config import AppConfig
from fl_dp_flower.privacy.bounds import smoothness_assumption
from flwr.serverapp import Grid

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
    if config.threat_model == "secure-aggregation":
        return ["honest nodes: every client in the sum ran the update it echoes and added its own integer Skellam "
                "noise of variance sigma^2 before masking (not screened: the server sees only the sum)",
                "an exact Poisson sampler (numpy's, PCG64 seeded from OS entropy; docs/MATH.md §20.4)"]
    return [
        "honest nodes: every aggregated client ran the update it echoes and added its own N(0, sigma^2) "
        f"(replies screened for it at noise-check-alpha = {config.noise_check_alpha:g}; docs/MATH.md §17)",
        f"an exact Gaussian sampler (noise-mode = {config.noise_mode!r}: truncated at "
        f"{'8.29' if config.noise_mode == 'secure' else '5.77'} sigma; docs/MATH.md §18)",
    ]


def run_grid(grid: Grid, config: AppConfig) -> Grid:
    """The Grid the run's strategy uses: under ``secure-aggregation`` every train round goes through SecAgg+
    (:class:`~fl_dp_flower.strategies.secagg.SecAggGrid`, the run's integer grid, at least ``min-replies``
    contributors per unmasked sum); otherwise ``grid`` itself."""
    if config.threat_model != "secure-aggregation":
        return grid
    from fl_dp_flower.strategies.secagg import SecAggGrid

    args = config.secagg_workflow_args()
    if isinstance(args["num_shares"], int) and args["num_shares"] >= config.clients_per_round:
        args["num_shares"] = 1.0  # every other client of the round
    return SecAggGrid(grid, config.secure_sum_grid(), min_contributors=config.min_replies, **args)

"""The run-config keys of the server's post-processing (a server optimizer, an averaged release).

:class:`~fl_dp_flower.app.config.AppConfig` inherits these fields (the keys are defined here, once, and
validated like every other key: errors name the dash key and its range); they become the
post-processing fields of :class:`~fl_dp_flower.settings.FederationSettings`
(:meth:`ServerUpdateConfig.server_update_settings`). What they do: fl_dp_flower/strategies/server_opt.py.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fl_dp_flower.app.config_messages import dash, dash_names
from fl_dp_flower.settings import server_step_problems
from fl_dp_flower.vocabulary import ReleaseAverage, SampleSecrecy, ServerOptimizer

__all__ = ["ServerUpdateConfig"]

_FREE = ("post-processing of the noisy aggregate: the privacy report is unchanged under 'all-rounds' and "
         "'curious-server'; refused under threat-model 'final-model'")


class ServerUpdateConfig(BaseModel):
    """The post-processing keys (a base of AppConfig, same model settings)."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=dash, populate_by_name=True,
                              allow_inf_nan=False, coerce_numbers_to_str=True, use_attribute_docstrings=True)

    sample_secrecy: SampleSecrecy = Field("public", description=(
        "\"public\": the ledger names each round's members (public-sample bound). \"secret\": ledger and metrics give "
        "counts, the ids go to the owner-only members.jsonl beside the ledger (verify does not need it), and the "
        "all-rounds bound 'sampled_secret' is conditioned on each round's count (docs/MATH.md §22; any sampling), "
        "assuming an honest server-side sampler and a sample no reader of the results learns."))
    server_optimizer: ServerOptimizer = Field("none", description=(
        "The server's step from the round's noisy aggregate a_t (" + _FREE + "). \"none\": the next global "
        "model is a_t. \"momentum\": heavy ball on the pseudo-gradient g = w_t - a_t (Flower's FedAvgM): "
        "v = 'server-momentum' v + g, w_{t+1} = w_t - 'server-lr' v. \"adam\": Adam on -g (Flower's FedAdam, "
        "beta_1 = 'server-momentum', beta_2 = 'server-adam-beta2', tau = 'server-adam-eps', bias-corrected)."))
    server_lr: float = Field(1.0, gt=0)
    """Step size of the server optimizer (with "momentum", 'server-lr' 1 and 'server-momentum' 0 is "none")."""
    server_lr_end: float = Field(1.0, gt=0, le=1)
    """Factor of 'server-lr' at the last planned round T: the step of round t is 'server-lr' x (1 - (1 -
    'server-lr-end') (t - 1) / (T - 1)), linear from 'server-lr' at round 1 (1: constant; with server-optimizer
    "momentum", 'server-lr' 1, 'server-momentum' 0 and a factor below 1 the aggregate's step decays)."""
    server_momentum: float = Field(0.9, ge=0, lt=1)
    """Momentum beta of server-optimizer "momentum"; Adam's beta_1."""
    server_adam_beta2: float = Field(0.99, ge=0, lt=1)
    """Adam's beta_2 (server-optimizer "adam")."""
    server_adam_eps: float = Field(1e-3, gt=0)
    """Adam's tau, added to sqrt(v) (server-optimizer "adam"; Flower's FedAdam default)."""
    server_weight_decay: float = Field(0.0, ge=0)
    """Decoupled (AdamW-style) weight decay lambda of the server step: w_{t+1} = w_t - lr_t step_t - lr_t lambda
    w_t, lr_t the round's server step size (with 'server-lr-end'); needs 'server-optimizer' "momentum" or "adam" and
    'server-lr' x lambda < 1 (0: off)."""
    release_average: ReleaseAverage = Field("none", description=(
        "The released model (central evaluation, final_model.pt) (" + _FREE + "). \"none\": the server's "
        "iterate. \"ema\": the bias-corrected exponential moving average of the iterates, decay "
        "'release-ema-decay'. \"tail\": the mean of the iterates of the last ceil('release-tail-fraction' x "
        "'num-server-rounds') planned rounds (before they begin: the iterate). The clients always train "
        "from the iterate."))
    release_ema_decay: float = Field(0.9, gt=0, lt=1)
    """Decay d of release-average "ema": the released model is sum_s d^(t-s) w_s / sum_s d^(t-s)."""
    release_tail_fraction: float = Field(0.5, gt=0, le=1)
    """Share of the planned rounds whose iterates release-average "tail" averages."""

    @model_validator(mode="after")
    def _refused_under_final_model(self) -> "ServerUpdateConfig":
        threat = getattr(self, "threat_model", None)
        used = [f"'{dash(name)}' = {getattr(self, name)!r}" for name in ("server_optimizer", "release_average")
                if getattr(self, name) != "none"]
        if threat == "final-model" and used:
            raise ValueError(f"{', '.join(used)}: must be 'none' under 'threat-model' = 'final-model' (its bound "
                             "holds for the plain noisy-GD iterate only, while under 'all-rounds' the server's "
                             "post-processing is free)")
        problems = server_step_problems(self.server_optimizer, self.server_lr, self.server_lr_end,
                                        self.server_weight_decay)
        if problems:  # the library's rules, its field names as this config's dash keys
            raise ValueError("; ".join(dash_names(problem, ServerUpdateConfig.model_fields) for problem in problems))
        return self

    def server_update_settings(self) -> dict[str, Any]:
        """The :class:`~fl_dp_flower.settings.FederationSettings` fields of these keys."""
        return {name: getattr(self, name) for name in ServerUpdateConfig.model_fields}

"""The run-config keys of the server's checks of each reply (echo tolerance, the residual-noise and
update-magnitude checks, the examples cap): a base of :class:`~fl_dp_flower.app.config.AppConfig`, turned
into the library's :class:`~fl_dp_flower.strategies.ReplyChecks` by ``fl_dp_flower.app.strategy.reply_checks``.
Its defaults have one home, :class:`fl_dp_flower.reply_checks.ReplyChecks`. What the checks do:
fl_dp_flower/strategies/screening.py, docs/MATH.md §17.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from fl_dp_flower import protocol
from fl_dp_flower.app.config_messages import dash
from fl_dp_flower.reply_checks import ReplyChecks

__all__ = ["ReplyChecksConfig"]


class ReplyChecksConfig(BaseModel):
    """The reply-check keys (a base of AppConfig, same model settings)."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=dash, populate_by_name=True,
                              allow_inf_nan=False, coerce_numbers_to_str=True, use_attribute_docstrings=True)

    echo_tolerance: float = Field(ReplyChecks.echo_tolerance, ge=1, description=(
        "Factor by which a reply's echoed settings ("
        f"{protocol.SIGMA}, {protocol.CLIP_NORM}, {protocol.LR}, {protocol.LOCAL_STEPS}, "
        f"{protocol.BATCH_SIZE}, {protocol.PROX_ALPHA}) may differ from the plan and still be accepted; accepted "
        "deviations are accounted least privately. 1 = the echo must equal the plan. A reply outside "
        "is dropped as a refusal of its node."))
    noise_check_alpha: float = Field(ReplyChecks.noise_check_alpha, ge=0, lt=1, description=(
        "False-alarm rate of the residual-noise check: a reply whose residual energy "
        "||reply - M w_t||^2 / (d M sigma^2) is below the chi2_d quantile at this level carries less "
        "noise than it is accounted at and is dropped as a refusal. 0 = no check. An honest reply is "
        "dropped with probability at most this, depending on its data, so the rounds' sum of it and "
        "'update-bound-alpha' is charged to delta (x (1 + e^eps); docs/MATH.md §17.1)."))
    update_bound_alpha: float = Field(ReplyChecks.update_bound_alpha, ge=0, lt=1, description=(
        "Tail probability of the noise-norm bound in the update-magnitude check: a reply farther "
        "than M V sum(eta) + sigma sqrt(M chi2_d.isf(alpha)) from M times the broadcast model is "
        "dropped as a refusal (an honest reply with probability at most this: charged to delta with "
        "'noise-check-alpha', docs/MATH.md §17.1). 0 = no check. A budget ('target-epsilon') needs the "
        "two levels' charge at its epsilon within a tenth of delta."))
    examples_cap_ratio: float = Field(ReplyChecks.examples_cap_ratio, ge=1, description=(
        "weighting 'examples': each node's num-examples is capped at this many times the round's "
        "(lower) median claim, with a WARNING; counts above 2**53 are malformed."))

"""The server's checks of each reply, as the user sets them: :class:`ReplyChecks` (its defaults are the
reference app's too). No Flower import, so the app's configuration reads the defaults from here; what the
checks do: fl_dp_flower/strategies/screening.py, docs/MATH.md §17.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from fl_dp_flower.privacy.screening_charge import DEFAULT_CHECK_LEVEL

__all__ = ["ReplyChecks"]


@dataclass(frozen=True)
class ReplyChecks:
    """The server's checks of each reply (docs/MATH.md §17), with the reference app's run-config keys in
    parentheses; pass one as ``NoisyFedAvg(..., reply_checks=ReplyChecks(...))``.

    echo_tolerance (echo-tolerance, >= 1): factor by which echoed settings may differ from the plan
    (accepted deviations are accounted least privately); noise_check_alpha (noise-check-alpha, in
    [0, 1), 0 = off): false-alarm rate of the residual-noise check; update_bound_alpha
    (update-bound-alpha, in [0, 1), 0 = off): tail probability of the update-magnitude bound;
    examples_cap_ratio (examples-cap-ratio, >= 1): weighting "examples" caps each claim at this many
    times the round's median.
    """

    echo_tolerance: float = 1.0
    noise_check_alpha: float = DEFAULT_CHECK_LEVEL
    update_bound_alpha: float = DEFAULT_CHECK_LEVEL
    examples_cap_ratio: float = 10.0

    def __post_init__(self) -> None:
        checks = (("echo_tolerance", self.echo_tolerance, 1.0 <= self.echo_tolerance < math.inf, ">= 1 and finite"),
                  ("noise_check_alpha", self.noise_check_alpha, 0.0 <= self.noise_check_alpha < 1.0, "in [0, 1)"),
                  ("update_bound_alpha", self.update_bound_alpha, 0.0 <= self.update_bound_alpha < 1.0, "in [0, 1)"),
                  ("examples_cap_ratio", self.examples_cap_ratio, self.examples_cap_ratio >= 1.0, ">= 1"))
        for name, value, ok, span in checks:
            if not ok:
                raise ValueError(f"ReplyChecks.{name} = {value!r} must be {span}")

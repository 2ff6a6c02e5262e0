"""The run-config keys of secure aggregation (threat-model "secure-aggregation"; docs/MATH.md §20).

:class:`~fl_dp_flower.app.config.AppConfig` inherits these fields (defined here, once, validated like every
other key). Under ``threat-model = "secure-aggregation"`` the server runs every train round through
Flower's SecAgg+ (:class:`~fl_dp_flower.strategies.secagg.SecAggGrid`), the clients upload their clean
update on an integer grid plus Skellam noise (training/secure_sum.py), and the accountant certifies the
Skellam bound of the integer sum (:mod:`fl_dp_flower.privacy.secure_aggregation`).
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from fl_dp_flower.app.config_messages import dash
from fl_dp_flower.privacy.plan_rules import colluding_nodes

__all__ = ["SecureAggregationConfig", "secagg_threshold"]


def secagg_threshold(fraction: float, shares: int) -> int:
    """SecAgg+'s reconstruction threshold as Flower 1.41 computes it: max(2, round(fraction x shares))."""
    return max(2, round(fraction * shares))


class SecureAggregationConfig(BaseModel):
    """The secure-aggregation keys (a base of AppConfig, same model settings)."""

    model_config = ConfigDict(frozen=True, extra="forbid", alias_generator=dash, populate_by_name=True,
                              allow_inf_nan=False, coerce_numbers_to_str=True, use_attribute_docstrings=True)

    secagg_num_shares: int = Field(0, ge=0, description=(
        "SecAgg+ neighbours of each node (Flower's num_shares): 0 = every other node of the round (the "
        "strongest: any coalition below the threshold learns nothing; cost grows with the square of the "
        "nodes per round); otherwise an integer >= 5 and >= the colluding nodes + 4 (cheaper; a node is "
        "masked against num_shares - 1 neighbours only). Colluding nodes: 'colluding-clients', or "
        "ceil('colluding-clients' / 'clients-per-node') with cohorts (docs/MATH.md §20.3, §20.6)."))
    secagg_threshold: float = Field(0.5, gt=0, le=1, description=(
        "SecAgg+'s reconstruction threshold as a fraction of the shares (Flower's reconstruction_threshold): "
        "a dropped node's masks are rebuilt from that many neighbours, and a coalition that large can "
        "unmask one upload, so the colluding nodes must stay below it (docs/MATH.md §20.3, §20.6)."))
    secagg_wrap_probability: float = Field(1e-9, gt=0, lt=1, description=(
        "Bound on the probability that some value of some round's secure sum leaves the decodable range "
        "([-2^31, 2^31) grid steps): it sets the grid step, the finest power of two that meets it. A wrap costs "
        "that round's accuracy, never privacy (the sum modulo 2^32 is post-processing of the exact integer sum)."))

    @model_validator(mode="after")
    def _secure_aggregation_needs(self) -> Any:
        if self.secagg_num_shares in (1, 2):
            raise ValueError("'secagg-num-shares' must be 0 (every other client) or an integer >= 3, got "
                             f"{self.secagg_num_shares}")
        if getattr(self, "threat_model", None) != "secure-aggregation":
            return self
        c: Any = self
        cpn = c.clients_per_node
        # SecAgg+ participants are NODES: a cohort node uploads its members' integer sum, and a colluding node
        # operator knows all its members' noise; the coalition counts ceil(c / cpn) nodes (docs/MATH.md §20.6)
        coalition, smallest = colluding_nodes(c.colluding_clients, cpn), -(-c.min_replies // cpn)
        if cpn > 1:
            for key, clients in (("min-replies", c.min_replies), ("clients-per-round", c.clients_per_round)):
                if -(-clients // cpn) - coalition < 4:
                    raise ValueError(
                        f"threat-model 'secure-aggregation' with 'clients-per-node' = {cpn} needs ceil('{key}' / "
                        f"'clients-per-node') - ceil('colluding-clients' / 'clients-per-node') >= 4 (got "
                        f"{-(-clients // cpn)} - {coalition}): a sum of {clients} clients may lie on "
                        f"{-(-clients // cpn)} nodes, and Flower's SecAgg+ masks come from 32-bit seeds, so a sum "
                        f"with 3 or fewer nodes outside the coalition could be brute-forced: raise '{key}' to >= "
                        f"{(coalition + 4) * cpn} or lower 'clients-per-node' (docs/MATH.md §20.3, §20.6)")
        elif c.min_replies - c.colluding_clients < 4:
            raise ValueError(f"threat-model 'secure-aggregation' needs 'min-replies' - 'colluding-clients' >= 4 (got "
                             f"{c.min_replies} - {c.colluding_clients}): Flower's SecAgg+ masks come from 32-bit seeds, "
                             "so a sum with 3 or fewer contributors outside the coalition could be brute-forced "
                             "(docs/MATH.md §20.3)")
        if 0 < self.secagg_num_shares < 5:
            raise ValueError("threat-model 'secure-aggregation' needs 'secagg-num-shares' = 0 or >= 5 (fewer neighbours "
                             "let a server brute-force Flower's 32-bit mask seeds along the ring; docs/MATH.md §20.3)")
        k = self.secagg_num_shares
        who = "ceil('colluding-clients' / 'clients-per-node') colluding nodes" if cpn > 1 else "'colluding-clients'"
        if k and coalition > k - 4:
            raise ValueError(f"threat-model 'secure-aggregation' needs {who} <= 'secagg-num-shares' - 4 (got "
                             f"{coalition} with {k}): a node is masked only against its {k - 1} neighbours, "
                             "so colluders among them could read its upload (docs/MATH.md §20.3)")
        threshold = secagg_threshold(self.secagg_threshold, k or smallest)
        if coalition >= threshold:
            shares = "ceil('min-replies' / 'clients-per-node')" if cpn > 1 else "'min-replies'"
            raise ValueError(f"threat-model 'secure-aggregation' needs SecAgg+'s reconstruction threshold above "
                             f"{who} ({coalition}): max(2, round('secagg-threshold' x shares)) = {threshold} with {k or smallest} "
                             f"shares ('secagg-num-shares', or {shares} when it is 0); a coalition that large can "
                             "unmask one upload")
        return self

    def secure_sum_grid(self) -> Any:
        """The integer grid of this run's uploads (training/secure_sum.py ``plan_grid``), None unless the
        threat model is secure-aggregation: the clean update bound of the largest round (round 1's step
        sizes), clients-per-round uploads of the model's values, num-server-rounds rounds, up to clients-per-node
        clients summed per upload (a cohort node's)."""
        if getattr(self, "threat_model", None) != "secure-aggregation":
            return None
        from fl_dp_flower.privacy.schedules import step_sizes  # numpy-free; torch only below (the model's size)
        from fl_dp_flower.training.models import parameter_count
        from fl_dp_flower.training.secure_sum import plan_grid

        c: Any = self
        etas = step_sizes(c.schedule, c.lr, 0, c.local_steps)
        return plan_grid(c.sigma, c.clip_norm, etas, c.clients_per_round, parameter_count(c.dataset, c.model),
                         c.num_server_rounds, c.secagg_wrap_probability, members_per_upload=c.clients_per_node)

    def secure_sum_fields(self) -> dict[str, Any]:
        """The accountant config's ``sum_grid_step``, ``sum_dimension`` and ``sum_clients_per_upload`` (a cohort
        node uploads its members' integer sum) ({} outside secure aggregation)."""
        grid = self.secure_sum_grid()
        if grid is None:
            return {}
        from fl_dp_flower.training.models import parameter_count

        c: Any = self
        return {"sum_grid_step": grid.step, "sum_dimension": parameter_count(c.dataset, c.model),
                "sum_clients_per_upload": c.clients_per_node}

    def secagg_workflow_args(self) -> dict[str, Any]:
        """SecAggGrid's num_shares and reconstruction_threshold (Flower's conventions: 1.0 = all)."""
        return {"num_shares": self.secagg_num_shares or 1.0, "reconstruction_threshold": self.secagg_threshold}

"""The rules a planned run must satisfy beyond each field's own range: FedProx's step-size
condition, the L-smoothness assertion, the coalition of the final-model threat model, Poisson
sampling's threat models and secure aggregation's grid (docs/MATH.md §13, §14.2a, §15, §19.4, §20.4).

Each ``*_problems`` function returns the problems as sentences naming the fields (empty: none), so
the accountant's config, the app's run config and the CLI word them for their own keys.
"""

from __future__ import annotations

from .validate import int_at_least, positive

__all__ = ["SECAGG_HONEST_MINIMUM", "SMOOTHNESS_FIELDS", "batch_sampling_problems", "check_prox", "colluder_problems", "colluding_nodes",
           "sampling_problems", "secrecy_problems", "secret_echo_problems", "secure_contributor_problems", "secure_sum_problems", "smoothness_problems"]


def check_prox(algorithm: str, prox_alpha: float | None, smoothness: float, max_step: float,
               assume_smooth_losses: bool = True) -> None:
    """FedProx's conditions: alpha given, every step size eta <= 1/alpha (the clipping-only sensitivity
    needs it), and alpha > L where a certifying bound rests on L: with ``assume_smooth_losses`` (the
    final-model bound, per-sample clipping's drift bound). Without the assertion, alpha <= L is
    allowed: composition and local DP hold by clipping alone; the L-dependent bounds (paper,
    final-model) are then infinite (log rho = inf) and certify nothing."""
    if algorithm != "fedprox":
        return
    if prox_alpha is None:
        raise ValueError("prox_alpha is required for fedprox (> 0)")
    positive("prox_alpha", prox_alpha)
    if assume_smooth_losses and not prox_alpha > smoothness:
        raise ValueError(
            f"prox_alpha must be > smoothness L = {smoothness!r} for fedprox with assume_smooth_losses (the "
            f"L-smooth bounds need alpha > L), got {prox_alpha!r}; without assume_smooth_losses any alpha > 0 "
            "is certified by composition"
        )
    if max_step > 1.0 / prox_alpha:
        raise ValueError(
            f"lr (largest step size {max_step!r}) must be <= 1/prox_alpha = {1.0 / prox_alpha!r} "
            "for fedprox (its sensitivity bound needs every step size eta <= 1/alpha)"
        )


#: fields the L-smoothness rules name (callers rewrite them as CLI flags or run-config keys)
SMOOTHNESS_FIELDS = ("assume_smooth_losses", "threat_model", "smoothness", "clipping", "local_steps")


def smoothness_problems(threat_model: str, clipping: str, local_steps: int, smoothness: float,
                        assume_smooth_losses: bool) -> list[str]:
    """What the planned run asks of the L-smoothness assertion and does not have (docs/MATH.md §13, §15).

    - The final-model threat model is certified only by bounds that rest on L-smooth losses, so
      choosing it requires the explicit assertion (the shipped ReLU/max-pool models have no finite L).
    - smoothness = 0 asserted with per-sample clipping and K >= 2 claims linear per-sample losses
      and would divide the sensitivity by B (the rule docs/MATH.md §13 disproves for other losses):
      refused. Without the assertion L is ignored there (theta = 1).
    """
    problems = []
    if threat_model == "final-model" and not assume_smooth_losses:
        problems.append("threat_model 'final-model' requires assume_smooth_losses = true: its bounds rest on "
                        "L-smooth losses with L = smoothness, which ReLU/max-pool models (LeNet-5, ResNet-18) "
                        "do not satisfy (use threat_model 'all-rounds' otherwise)")
    if assume_smooth_losses and clipping == "per-sample" and local_steps >= 2 and smoothness == 0:
        problems.append("smoothness = 0 with assume_smooth_losses, per-sample clipping and local_steps >= 2 "
                        "asserts linear per-sample losses (sensitivity divided by the batch size): give the "
                        "losses' real smoothness > 0, or drop assume_smooth_losses (theta = 1 from clipping alone)")
    return problems


def colluder_problems(threat_model: str, colluders: int) -> list[str]:
    """What the final-model threat model asks of the coalition (docs/MATH.md §14.2a, §15).

    The final-model bound describes an adversary who sees only the released model. A colluding
    participant knows every global model it received (its upload is w_t + update + noise), which
    is the all-rounds view, where only composition holds. So the final-model threat model
    requires colluders = 0: the operator asserts that participants do not reveal the models they
    receive; with any colluder, use the all-rounds threat model.
    """
    if threat_model == "final-model" and colluders != 0:
        return [f"threat_model 'final-model' requires colluders = 0, got {colluders!r}: a colluding participant "
                "sees every global model it receives (the all-rounds view, where only composition holds); set "
                "colluders = 0 to assert that participants do not reveal the models they receive, or use "
                "threat_model 'all-rounds'"]
    return []


def sampling_problems(threat_model: str, sampling_rate: float | None) -> list[str]:
    """What Poisson client sampling asks of the threat model (docs/MATH.md §19.4).

    Amplification is certified only under the all-rounds threat model. The final-model bound is not
    analysed for the fixed-denominator aggregate of a random sample (its model-sensitivity factor
    does not hold there), so the final-model threat model is refused with sampling; the curious
    server knows the sample and gets local DP without amplification; secure-aggregation is refused
    too (the server draws the sample and could bias it, docs/MATH.md §20).
    """
    if sampling_rate is not None and threat_model == "secure-aggregation":
        return ["threat_model 'secure-aggregation' cannot be combined with sampling_rate (Poisson client sampling): "
                "the server draws the sample and could bias it, so no amplification can be claimed against it; "
                "use fixed-size sampling"]
    if sampling_rate is not None and threat_model == "final-model":
        return ["threat_model 'final-model' cannot be combined with sampling_rate (Poisson client sampling): "
                "the final-model bound is not analysed for a sampled, fixed-denominator aggregate; use "
                "threat_model 'all-rounds' (amplified) or fixed-size sampling"]
    return []


def secrecy_problems(threat_model: str, sample_secrecy: str, population: int | None, clients: int,
                     batch_rate: float | None = None) -> list[str]:
    """What a secret sample asks (docs/MATH.md §22): the conditioned bound answers the all-rounds adversary
    only, the population the clients are drawn from holds at least the planned clients, and no Poisson batch
    sampling (each round record carries the largest rate B/n_i its contributors echoed: it names the smallest
    contributor in the ledger that must hold counts only)."""
    problems = []
    if sample_secrecy == "secret" and batch_rate is not None:
        problems.append("sample_secrecy 'secret' cannot be combined with batch_rate (Poisson batch sampling): every "
                        "round record carries the largest batch rate B/n_i its contributors echoed, which tells a "
                        "ledger reader who took part (docs/MATH.md §22)")
    if sample_secrecy == "secret" and threat_model != "all-rounds":
        problems.append(f"sample_secrecy 'secret' needs threat_model 'all-rounds' (the conditioned bound answers "
                        f"the adversary who sees every global model), got {threat_model!r}")
    if population is not None and population < clients:
        problems.append(f"population must be an integer >= clients = {clients} (the clients a round draws from), "
                        f"got {population!r}")
    return problems


def secret_echo_problems(sample_secrecy: str, echo_tolerance: float) -> list[str]:
    """What a secret sample asks of the reply checks (docs/MATH.md §22): echoes equal to the plan. An accepted echo
    other than the plan is accounted least privately, and the round record's values would then name the rounds
    its node took part in."""
    if sample_secrecy != "secret" or echo_tolerance == 1.0:
        return []
    return [f"echo_tolerance = {echo_tolerance!r} with sample_secrecy 'secret': an accepted echo other than the plan "
            "is accounted least privately, and the round record's values then name the rounds its node took part in, so "
            "sample_secrecy = 'secret' needs echo_tolerance = 1 (a deviating reply is dropped as a refusal)"]


def batch_sampling_problems(threat_model: str, clipping: str, batch_rate: float | None,
                            clients_per_node: int = 1) -> list[str]:
    """What Poisson batch sampling on the nodes asks of the run (docs/MATH.md §23.4).

    The amplified ``batch_sampled`` bound needs per-sample clipping (the sum of clipped per-sample
    gradients over the expected batch size) and is analysed for the all-rounds and curious-server threat
    models only. With Poisson client sampling it is charged per round at the round's own contributor
    count, claiming nothing for the client sampling (docs/MATH.md §23.4). The app's cohort mode
    (``clients_per_node`` > 1) trains members with fixed batches: refused.
    """
    if batch_rate is None:
        return []
    if clients_per_node > 1:
        return ["batch_rate (Poisson batch sampling) needs clients_per_node = 1 (cohort mode draws fixed batches)"]
    if clipping != "per-sample":
        return ["batch_rate (Poisson batch sampling) needs clipping 'per-sample': a per-batch clipped step "
                "moves by 2V whichever samples it holds"]
    if threat_model not in ("all-rounds", "curious-server"):
        return [f"batch_rate (Poisson batch sampling) is amplified only under threat_model 'all-rounds' or "
                f"'curious-server', not {threat_model!r}; use fixed-size batches with it"]
    return []


def secure_sum_problems(threat_model: str, step: float | None, dimension: int | None,
                        clients_per_upload: int = 1) -> list[str]:
    """What the grid fields of an accountant config ask: both or neither, only under secure-aggregation; the clients
    per upload (>= 1) only with them."""
    int_at_least("sum_clients_per_upload", clients_per_upload, 1)
    if step is None and dimension is None:
        return [] if clients_per_upload == 1 else ["sum_clients_per_upload > 1 needs the integer sum's grid "
                                                   "(sum_grid_step and sum_dimension)"]
    if threat_model != "secure-aggregation":
        return ["sum_grid_step and sum_dimension are for threat_model 'secure-aggregation', not "
                f"{threat_model!r}"]
    if step is None or dimension is None:
        return ["sum_grid_step and sum_dimension come together (the grid step s and the number of values d)"]
    positive("sum_grid_step", step)
    int_at_least("sum_dimension", dimension, 1)
    return []


#: the fewest contributors outside the coalition a secure sum is unmasked for: Flower 1.41 derives every mask
#: from a 32-bit seed (numpy MT19937), so with <= 3 of them a server can brute-force the masks of one upload
SECAGG_HONEST_MINIMUM = 4


def colluding_nodes(colluders: int, clients_per_node: int = 1) -> int:
    """SecAgg+ participants (nodes) a coalition of ``colluders`` clients is counted as: ceil(c / clients-per-node).
    A colluding node's operator knows all its members' noise, so c (which the accountant subtracts, in clients)
    covers the members of at most floor(c / cpn) whole nodes; the node-level rules take the ceiling, which also
    counts a coalition that holds part of one more node (docs/MATH.md §20.6)."""
    c, cpn = int_at_least("colluders", colluders, 0), int_at_least("clients_per_node", clients_per_node, 1)
    return -(-c // cpn)


def secure_contributor_problems(clients_per_round: int, min_replies: int, colluders: int,
                                clients_per_node: int = 1) -> list[str]:
    """What secure aggregation asks of the round's size (docs/MATH.md §20.3, §20.6): a sum is unmasked only with
    at least SECAGG_HONEST_MINIMUM contributing NODES (SecAgg+ participants) outside the coalition, which counts
    as ``colluding_nodes(colluders, clients_per_node)`` nodes. A round of ``clients_per_round`` clients lies on
    at least ceil(clients_per_round / clients_per_node) nodes, so that many nodes minus the coalition must reach
    4, else every round may be abandoned; and the budget is checked for sums of ``min_replies`` clients, which
    may lie on ceil(min_replies / clients_per_node) nodes, so those must reach it too (smaller sums are never
    unmasked). With one client per node: clients_per_round - colluders >= 4 and min_replies - colluders >= 4."""
    cpn = int_at_least("clients_per_node", clients_per_node, 1)
    coalition = colluding_nodes(colluders, cpn)
    need = coalition + SECAGG_HONEST_MINIMUM
    if cpn > 1:
        nodes_round, nodes_min = -(-clients_per_round // cpn), -(-min_replies // cpn)
        if min(nodes_round, nodes_min) < need:
            return [f"secure aggregation with clients_per_node = {cpn} needs every sum on at least {need} nodes "
                    f"(SecAgg+ participants): {SECAGG_HONEST_MINIMUM} outside a coalition of {coalition} node(s) "
                    f"(ceil(colluders / clients_per_node), colluders = {colluders}), but clients_per_round = "
                    f"{clients_per_round} may lie on {nodes_round} node(s) and min_replies = {min_replies} on "
                    f"{nodes_min}; raise both to >= {need * cpn} (or lower clients_per_node)"]
        return []
    if clients_per_round < need:
        return [f"secure aggregation with {clients_per_round} clients per round and colluders = {colluders} can "
                f"never unmask a sum: each needs at least {SECAGG_HONEST_MINIMUM} contributors outside the "
                f"coalition (Flower's SecAgg+ masks come from 32-bit seeds), so every round would be abandoned "
                f"and nothing trained; sample clients_per_round >= {need} (and min_replies >= {need})"]
    if min_replies < need:
        return [f"secure aggregation needs min_replies >= colluders + {SECAGG_HONEST_MINIMUM} = {need} (got "
                f"{min_replies}): a sum with fewer than {SECAGG_HONEST_MINIMUM} contributors outside the coalition "
                "is never unmasked, and the budget is checked at min_replies contributors"]
    return []

"""Secure aggregation with cohorts (docs/MATH.md §20.6): what the accountant counts (members and their noise), the
clamp of a node's sum of M members (against scipy's exact Skellam tail), the grid plan that keeps it negligible, and
the node-level SecAgg+ rules (ceil(colluders / clients-per-node) colluding nodes)."""

from __future__ import annotations

import dataclasses
import math

import pytest
from scipy.stats import skellam

from fl_dp_flower import FederationSettings
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.plan_rules import colluding_nodes, secure_contributor_problems
from fl_dp_flower.privacy.records import AccountantConfig
from fl_dp_flower.privacy.skellam import CLIENT_HALF_RANGE, grid_plan, log_clamp_bound
from fl_dp_flower.privacy.skellam_tails import CLAMP_PLAN_LOG_BOUND

MAIN = AccountantConfig(lr=2.0, local_steps=1, clip_norm=1.0, clients=4000, sigma=0.711, colluders=1, delta=1e-5,
                        threat_model="secure-aggregation", sum_grid_step=2.0**-16, sum_dimension=26_010)


def _epsilon(config: AccountantConfig, rounds: int = 100) -> tuple[float, float]:
    acc = PrivacyAccountant(config)
    acc.extend(config.planned_round(t) for t in range(1, rounds + 1))
    return acc.report().certified.epsilon, acc._secure.log_clamp  # type: ignore[union-attr]


@pytest.mark.parametrize("colluders", [1, 400])
def test_a_cohort_run_is_charged_as_the_same_clients_uploading_alone(colluders):
    """The members' noise counts (4,000 members each adding sigma^2, c in clients): the Skellam RDP is that of the
    single-client run; only the clamp bound (of node sums of 400 members) differs, far below what delta can see."""
    single = dataclasses.replace(MAIN, colluders=colluders)
    cohort = dataclasses.replace(single, sum_clients_per_upload=400)
    (eps_single, clamp_single), (eps_cohort, clamp_cohort) = _epsilon(single), _epsilon(cohort)
    assert eps_cohort == eps_single
    assert eps_single == pytest.approx(4.1392 if colluders == 1 else 4.4027, abs=1e-4)
    assert clamp_single < clamp_cohort < -1e5  # node sums: wider, still astronomically unlikely


def test_a_node_sum_that_can_be_clamped_certifies_nothing():
    """A grid so fine that 400 members' clean sum can leave the range one upload carries: the clamp is likely, the
    epsilon is inf (no claim), where single uploads on the same grid certify."""
    fine = dataclasses.replace(MAIN, sum_grid_step=2.0**-22)  # B/s = 2^23: 400 members reach 2^31.6 > 2^29
    assert math.isfinite(_epsilon(fine, 1)[0])
    assert math.isinf(_epsilon(dataclasses.replace(fine, sum_clients_per_upload=400), 1)[0])


@pytest.mark.parametrize("members", [1, 3, 8])
def test_the_clamp_bound_of_a_node_sum_bounds_the_exact_skellam_tail(members):
    """log_clamp_bound(M members) >= log of the union bound from scipy's exact Skellam survival function at the
    node's rate M lam and margin 2^29 - M (B/s + 1/2) (its clean sum's reach), here about 5 noise stds."""
    step, sigma, clients, d = 1.0, 1000.0, 10, 3
    sd = math.sqrt(members) * sigma / step
    b = step * ((CLIENT_HALF_RANGE - 5 * sd) / members - 0.5)
    lam = sigma**2 / (2 * step**2)
    margin = CLIENT_HALF_RANGE - members * (b / step + 0.5)
    exact = 2 * clients * d * skellam.sf(math.ceil(margin) - 1, members * lam, members * lam)
    bound = log_clamp_bound(step, sigma, b, clients, d, members)
    assert 1e-9 < exact < 1e-3 and math.log(exact) <= bound < math.log(exact) + 3  # valid, and not loose
    if members == 1:  # one member: the single-client bound
        assert bound == log_clamp_bound(step, sigma, b, clients, d)


def test_the_grid_plan_keeps_node_sums_in_range():
    """With few large nodes the wrap-only step lets a node's sum reach the range one upload carries: the plan
    takes a coarser step, whose clamp bound over the run is at most e^-200; one member per upload: unchanged."""
    args = dict(sigma=1.0, update_bound=1e-9, clients=2**26, dimension=1, rounds=1, wrap_probability=1e-9)
    alone = grid_plan(**args)
    nodes = grid_plan(**args, members_per_upload=2**24)
    assert nodes.step > alone.step
    assert log_clamp_bound(alone.step, 1.0, 1e-9, 2**26, 1, 2**24) > CLAMP_PLAN_LOG_BOUND  # too likely
    assert log_clamp_bound(nodes.step, 1.0, 1e-9, 2**26, 1, 2**24) <= CLAMP_PLAN_LOG_BOUND
    assert nodes.wrap_bound <= 1e-9
    main = dict(sigma=0.711, update_bound=2.0, clients=4000, dimension=26_010, rounds=100, wrap_probability=1e-9)
    assert grid_plan(**main, members_per_upload=400).step == grid_plan(**main).step == 2.0**-16


def test_colluding_nodes_round_up():
    assert [colluding_nodes(c, 400) for c in (0, 1, 400, 401, 800)] == [0, 1, 1, 2, 2]
    assert [colluding_nodes(c, 1) for c in (0, 3)] == [0, 3]


def test_the_round_size_rules_count_nodes():
    assert secure_contributor_problems(4000, 4000, 1, 400) == []  # 10 nodes, 1 colluding
    assert secure_contributor_problems(4000, 2000, 400, 400) == []  # sums on >= 5 nodes, 1 colluding
    assert "min_replies = 1600 on 4" in secure_contributor_problems(4000, 1600, 400, 400)[0]  # 4 nodes, 1 colluding
    assert "needs every sum on at least 6 nodes" in secure_contributor_problems(4000, 2000, 401, 400)[0]
    assert "clients_per_round >= 5" in secure_contributor_problems(4, 4, 1)[0]  # one client per node: unchanged


def test_the_accountant_config_names_the_field():
    with pytest.raises(ValueError, match="sum_clients_per_upload"):
        dataclasses.replace(MAIN, sum_clients_per_upload=0)
    with pytest.raises(ValueError, match="sum_clients_per_upload > 1 needs the integer sum's grid"):
        AccountantConfig(threat_model="secure-aggregation", sum_clients_per_upload=2)
    assert AccountantConfig.from_dict({k: v for k, v in MAIN.to_dict().items()
                                       if k != "sum_clients_per_upload"}).sum_clients_per_upload == 1  # older headers


def test_the_strategy_refuses_a_federation_whose_nodes_sum_other_counts():
    from fl_dp_flower import DPSettings
    from fl_dp_flower.strategies.sampling import check_plan

    settings = DPSettings(sigma=0.711, clip_norm=1.0, local_steps=1, batch_size=1, lr=2.0)
    federation = FederationSettings(clients_per_round=4000, min_replies=4000, clients_per_node=400)
    config = dataclasses.replace(settings.accountant_config(clients=4000, threat_model="secure-aggregation"),
                                 sum_grid_step=2.0**-16, sum_dimension=26_010)
    with pytest.raises(ValueError, match="sum_clients_per_upload 1 is not the federation's clients_per_node 400"):
        check_plan(settings, config, federation)
    check_plan(settings, dataclasses.replace(config, sum_clients_per_upload=400), federation)


def test_the_secagg_grid_is_told_the_coalition_in_nodes():
    """check_grid hands SecAggGrid ceil(c / clients-per-node) colluders: its threshold and floor count nodes."""
    from fl_dp_flower.strategies.sampling import check_grid
    from fl_dp_flower.strategies.secagg import SecAggGrid, clients_in, members_of
    from fl_dp_flower.training.secure_sum import SumGrid

    for colluders, nodes in ((1, 1), (400, 1), (401, 2)):
        config = dataclasses.replace(MAIN, colluders=colluders, sum_clients_per_upload=400)
        grid = SecAggGrid(object(), SumGrid(step=2.0**-16), min_contributors=4000)  # type: ignore[arg-type]
        check_grid(grid, config, 4000)
        assert grid.colluders == nodes and grid.honest_minimum == 4
    assert members_of({"dp.members": [0, 3, 7]}) == 3 and members_of({}) == 1
    assert clients_in([{"dp.members": [0, 1]}, {"dp.members": [5]}, {}]) == 4


def test_members_cross_secaggs_scalar_metrics_and_back():
    """Flower's SecAgg+ carries legacy FitRes metrics (scalars only): a cohort's dp.members travels as a string."""
    from fl_dp_flower.protocol import from_secure_echo, secure_echo

    echo = {"dp.members": [0, 3, 7], "dp.sigma": 0.5, "num-examples": 12}
    wire = secure_echo(echo)
    assert wire["dp.members"] == "int-list:0,3,7" and wire["dp.sigma"] == 0.5
    assert from_secure_echo(wire) == echo
    assert from_secure_echo({"dp.members": "int-list:0,x"}) == {"dp.members": "int-list:0,x"}  # screening rejects it

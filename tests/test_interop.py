"""FlowerGDPAccountant behind Flower's own DP wrappers (flwr's PrivacyAccountant protocol)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from flwr.app import ArrayRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.mod import fixedclipping_mod
from flwr.serverapp import NeighboringRelation, PrivacyConfig, SamplingMethod
from flwr.serverapp.exception import PrivacyBudgetExhausted
from flwr.serverapp.strategy import (DifferentialPrivacyClientSideFixedClipping,
                                     DifferentialPrivacyServerSideFixedClipping, FedAvg)
from flwr.supercore.privacy_accounting import GaussianPrivacyEvent
from scipy.stats import norm

from fl_dp_flower import FlowerGDPAccountant
from fl_dp_flower.testing import LocalGrid, task_identity

NODES = 4


def gdp_delta(mu: float, eps: float) -> float:
    """delta(eps) of mu-GDP (Dong, Roth, Su 2022, Corollary 2.13), straight from scipy."""
    return float(norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * norm.cdf(-eps / mu - mu / 2))


def _client_app(mods=()) -> ClientApp:
    app = ClientApp(mods=list(mods))

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        arrays = msg.content["arrays"].to_numpy_ndarrays()
        rng = np.random.default_rng(context.node_id)
        updated = ArrayRecord([a + rng.normal(size=a.shape).astype(a.dtype) for a in arrays])
        return Message(RecordDict({"arrays": updated, "metrics": MetricRecord({"num-examples": 10})}), reply_to=msg)

    return app


@pytest.mark.parametrize("side", ["client", "server"])
def test_flower_fixed_clipping_wrapper_runs_with_the_gdp_accountant(side):
    z, rounds, delta = 1.5, 3, 1e-5
    accountant = FlowerGDPAccountant(target_delta=delta, population_size=NODES)
    if side == "client":
        wrapper, app = DifferentialPrivacyClientSideFixedClipping, _client_app([fixedclipping_mod])
    else:
        wrapper, app = DifferentialPrivacyServerSideFixedClipping, _client_app()
    strategy = wrapper(FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=NODES),
                       noise_multiplier=z, clipping_norm=1.0, num_sampled_clients=NODES, accountant=accountant)
    grid = LocalGrid(app, NODES)
    with task_identity():
        result = strategy.start(grid=grid, initial_arrays=ArrayRecord([np.zeros(5, dtype=np.float32)]),
                                num_rounds=rounds)
    assert result.arrays is not None
    spent = strategy.privacy_spent()
    assert spent is not None and spent.num_releases == rounds and spent.delta == delta
    mu = math.sqrt(rounds) / z  # exact composition of three (1/z)-GDP releases
    assert accountant.mu == pytest.approx(mu, rel=1e-12)
    assert gdp_delta(mu, spent.epsilon) == pytest.approx(delta, rel=1e-6)


def test_gdp_is_tighter_than_flowers_rdp_conversion():
    """Same releases, same delta: exact GDP never certifies more than the RDP-converted epsilon."""
    from flwr.serverapp import RdpAccountant

    config = PrivacyConfig(target_delta=1e-5, population_size=10,
                           neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                           sampling_method=SamplingMethod.NO_AMPLIFICATION)
    ours, rdp = FlowerGDPAccountant(config), RdpAccountant(config)
    event = GaussianPrivacyEvent(noise_multiplier=2.0, sample_size=10, population_size=10)
    for acct in (ours, rdp):
        acct.compose(event, count=20)
    assert ours.num_releases == rdp.num_releases == 20
    assert ours.get_epsilon(1e-5) < rdp.get_epsilon(1e-5) < 1.3 * ours.get_epsilon(1e-5)


def test_state_round_trip_budget_and_refusals():
    acct = FlowerGDPAccountant(target_delta=1e-5, population_size=10, max_epsilon=5.0)
    e1 = GaussianPrivacyEvent(noise_multiplier=1.0, sample_size=5, population_size=10)
    e2 = GaussianPrivacyEvent(noise_multiplier=4.0, sample_size=5, population_size=10)
    acct.compose(e1)
    acct.compose(e2, count=3)
    assert acct.mu == pytest.approx(math.sqrt(1 + 3 / 16), rel=1e-12)
    again = FlowerGDPAccountant(target_delta=1e-5, population_size=10, max_epsilon=5.0)
    again.load_state_dict(acct.state_dict())
    assert again.num_releases == 4 and again.get_epsilon(1e-5) == pytest.approx(acct.get_epsilon(1e-5), rel=1e-12)
    assert acct.get_delta(acct.get_epsilon(1e-5)) == pytest.approx(1e-5, rel=1e-6)
    # would_exceed checks the epsilon after the event against max_epsilon (4.98 and 19.2), changing nothing
    assert not acct.would_exceed(e2) and acct.would_exceed(e1, count=10) and acct.num_releases == 4
    with pytest.raises(ValueError, match="differs"):
        FlowerGDPAccountant(target_delta=1e-6, population_size=10, max_epsilon=5.0).load_state_dict(acct.state_dict())
    with pytest.raises(ValueError, match="no-amplification"):
        FlowerGDPAccountant(PrivacyConfig(target_delta=1e-5, population_size=10,
                                          neighboring_relation=NeighboringRelation.ADD_OR_REMOVE_ONE,
                                          sampling_method=SamplingMethod.POISSON))
    with pytest.raises(ValueError, match="count"):
        acct.compose(e1, count=0)


def test_wrapper_stops_at_the_budget():
    accountant = FlowerGDPAccountant(target_delta=1e-5, population_size=NODES, max_epsilon=5.0)
    strategy = DifferentialPrivacyServerSideFixedClipping(
        FedAvg(fraction_train=1.0, fraction_evaluate=0.0, min_available_nodes=NODES), noise_multiplier=1.0,
        clipping_norm=1.0, num_sampled_clients=NODES, accountant=accountant)
    with task_identity(), pytest.raises(PrivacyBudgetExhausted):
        strategy.start(grid=LocalGrid(_client_app(), NODES), initial_arrays=ArrayRecord([np.zeros(3, np.float32)]),
                       num_rounds=10)
    # eps(mu = sqrt(T)) at 1e-5: 4.38 at T = 1, 6.4 at T = 2 > 5: round 2 was never composed
    assert accountant.num_releases == 1 and accountant.get_epsilon(1e-5) <= 5.0


def test_population_size_is_required_and_the_relation_is_client_level():
    """Issue 30 item 4: FlowerGDPAccountant() defaulted to population 1, and Flower's wrapper crashed in round 1
    ('sample_size must not exceed population_size') whenever it sampled more than one client."""
    with pytest.raises(ValueError, match="population_size is required"):
        FlowerGDPAccountant()
    assert FlowerGDPAccountant.RELATION.startswith("client-level add/remove-one")
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "FlowerGDPAccountant(population_size=" in readme and "client-level" in readme

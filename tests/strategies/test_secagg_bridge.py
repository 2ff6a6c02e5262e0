"""Secure aggregation on the in-process grid (docs/ARCHITECTURE.md "Secure aggregation"): the real
strategy, Flower's SecAggPlusWorkflow stages and secaggplus_mod, our ClientApp with the integer upload.
The strategy never holds one client's upload, the sum it gets is the exact integer sum of the uploads
(decoded modulo Q), the ledger's round record lists exactly who entered the sum, also when a node dies
during the protocol, and the secure_aggregation bound is the Skellam bound of those who entered."""

from __future__ import annotations

import dataclasses
import logging
import math

import numpy as np
import pytest
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, RecordDict
from flwr.app.message_type import MessageType
from flwr.client.mod import secaggplus_mod
from flwr.clientapp import ClientApp
from flwr.common.secure_aggregation.secaggplus_constants import RECORD_KEY_CONFIGS

from fl_dp_flower.app.clientapp import train as our_train
from fl_dp_flower.secagg_mod import NOT_ON_THE_GRID, secure_upload_mod
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.secure_aggregation import CLAMP_SHARE, SECURE_AGGREGATION_BOUND
from fl_dp_flower.privacy.skellam import CLIENT_HALF_RANGE, ORDERS, SkellamRound, epsilon_from_rdp
from fl_dp_flower.privacy.terms import round_terms
from fl_dp_flower.protocol import SECURE_SUM_RECORD
from fl_dp_flower.reporting import PrivacyLedger
from fl_dp_flower.reporting.ledger import read_ledger
from fl_dp_flower.reporting.rounds import RoundSink
from fl_dp_flower.reporting.verify import verify_ledger
from fl_dp_flower.app.strategy import make_strategy
from fl_dp_flower.strategies.secagg import HONEST_MINIMUM, SecAggGrid
from fl_dp_flower.testing import LocalGrid
from fl_dp_flower.app.testing import tiny_config
from fl_dp_flower.training.models import build_model
from fl_dp_flower.training.secure_sum import SumGrid

STAGES = ("setup", "share_keys", "collect_masked_vectors", "unmask")
GRID = SumGrid(step=2.0**-16)


class _DyingGrid(LocalGrid):
    """A LocalGrid on which node ``nid`` stops answering from protocol stage ``dies[nid]`` on."""

    def __init__(self, *args, dies: dict[int, str], **kw):
        super().__init__(*args, copy_content=True, **kw)
        self._dies = {nid: STAGES.index(stage) for nid, stage in dies.items()}
        self._calls = 0

    def send_and_receive(self, messages, *, timeout=None):
        self.silent = {nid for nid, at in self._dies.items() if self._calls >= at}
        self._calls += 1
        return super().send_and_receive(messages, timeout=timeout)


def _centred(k: np.ndarray) -> np.ndarray:
    return k.astype(np.int64) - CLIENT_HALF_RANGE


def _run(tmp_path, nodes: int, dies: dict[int, str], *, min_contributors: int | None = None,
         threat_model: str = "secure-aggregation", grid: SumGrid = GRID, train=our_train, plain: bool = False,
         step: float | None = None, colluders: int = 1, node_config: dict | None = None,
         accountant_colluders: int | None = None, rounds: int = 1, **extra):
    torch.set_num_threads(1)
    uploads: dict[int, list[np.ndarray]] = {}

    def recording_train(msg, ctx):
        reply = train(msg, ctx)
        if SECURE_SUM_RECORD in reply.content.array_records:
            ints = reply.content[SECURE_SUM_RECORD]
            uploads[ctx.node_id] = [_centred(ints[k].numpy()) for k in ints.keys()]
        return reply

    app = ClientApp(mods=[secaggplus_mod, secure_upload_mod])
    app.train()(recording_train)
    config = tiny_config(tmp_path, **{"clients-per-round": nodes, "num-partitions": nodes, "num-server-rounds": rounds,
                                      "threat-model": threat_model, "colluding-clients": colluders,
                                      "min-replies": min(nodes, colluders + 4), **extra})
    model = build_model(config.dataset)
    initial = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    values = sum(v.size for v in initial.values())
    accountant_config = config.accountant_config()
    if threat_model == "secure-aggregation":
        accountant_config = dataclasses.replace(accountant_config, sum_grid_step=step or GRID.step,
                                                sum_dimension=values,
                                                colluders=accountant_colluders or accountant_config.colluders)
    accountant = PrivacyAccountant(accountant_config)
    ledger = PrivacyLedger.create(tmp_path / "ledger.jsonl", accountant_config=accountant_config.to_dict(),
                                  app_config=config.to_run_config())
    sink = RoundSink(ledger, lambda round_, arrays: None, logging.getLogger("test"))
    strategy = make_strategy(config, accountant, sinks=[sink])
    seen = []
    aggregate = strategy.aggregate_train

    def spy(server_round, replies):
        replies = list(replies)
        seen.extend(replies)
        return aggregate(server_round, replies)

    strategy.aggregate_train = spy
    inner = _DyingGrid(app, nodes, config.to_run_config(), dies=dies, node_config=node_config or {})
    run_grid = inner if plain else SecAggGrid(inner, grid, min_contributors=min_contributors or config.min_replies)
    try:
        strategy.start(grid=run_grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=rounds)
    finally:
        ledger.close()
    return accountant, run_grid, seen, uploads, initial, config


@pytest.mark.parametrize("dies", [{}, {6: "collect_masked_vectors", 5: "unmask"}])
def test_the_strategy_sees_only_the_exact_sum_and_certifies_its_skellam_bound(tmp_path, dies):
    accountant, grid, seen, uploads, initial, config = _run(tmp_path, 6, dies)
    entered = [n for n in range(1, 7) if dies.get(n) != "collect_masked_vectors"]  # masked vector arrived
    assert grid.rounds[0].contributors == entered
    assert sorted(uploads) == entered  # node 5 trained and uploaded, then died before unmasking: in the sum
    record = accountant.records[0]
    line = read_ledger(tmp_path / "ledger.jsonl").rounds[0]
    assert line["record"]["node_ids"] == entered and list(record.node_ids) == entered
    assert verify_ledger(tmp_path / "ledger.jsonl").ok
    # every reply holds the same arrays: w_0 + s * (exact integer sum of the entered uploads) / m, in float32
    assert len(seen) == len(entered)
    for i, (key, w0) in enumerate(initial.items()):
        got = [r.content["arrays"][key].numpy() for r in seen]
        for g in got[1:]:
            np.testing.assert_array_equal(g, got[0])
        exact = sum(uploads[n][i] for n in entered) * GRID.step / len(entered)
        np.testing.assert_array_equal(got[0], (w0.astype(np.float64) + exact).astype(np.float32))
        for n in entered:  # never one client's upload
            assert np.max(np.abs(got[0] - (w0 + uploads[n][i] * GRID.step))) > 0.1
    # the certified bound: the Skellam RDP of the m - c honest clients, computed here from its parts
    report = accountant.report()
    assert report.certified_bound == SECURE_AGGREGATION_BOUND and math.isinf(report.certified.mu)
    terms = round_terms(record, config.smoothness, 1, False)
    d = sum(v.size for v in initial.values())
    curve = SkellamRound(terms.client_sensitivity, config.sigma, len(entered) - 1, GRID.step, d).rdp()
    expected = epsilon_from_rdp(curve, ORDERS, config.delta * (1 - CLAMP_SHARE))[0]  # delta's clamp share aside
    assert report.certified.epsilon == pytest.approx(expected, rel=1e-12)
    assert line["report"]["certified"]["bound"] == SECURE_AGGREGATION_BOUND
    assert any("Skellam" in a for a in report.certified.assumes)
    spent = accountant.get_privacy_spent()
    assert spent.accounting_method == "skellam-rdp" and spent.epsilon == report.certified.epsilon
    assert accountant.get_delta(spent.epsilon) == pytest.approx(config.delta, rel=1e-3)  # the RDP curve inverted


def test_a_sum_of_fewer_than_min_contributors_is_never_unmasked(tmp_path):
    accountant, grid, seen, uploads, _, _ = _run(tmp_path, 6, {6: "collect_masked_vectors"}, min_contributors=6)
    assert len(uploads) == 5 and not grid.rounds[0].completed  # five masked vectors arrived, none unmasked
    assert seen == [] and accountant.num_releases == 0


def test_a_train_handler_that_uploads_a_float_model_is_stopped_on_the_client(tmp_path):
    """A handler ignoring the grid would have its noisy floats rounded by Flower (an unaccounted term): the mod
    answers with an error instead, so no masked vector is sent."""
    model = build_model(tiny_config(tmp_path).dataset)
    msg = Message(RecordDict({"arrays": ArrayRecord(model.state_dict()), RECORD_KEY_CONFIGS: ConfigRecord({})}),
                  dst_node_id=1, message_type=MessageType.TRAIN)
    reply = secure_upload_mod(msg, None, lambda m, c: Message(RecordDict({"arrays": m.content["arrays"]}),
                                                              reply_to=m))
    assert reply.has_error() and reply.error.reason == NOT_ON_THE_GRID


def test_secure_aggregation_on_a_plain_grid_is_refused(tmp_path):
    """On a plain Grid the server would hold every upload and still claim the sum's bound."""
    with pytest.raises(ValueError, match="needs a SecAggGrid"):
        _run(tmp_path, 5, {}, plain=True)


def test_a_grid_step_other_than_the_accountants_is_refused(tmp_path):
    with pytest.raises(ValueError, match="is not the accountant's sum_grid_step"):
        _run(tmp_path, 5, {}, step=2.0**-10)


def test_secure_aggregation_without_the_grid_is_planning_only(tmp_path):
    config = tiny_config(tmp_path, **{"threat-model": "secure-aggregation", "clients-per-round": 5, "min-replies": 5})
    real_valued = dataclasses.replace(config.accountant_config(), sum_grid_step=None, sum_dimension=None)
    with pytest.raises(ValueError, match="without sum_grid_step is for planning only"):
        make_strategy(config, PrivacyAccountant(real_valued), sinks=[])


def test_the_bridge_is_refused_where_the_server_is_the_adversary_of_each_upload(tmp_path):
    """Under curious-server a round whose replies (all the unmasked average) screening drops would leave a
    sum the server saw unaccounted: refused, pointing to the secure-aggregation threat model."""
    with pytest.raises(ValueError, match="refused under threat_model 'curious-server'"):
        _run(tmp_path, 3, {}, threat_model="curious-server")


def test_a_coalition_as_large_as_the_secagg_threshold_is_refused(tmp_path, caplog):
    """With every other client as neighbour and threshold 0.5, SecAgg+ rebuilds masks from 4 of 8 shares: 4
    colluders could unmask one upload (review finding). The run config refuses it; in library use the grid
    runs no such round (nothing is sent beyond the key setup, nothing accounted)."""
    with pytest.raises(ValueError, match="reconstruction threshold above 'colluding-clients'"):
        tiny_config(tmp_path, **{"threat-model": "secure-aggregation", "clients-per-round": 8, "num-partitions": 8,
                                 "colluding-clients": 4, "min-replies": 8})
    caplog.set_level(logging.ERROR, logger="fl_dp_flower.strategies.secagg")
    # min-replies 8: the library's plan check (min_replies - colluders >= 4, issue 30) passes; the grid holds the line
    accountant, grid, seen, uploads, _, _ = _run(tmp_path, 8, {}, colluders=3, accountant_colluders=4,
                                                 **{"min-replies": 8})
    assert not grid.rounds[0].completed and seen == [] and uploads == {} and accountant.num_releases == 0
    assert any("reach SecAgg+'s reconstruction threshold 4" in r.getMessage() for r in caplog.records)


def test_colluders_among_a_bounded_neighbourhood_are_refused():
    """secagg-num-shares 5: each client is masked against 4 neighbours only; 2 colluders could be 2 of them and
    the config asks c <= num_shares - 4 (second review finding)."""
    from fl_dp_flower.app.config import AppConfig

    with pytest.raises(ValueError, match="'colluding-clients' <= 'secagg-num-shares' - 4"):
        AppConfig.from_run_config({"threat-model": "secure-aggregation", "secagg-num-shares": 5,
                                   "colluding-clients": 2, "clients-per-round": 10, "min-replies": 8})


def test_a_sum_with_fewer_than_four_clients_outside_the_coalition_is_never_unmasked(tmp_path):
    """Flower's masks come from 32-bit seeds: with <= 3 honest contributors a server can brute-force one
    client's masks (review finding), so such a sum is not unmasked and nothing is accounted (the run config
    already asks min-replies - colluding-clients >= 4; the grid holds the line for library use too)."""
    accountant, grid, seen, uploads, _, _ = _run(tmp_path, 5, {5: "collect_masked_vectors"})
    assert len(uploads) == 4 and not grid.rounds[0].completed  # 4 contributors, c = 1: 3 honest
    assert seen == [] and accountant.num_releases == 0
    assert grid.honest_minimum == HONEST_MINIMUM == 4


def test_a_sum_with_a_contributor_the_strategy_would_drop_is_never_unmasked(tmp_path, caplog):
    """Two nodes with one partition: the strategy would drop one reply after the fact while its upload sits in
    the sum (review finding: the sample would count twice). The echoes are checked before unmasking instead."""
    caplog.set_level(logging.ERROR, logger="fl_dp_flower.strategies.secagg")
    accountant, grid, seen, _, _, _ = _run(tmp_path, 6, {}, node_config={6: {"partition-id": 0}})
    assert not grid.rounds[0].completed and seen == [] and accountant.num_releases == 0
    assert any("not unmasked: node 6 would be dropped" in r.getMessage() for r in caplog.records)


def test_a_node_the_admission_check_rejects_is_excluded_like_a_refusing_node(tmp_path):
    """Second review finding: a contributor rejected before unmasking must count as a refusal, or it voids
    every round it is sampled in. With max-node-refusals 2 node 6 (echoing a sigma outside the plan) is
    excluded after two void rounds and the third round's sum of nodes 1-5 is unmasked and accounted."""
    def lying_echo(msg, ctx):
        reply = our_train(msg, ctx)
        if ctx.node_id == 6 and not reply.has_error():
            reply.content["metrics"]["dp.sigma"] = 0.5 * float(reply.content["metrics"]["dp.sigma"])
        return reply
    accountant, grid, seen, _, _, _ = _run(tmp_path, 6, {}, train=lying_echo, rounds=3,
                                           **{"max-node-refusals": 2, "min-replies": 5})
    assert [r.completed for r in grid.rounds] == [False, False, True]
    assert grid.rounds[2].contributors == [1, 2, 3, 4, 5] and accountant.num_releases == 1


def test_claimants_of_a_contested_partition_void_one_secure_round_only(tmp_path):
    """Issue 28.7: a duplicated partition id is no refusal (the server cannot tell the liar from its victim);
    both claimants are set aside, so only the round that revealed the contest is not unmasked."""
    accountant, grid, _, _, _, _ = _run(tmp_path, 7, {}, node_config={7: {"partition-id": 0}}, rounds=2,
                                        **{"max-node-refusals": 2})
    assert [r.completed for r in grid.rounds] == [False, True]
    assert grid.rounds[1].contributors == [2, 3, 4, 5, 6] and accountant.num_releases == 1

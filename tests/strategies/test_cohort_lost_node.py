"""Cohort mode, a sampled round, a node lost (review R2; docs/MATH.md §19.1, §22): a node that drops out takes all its
members with it, so given the published counts (k_t drawn, n_t entered) the chance that a client of another node is in
the round is n_t / (N_t - M_lost), above the k_t / N_t the record gave when fewer than the average were drawn on the
lost node. Now the record's population leaves out the lost node's undrawn members. The reference is exact: every
k-subset of the population enumerated, conditioned on the lost node's drawn count."""

from __future__ import annotations

from itertools import combinations

import pytest
import torch
from flwr.app import MessageType

from fl_dp_flower import protocol
from fl_dp_flower.app.clientapp import app as client_app
from fl_dp_flower.app.serverapp import LEDGER, run_server
from fl_dp_flower.app.testing import tiny_config
from fl_dp_flower.reporting.verify import verify_ledger
from fl_dp_flower.testing import TINY_NODES, LocalGrid, task_identity

LOST, CPN = 1, 4


def _inclusion(nodes: int, drawn: int, lost_drawn: int) -> float:
    """P(a given client of another node is drawn | drawn clients of nodes x CPN, lost_drawn of them on the lost
    node), by enumeration of every equally likely draw (client c sits on node c // CPN; the lost node is node 0)."""
    hits = total = 0
    for sample in combinations(range(nodes * CPN), drawn):
        if sum(1 for c in sample if c < CPN) == lost_drawn:
            total += 1
            hits += CPN in sample  # the first client of node 1
    return hits / total


@pytest.mark.parametrize("sampling", [{"sample-secrecy": "secret", "clients-per-round": 6},
                                      {"client-sampling": "poisson", "sampling-rate": 0.5}])
def test_a_lost_node_s_undrawn_members_leave_the_population(tmp_path, sampling):
    torch.set_num_threads(1)
    cfg = tiny_config(tmp_path, **{"clients-per-node": CPN, "num-partitions": TINY_NODES, "num-server-rounds": 3,
                                   "colluding-clients": 0, **sampling})
    grid = LocalGrid(client_app, TINY_NODES, cfg.to_run_config())
    inner, on_lost = grid.send_and_receive, []

    def without_lost_node(messages, *, timeout=None):
        messages = list(messages)
        if any(m.metadata.message_type == MessageType.TRAIN for m in messages):
            on_lost.append(sum(len(m.content["config"][protocol.MEMBERS]) for m in messages
                               if m.metadata.dst_node_id == LOST))
        return [r for r in inner(messages, timeout=timeout) if r.metadata.src_node_id != LOST]

    grid.send_and_receive = without_lost_node
    with task_identity():
        out = run_server(grid, cfg)
    assert verify_ledger(out.run_dir / LEDGER).ok
    under = 0
    for record, d in zip(out.accountant.records, on_lost):
        exact = _inclusion(TINY_NODES, record.sampled, d)
        assert record.population == TINY_NODES * CPN - (CPN - d) if d else TINY_NODES * CPN
        assert exact <= record.sampled / record.population + 1e-12  # the weight p_t bounds the true chance
        under += exact > record.sampled / (TINY_NODES * CPN) + 1e-12  # what the record's N_t gave before
    assert under >= 1  # seed 0 draws 1 of the lost node's 4 members in round 1: 0.625 against k/N = 0.5

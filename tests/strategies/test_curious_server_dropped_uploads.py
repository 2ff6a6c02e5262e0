"""A curious server sees every upload that reaches it, used or not (docs/MATH.md §23.2, §17.1): a reply the
strategy drops after it arrived (a screening rule, a contested partition id) still costs its node's privacy.

Before the fix a round whose every reply was dropped was left unaccounted (two rounds of three honest uploads:
certified epsilon 0.0, the ledger a run of void rounds), and a Poisson-batched round was charged at the largest
rate of the replies *kept*, so an honest site dropped in that round (its higher rate B/n seen by the server) was
charged at another site's lower one. A reply that arrives after round-timeout still reaches the SuperLink (Flower's
train messages live for its default TTL, 12 hours): its round is now charged without amplification (its rate is
unknown), and a round whose every reply was late is charged as planned, where before it was left unaccounted."""

from __future__ import annotations

import pytest
import torch
from flwr.app import Message

from fl_dp_flower.app.clientapp import app as client_app
from fl_dp_flower.app.serverapp import LEDGER, RunFailed
from fl_dp_flower.app.testing import run_local, tiny_config
from fl_dp_flower.reporting.verify import verify_ledger

VICTIM, LIAR, OTHER = 1, 2, 3


def test_a_round_whose_uploads_were_all_dropped_is_charged_under_curious_server(tmp_path):
    """noise-check-alpha 0.9999 drops (almost) every honest reply: the server saw 3 uploads a round all the same."""
    cfg = tiny_config(tmp_path, **{"threat-model": "curious-server", "noise-check-alpha": 0.9999,
                                   "max-node-refusals": 100})
    out, _ = run_local(cfg)
    records = out.accountant.records
    assert [(len(r.weights), r.applied) for r in records] == [(3, False), (3, False)]  # before: no record at all
    planned = out.accountant.config.planned_round(1)
    assert [r.sigma for r in records] == [planned.sigma] * 2
    assert out.accountant.report().certified.epsilon == pytest.approx(2.2884, abs=1e-4)  # before: 0.0


def test_all_rounds_still_leaves_a_round_without_a_usable_reply_unaccounted(tmp_path):
    """The all-rounds adversary sees global models only: nothing of such a round is released (its drop is charged
    to delta, docs/MATH.md §17.1)."""
    cfg = tiny_config(tmp_path, **{"threat-model": "all-rounds", "noise-check-alpha": 0.9999, "max-node-refusals": 100})
    with pytest.raises(RunFailed, match="accounted no round"):
        run_local(cfg)


def test_a_dropped_honest_site_s_batch_rate_is_charged_under_curious_server(tmp_path):
    """A liar echoes the victim's partition id, so the victim's honest reply is dropped (contested); the server
    holds it, so the round is charged at the victim's rate B/n too (Dirichlet partitions: the victim's 0.0070
    against the kept site's 0.0043)."""
    torch.set_num_threads(1)
    rates: dict[int, float] = {}

    def lying(msg: Message, ctx):
        reply = client_app(msg, ctx)
        if not reply.has_error():
            rates[ctx.node_id] = reply.content["metrics"]["dp.batch-rate"]
            if ctx.node_id == LIAR:
                reply.content["metrics"]["dp.partition-id"] = 0  # the victim's
        return reply

    cfg = tiny_config(tmp_path, **{"threat-model": "curious-server", "clipping": "per-sample", "local-steps": 1,
                                   "batch-sampling": "poisson", "batch-size": 8, "batch-rate": 0.5,
                                   "num-server-rounds": 1, "partitioning": "dirichlet", "dirichlet-alpha": 0.5})
    out, _ = run_local(cfg, lying)
    [record] = out.accountant.records
    assert record.node_ids == (OTHER,) and rates[VICTIM] > rates[OTHER]
    assert record.batch_rate == max(rates.values()) >= rates[VICTIM]  # before: rates[OTHER]


def _late(grid, nodes, rounds=(1,)):
    """Replies of ``nodes`` in ``rounds`` arrive after round-timeout: the strategy never sees them (the SuperLink
    still stores them: Flower's train messages live for its default TTL, 12 hours)."""
    inner, calls = grid.send_and_receive, []

    def send_and_receive(messages, *, timeout=None):
        replies = list(inner(messages, timeout=timeout))
        calls.append(1)
        return [r for r in replies if len(calls) not in rounds or r.metadata.src_node_id not in nodes]
    grid.send_and_receive = send_and_receive


def _run_with_late(tmp_path, threat_model, nodes, **overrides):
    from fl_dp_flower.app.serverapp import run_server
    from fl_dp_flower.testing import TINY_NODES, LocalGrid, task_identity

    torch.set_num_threads(1)
    cfg = tiny_config(tmp_path, **{"threat-model": threat_model, "clipping": "per-sample", "local-steps": 1,
                                   "batch-sampling": "poisson", "batch-size": 8, "batch-rate": 0.5, **overrides})
    grid = LocalGrid(client_app, TINY_NODES, cfg.to_run_config())
    _late(grid, nodes)
    with task_identity():
        return run_server(grid, cfg)


def test_a_round_with_a_late_reply_is_charged_without_amplification_under_curious_server(tmp_path):
    out = _run_with_late(tmp_path, "curious-server", {VICTIM})
    first, second = out.accountant.records
    assert first.node_ids == (LIAR, OTHER) and first.batch_rate is None  # before: the two replies' largest rate
    assert second.batch_rate is not None  # every reply arrived: amplified


def test_a_round_whose_replies_were_all_late_is_charged_as_planned_under_curious_server(tmp_path):
    out = _run_with_late(tmp_path, "curious-server", {VICTIM, LIAR, OTHER}, **{"num-server-rounds": 1})
    [record] = out.accountant.records  # before: no record (a void round), certified epsilon 0
    planned = out.accountant.config.planned_round(1, 3, applied=False)
    assert (record.applied, record.batch_rate, record.sigma, record.step_sizes) == (
        False, None, planned.sigma, planned.step_sizes)
    assert out.accountant.report().certified.epsilon > 0
    assert verify_ledger(out.run_dir / LEDGER).ok


def test_all_rounds_is_unchanged_by_late_replies(tmp_path):
    out = _run_with_late(tmp_path, "all-rounds", {VICTIM})
    assert out.accountant.records[0].node_ids == (LIAR, OTHER) and out.accountant.records[0].batch_rate is not None

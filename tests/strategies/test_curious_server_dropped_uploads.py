"""A curious server sees every upload that reaches it, used or not (docs/MATH.md §23.2, §17.1): a reply the
strategy drops after it arrived (a screening rule, a contested partition id) still costs its node's privacy.

Before the fix a round whose every reply was dropped was left unaccounted (two rounds of three honest uploads:
certified epsilon 0.0, the ledger a run of void rounds), and a Poisson-batched round was charged at the largest
rate of the replies *kept*, so an honest site dropped in that round (its higher rate B/n seen by the server) was
charged at another site's lower one."""

from __future__ import annotations

import pytest
import torch
from flwr.app import Message

from fl_dp_flower.app.clientapp import app as client_app
from fl_dp_flower.app.serverapp import RunFailed
from fl_dp_flower.app.testing import run_local, tiny_config

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

"""A curious server holds the dropped uploads (docs/MATH.md §23.2), so their echoed settings are charged as a kept
reply's are (review R2). Before: only their batch rates counted, so a node that echoed a smaller sigma within
``echo-tolerance`` and was dropped (here: a contested partition id) was charged at the kept replies' planned sigma,
below what the server's copy of its upload costs (local DP scales as 1/sigma: 1.5x here). An echo outside the
plan's bounds is no honest node's and is not charged (one node could otherwise inflate the run's epsilon at will)."""

from __future__ import annotations

import pytest
import torch
from flwr.app import Message

from fl_dp_flower.app.clientapp import app as client_app
from fl_dp_flower.app.serverapp import LEDGER
from fl_dp_flower.app.testing import run_local, tiny_config
from fl_dp_flower.reporting.verify import verify_ledger

VICTIM, LIAR, OTHER = 1, 2, 3


def _run(tmp_path, factor: float, threat_model: str = "curious-server"):
    torch.set_num_threads(1)

    def lying(msg: Message, ctx):
        reply = client_app(msg, ctx)
        if not reply.has_error() and ctx.node_id == LIAR:
            metrics = reply.content["metrics"]
            metrics["dp.partition-id"] = 0  # the victim's: both claimants are dropped (contested)
            metrics["dp.sigma"] = metrics["dp.sigma"] / factor  # says it added less noise
        return reply

    cfg = tiny_config(tmp_path, **{"threat-model": threat_model, "echo-tolerance": 2.0, "num-server-rounds": 1})
    out, _ = run_local(cfg, lying)
    [record] = out.accountant.records
    assert verify_ledger(out.run_dir / LEDGER).ok
    return record, out.accountant.config.sigma


def test_a_held_upload_echoing_less_noise_within_the_tolerance_is_charged(tmp_path):
    record, planned = _run(tmp_path, 1.5)
    assert record.node_ids == (OTHER,)  # the victim and the liar were dropped, the server holds both uploads
    assert record.sigma == pytest.approx(planned / 1.5)  # before: planned


def test_a_held_echo_outside_the_plan_is_not_charged(tmp_path):
    record, planned = _run(tmp_path, 10.0)  # the liar's reply is rejected for its echo (held, not charged)
    assert record.node_ids == (VICTIM, OTHER) and record.sigma == pytest.approx(planned)


def test_all_rounds_charges_only_what_it_aggregated(tmp_path):
    record, planned = _run(tmp_path, 1.5, "all-rounds")
    assert record.node_ids == (OTHER,) and record.sigma == pytest.approx(planned)

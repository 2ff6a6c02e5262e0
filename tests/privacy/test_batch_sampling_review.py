"""Review R1 of the ``batch_sampled`` bound (docs/MATH.md §23).

An unfinished round of a Poisson-batched curious-server run (docs/MATH.md §20.5, §23.2): the sites' rates
B/n_i were never recorded, and the planned ``batch_rate`` is no bound on them (a site with fewer samples than
planned echoes a larger rate and is accounted at it), so a resume charges the open round without amplification.

Before the fix the open round was charged at the planned rate: with a site known (round 1's record) to draw at
q = 0.5, the resumed ledger certified epsilon 1.96 where the two rounds at that site's rate cost 2.86; now 4.95
(the open round unamplified)."""

from __future__ import annotations

import dataclasses

import pytest

from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.records import AccountantConfig, RoundRecord
from fl_dp_flower.privacy.sample_sampling import BATCH_SAMPLED_BOUND, unrecorded_round_rate
from fl_dp_flower.reporting import PrivacyLedger
from fl_dp_flower.reporting.resume import resume_ledger

# sigma B / (eta V) = 2: half a noise std per round at the site's own pair (curious server)
PLAN = dict(clipping="per-sample", batch_size=50, batch_rate=0.05, clients=3, sigma=0.04, local_steps=1, lr=1.0,
            clip_norm=1.0, colluders=0)


def _resume_open_round(tmp_path, threat_model: str) -> tuple[AccountantConfig, PrivacyAccountant, RoundRecord]:
    cfg = AccountantConfig(threat_model=threat_model, **PLAN)
    path = tmp_path / "ledger.jsonl"
    ledger = PrivacyLedger.create(path, accountant_config=cfg.to_dict(), app_config={})
    first = dataclasses.replace(cfg.planned_round(1), batch_rate=0.5)  # a site of 100 samples: B/n = 0.5
    ledger.append_event("round-open", {"round": 1, "node_ids": [1, 2, 3], "min_replies": 1})
    ledger.append_round(round=1, record=first.to_dict(), report=PrivacyAccountant(cfg).step(first).to_dict(), metrics={})
    ledger.append_event("round-open", {"round": 2, "node_ids": [1, 2, 3], "min_replies": 1})
    ledger.close()
    resumed, accountant, _ = resume_ledger(path, cfg, checkpoint_round=1, unfinished="account")
    resumed.close()
    return cfg, accountant, first


def test_a_resumed_curious_server_round_is_charged_without_amplification(tmp_path):
    cfg, accountant, first = _resume_open_round(tmp_path, "curious-server")
    assert accountant.records[1].batch_rate is None  # q = 1
    certified = accountant.report().certified.epsilon
    at_site_rate = PrivacyAccountant.from_records(cfg, [first, dataclasses.replace(
        cfg.planned_round(2, applied=False), batch_rate=0.5)]).report().certified.epsilon
    assert at_site_rate == pytest.approx(2.864, abs=1e-3) and certified == pytest.approx(4.952, abs=1e-3)
    assert certified >= at_site_rate  # before the fix: 1.960 (the planned rate), below what the known site costs


def test_all_rounds_keeps_the_planned_rate_for_a_round_that_released_nothing(tmp_path):
    cfg, accountant, _ = _resume_open_round(tmp_path, "all-rounds")
    assert accountant.records[1].batch_rate == cfg.batch_rate == unrecorded_round_rate(cfg)


def test_the_printed_assumption_says_the_batches_must_not_show_in_the_reply_s_timing():
    """The amplification hides which batches took the target; a Poisson batch's realized size sets the node's
    training time, so its reply's timing (and a timeout) would reveal it: the printed assumption says so."""
    cfg = AccountantConfig(threat_model="all-rounds", **PLAN)
    assumes = PrivacyAccountant.from_records(cfg, [cfg.planned_round(1)]).report().bounds[BATCH_SAMPLED_BOUND].assumes
    assert any("timing" in a and "round-timeout" in a and "batches drawn" in a for a in assumes)

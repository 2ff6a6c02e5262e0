"""Issue 34: an accepted echo must meet the preconditions of the bound its round is charged under, for the
node's own echoed values and for the least private combination of plan and echo; a reply whose echo
breaks one is a refusal. Real echo values inside a raised ``echo-tolerance``, one per precondition."""

from __future__ import annotations

import logging

import pytest

from fl_dp_flower.privacy.terms import round_terms
from fl_dp_flower.strategies.replies import Applied, reconcile
from fl_dp_flower.strategies.screening import Rejected, ScreeningRules, check_batch, check_echo
from fl_dp_flower.app.testing import run_local, tiny_config
from test_hostile_nodes import HOSTILE, _altering, _dropped, _echo

PLAN = Applied(sigma=0.5, clip_norm=1.0, local_steps=2, lr=0.1, round_index=0, batch_size=16, prox_alpha=2.0)


def _rules(tolerance: float = 4.0, **kw) -> ScreeningRules:
    return ScreeningRules(planned=PLAN, schedule="constant", fedprox=True, smoothness=1.0, per_sample=False,
                          echo_tolerance=tolerance, **kw)


def _echo_of(**changes) -> Applied:
    fields = {**PLAN.__dict__, **changes}
    return Applied(**fields)


def test_the_issue_s_echo_lr_0_4_with_alpha_4_inside_tolerance_4_is_refused():
    """eta alpha = 1.6 > 1: the node's own FedProx run breaks eta <= 1/alpha. Before the fix the echo passed
    (the check used the smallest alpha, 2, with the largest eta, 0.4: 0.8) and was charged at alpha 2."""
    echo = _echo_of(lr=0.4, prox_alpha=4.0)
    with pytest.raises(Rejected, match=r"echoed FedProx settings break .* 1/prox_alpha = 0.25"):
        check_echo(echo, _rules())
    # what the round would have been charged at: the plan's alpha 2 with eta 0.4, a bound the node's own
    # run (contraction |1 - 0.4 * 4| = 0.6 per step, not 1 - 0.4 * 2 = 0.2) does not obey
    worst, etas = reconcile(PLAN, [echo], "constant", per_sample=False)
    assert worst.prox_alpha == 2.0 and max(etas) == 0.4 and max(etas) * worst.prox_alpha <= 1.0


def test_alpha_at_or_below_l_is_refused_for_the_echo_itself():
    with pytest.raises(Rejected, match="prox_alpha must be > smoothness L"):
        check_echo(_echo_of(prox_alpha=1.0), _rules())  # 1.0 is inside [0.5, 8]


def test_an_echo_meeting_them_is_accepted_and_charged_at_the_least_private_combination():
    """lr 0.4 with alpha 2.2 (own eta alpha 0.88): accepted, charged at alpha 2 (the plan's) and eta 0.4 (0.8 <= 1;
    the combination always meets them when plan and echo each do: max(eta) min(alpha) <= the pair's own product)."""
    echo = _echo_of(lr=0.4, prox_alpha=2.2)
    check_echo(echo, _rules())
    worst, etas = reconcile(PLAN, [echo], "constant", per_sample=False)
    assert worst.prox_alpha == 2.0 and etas == (0.4, 0.4)


def test_local_steps_above_k_times_tolerance_are_refused_and_the_round_charged_at_the_larger_k():
    with pytest.raises(Rejected, match="dp.local-steps = 9 exceeds"):
        check_echo(_echo_of(local_steps=9), _rules())  # at most floor(2 * 4) = 8
    echo = _echo_of(local_steps=8)
    check_echo(echo, _rules())
    worst, etas = reconcile(PLAN, [echo], "constant", per_sample=False)
    assert worst.local_steps == 8 and len(etas) == 8


def test_per_sample_batch_larger_than_the_reply_s_examples_is_refused():
    rules = ScreeningRules(planned=PLAN, schedule="constant", fedprox=False, smoothness=1.0, per_sample=True,
                           echo_tolerance=4.0)
    echo = _echo_of(batch_size=60)  # inside [4, 64]
    check_echo(echo, rules)
    with pytest.raises(Rejected, match="exceeds the reply's num-examples = 40"):
        check_batch(echo, 40, rules)
    check_batch(echo, 60, rules)
    check_batch(echo, 40, _rules())  # per-batch clipping: B may exceed the data (min(B, n) is used)


def test_a_refused_echo_would_have_been_charged_below_its_own_sensitivity():
    """The independent computation behind the refusal: K = 2 steps of FedProx contract the coupled distance by
    |1 - eta alpha| per step; at eta 0.4, alpha 4 the recursion d_{k+1} = 0.6 d_k + 2 eta V gives 2V(0.4 + 0.6*0.4)
    = 1.28 V, while the accountant's term at the charged alpha 2 is 2V(1 - 0.2^2)/2 = 0.96 V."""
    from fl_dp_flower.privacy.records import RoundRecord

    record = RoundRecord(round=1, algorithm="fedprox", step_sizes=(0.4, 0.4), clip_norm=1.0, sigma=0.5,
                         weights=(1.0,), prox_alpha=2.0)
    charged = round_terms(record, 1.0).client_sensitivity
    d = 0.0
    for _ in range(2):
        d = abs(1 - 0.4 * 4.0) * d + 2 * 0.4 * 1.0
    assert charged == pytest.approx(0.96) and d == pytest.approx(1.28) and d > charged


def test_the_issue_s_scenario_end_to_end_is_a_refusal(tmp_path, caplog):
    """FedProx alpha 2, lr 0.1, echo-tolerance 4, one node echoing lr 0.4 and prox-alpha 4: its reply is dropped as
    a refusal and the round is accounted over the other nodes at the plan."""
    caplog.set_level(logging.WARNING)
    cfg = tiny_config(tmp_path, **{"algorithm": "fedprox", "prox-alpha": 2.0, "lr": 0.1, "num-server-rounds": 1,
                                   "echo-tolerance": 4.0})
    out, _ = run_local(cfg, _altering(change_reply=_echo(**{"dp.lr": 0.4, "dp.prox-alpha": 4.0})))
    assert HOSTILE not in out.accountant.records[0].node_ids
    assert out.accountant.records[0].prox_alpha == 2.0 and max(out.accountant.records[0].step_sizes) == 0.1
    assert "echoed FedProx settings break the preconditions" in _dropped(caplog)[0]

"""One hostile or broken node must never crash the run, inflate the model, or be accounted at a
privacy level it did not provide: the real ServerApp (``run_server``) and the real ClientApp on
the in-process grid, with one node's replies altered the way the issue reports found them
(issues 16.6, 16.10e, 18.4, 18.5, 18.6, 18.8; 28.7 a liar claiming an honest site's partition id, 28.9
malformed replies counting towards exclusion, 28.10 a node capped round after round)."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord

from fl_dp_flower.app.clientapp import app as client_app
from fl_dp_flower.app.serverapp import LEDGER, SUMMARY, RunFailed
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.reporting import read_ledger
from fl_dp_flower.reporting.ledger import line_hash
from fl_dp_flower.reporting.verify import verify_ledger
from fl_dp_flower.strategies import sampling
from fl_dp_flower.strategies.screening import residual_threshold
from fl_dp_flower.training.data import DEFAULT_DATA_SEED, load_partition

from fl_dp_flower.testing import TINY_NODES
from fl_dp_flower.app.testing import run_local, tiny_config

NODES = TINY_NODES
HOSTILE = 2
D = 61706  # values LeNet-5 uploads
HONEST = 5 * math.sqrt(2 / D)  # an honest residual energy is chi2_d / d (+ a tiny update term): 1 +- 0.0057 sd


def _honest(energy: float) -> bool:
    return abs(energy - 1.0) <= HONEST


def _altering(change_instruction=None, change_reply=None, node: int = HOSTILE):
    """The real ClientApp, with node ``node``'s instruction and/or reply altered."""
    def wrapped(msg: Message, ctx):
        if ctx.node_id == node and change_instruction is not None:
            config = ConfigRecord(dict(msg.content["config"]))  # the nodes' instructions share one record
            change_instruction(config)
            msg.content["config"] = config
        reply = client_app(msg, ctx)
        if ctx.node_id == node and change_reply is not None and not reply.has_error():
            change_reply(reply)
        return reply
    return wrapped


def _echo(**values):
    def change(reply: Message) -> None:
        for key, value in values.items():
            reply.content["metrics"][key] = value
    return change


def _dropped(caplog, node: int = HOSTILE) -> list[str]:
    return [r.getMessage() for r in caplog.records if f"dropped reply of node {node}:" in r.getMessage()]


def _summary(out) -> dict:
    return json.loads((out.run_dir / SUMMARY).read_text())


# ------------------------------------------------------------------ 16.6 nodes that skip their noise
def test_cohort_node_that_skips_its_noise_but_echoes_sigma_is_rejected(tmp_path, caplog):
    """Node 2 trains with sigma 1e-9 but echoes the planned 0.5: its residual energy is ~0, far below
    the chi2_d threshold; the honest cohorts' energies are 1 within 5 standard deviations of chi2_d / d
    and they are accepted."""
    caplog.set_level(logging.WARNING)
    cfg = tiny_config(tmp_path, **{"clients-per-node": 3, "clients-per-round": 9, "num-server-rounds": 2,
                                   "max-node-refusals": 2})
    skipping = _altering(lambda c: c.__setitem__("dp.sigma", 1e-9), _echo(**{"dp.sigma": 0.5}))
    out, _ = run_local(cfg, skipping)
    nodes = {m // cfg.clients_per_node for r in out.accountant.records for m in r.node_ids}
    assert nodes == {1, 3}  # node 2's members never reach the model or the ledger
    assert [r.clients for r in out.accountant.records] == [6, 6]
    reasons = _dropped(caplog)
    assert len(reasons) == 2 and all("residual energy" in r and "less noise" in r for r in reasons)
    assert _summary(out)["excluded_nodes"].keys() == {"2"}  # two refusals in a row
    energies = [e for _, node, e in out.strategy.residual_energies]
    assert len(energies) == 4 and all(_honest(e) for e in energies), energies
    assert min(energies) > residual_threshold(D, cfg.noise_check_alpha) > 0.96


def test_without_the_noise_check_the_skipping_node_is_accounted_at_its_claim(tmp_path):
    """noise-check-alpha = 0 turns the check off: the old behaviour (the reply is accepted)."""
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 1, "noise-check-alpha": 0.0})
    skipping = _altering(lambda c: c.__setitem__("dp.sigma", 1e-9), _echo(**{"dp.sigma": 0.5}))
    out, _ = run_local(cfg, skipping)
    assert sorted(out.accountant.records[0].node_ids) == [1, 2, 3]
    energy = {node: e for _, node, e in out.strategy.residual_energies}
    assert energy[HOSTILE] < 1e-6 and all(_honest(energy[n]) for n in (1, 3)), energy


# ------------------------------------------------------------------ 18.4 echoes that crashed the server
def test_echoed_tiny_sigma_is_dropped_as_a_refusal_not_a_crash(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 3, "max-node-refusals": 2})
    out, _ = run_local(cfg, _altering(change_reply=_echo(**{"dp.sigma": 1e-12})))
    assert [sorted(r.node_ids) for r in out.accountant.records] == [[1, 3], [1, 3], [1, 3]]
    assert all(r.sigma == 0.5 for r in out.accountant.records)
    assert "echoed dp.sigma = 1e-12 is outside the plan" in _dropped(caplog)[0]
    summary = _summary(out)
    assert summary["excluded_nodes"].keys() == {"2"} and summary["accounted_rounds"] == 3
    assert math.isfinite(summary["final_report"]["certified"]["epsilon"])


def test_accountant_errors_are_caught_per_reply(tmp_path, caplog):
    """Within a (huge) echo-tolerance the echo passes screening; the accountant overflows on it
    (gdp.epsilon: OverflowError) and the reply, not the run, is dropped."""
    caplog.set_level(logging.WARNING)
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 1, "echo-tolerance": 1e13})
    out, _ = run_local(cfg, _altering(change_reply=_echo(**{"dp.sigma": 1e-12})))
    assert sorted(out.accountant.records[0].node_ids) == [1, 3]
    assert "make the accountant fail (OverflowError" in _dropped(caplog)[0]


@pytest.mark.parametrize("echo", [{"dp.lr": 0.6}, {"dp.prox-alpha": 1.0}])
def test_fedprox_echo_breaking_its_preconditions_is_dropped(tmp_path, caplog, echo):
    """alpha = 2 > L = 1, lr = 0.05: an echoed lr above 1/alpha or an alpha <= L made round_terms raise.
    (alpha > L is a precondition only where a bound rests on L: assume-smooth-losses, issue 30.)"""
    caplog.set_level(logging.WARNING)
    for tolerance in (1.0, 100.0):  # outside the plan, and inside a wide tolerance (the FedProx preconditions)
        run = f"t{tolerance:g}"
        cfg = tiny_config(tmp_path, **{"algorithm": "fedprox", "prox-alpha": 2.0, "num-server-rounds": 1,
                                       "echo-tolerance": tolerance, "run-name": run, "assume-smooth-losses": True})
        out, _ = run_local(cfg, _altering(change_reply=_echo(**echo)))
        assert sorted(out.accountant.records[0].node_ids) == [1, 3], tolerance
    reasons = _dropped(caplog)
    assert "is outside the plan" in reasons[0]
    assert "break the preconditions of its bound" in reasons[1]


# ------------------------------------------------------------------ 18.5 unbounded echoes
def test_echoed_local_steps_above_the_plan_are_malformed(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    honest, _ = run_local(tiny_config(tmp_path, **{"run-name": "honest"}), failing={HOSTILE})
    caplog.clear()
    cfg = tiny_config(tmp_path, **{"echo-tolerance": 4.0})  # even a wide tolerance bounds the size
    out, _ = run_local(cfg, _altering(change_reply=_echo(**{"dp.local-steps": 100_000})))
    assert "dp.local-steps = 100000 exceeds the plan's 2 (at most 8" in _dropped(caplog)[0]
    lines = (out.run_dir / LEDGER).read_bytes().splitlines()
    assert max(len(line) for line in lines) < 20_000
    assert all(len(r.step_sizes) == 2 for r in out.accountant.records)
    assert out.accountant.report().certified.epsilon == honest.accountant.report().certified.epsilon


# ------------------------------------------------------------------ 18.6 update magnitude, divergence
def _scale(factor: float):
    def change(reply: Message) -> None:
        arrays = reply.content["arrays"]
        reply.content["arrays"] = ArrayRecord({k: Array(a.numpy() * factor) for k, a in arrays.items()})
    return change


@pytest.mark.parametrize("factor", [1e30, 3.0])
def test_upload_farther_than_clipping_and_noise_allow_is_rejected(tmp_path, caplog, factor):
    caplog.set_level(logging.WARNING)
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 3})
    out, _ = run_local(cfg, _altering(change_reply=_scale(factor)))
    assert [sorted(r.node_ids) for r in out.accountant.records] == [[1, 3]] * 3
    assert all("farther than clipping and noise allow" in r for r in _dropped(caplog))
    summary = _summary(out)
    assert math.isfinite(float(summary["final_loss"])) and summary["failure"] is None
    assert (summary["planned_rounds"], summary["accounted_rounds"]) == (3, 3)


def test_a_non_finite_global_model_fails_the_run_with_a_summary(tmp_path, monkeypatch):
    """Screening keeps every reply finite and bounded; should the aggregate still be non-finite,
    the round stays accounted, the model is not used, and the run fails (never 'completed')."""
    real = sampling.average_arrays
    calls = []

    def overflowing(usable, weights, reference):
        out = real(usable, weights, reference)
        calls.append(1)
        if len(calls) == 2:
            key = next(iter(out.keys()))
            bad = out[key].numpy().copy()
            bad.flat[0] = np.inf
            out = ArrayRecord({k: Array(bad) if k == key else a for k, a in out.items()})
        return out

    monkeypatch.setattr(sampling, "average_arrays", overflowing)
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 4})
    with pytest.raises(RunFailed, match="round 2: the aggregated global model has non-finite values"):
        run_local(cfg)
    summary = json.loads((tmp_path / "run" / SUMMARY).read_text())
    assert (summary["planned_rounds"], summary["accounted_rounds"]) == (4, 2)
    assert "non-finite" in summary["failure"]
    ledger = read_ledger(tmp_path / "run" / LEDGER)
    assert [r["round"] for r in ledger.rounds] == [1, 2] and ledger.open_round is None
    assert [r["record"]["applied"] for r in ledger.rounds] == [True, False]  # out of the final-model bound


# ------------------------------------------------------------------ 18.8 num-examples
def test_implausible_num_examples_are_capped(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 1, "weighting": "examples"})
    out, _ = run_local(cfg, _altering(change_reply=_echo(**{"num-examples": 10**15})))
    record = out.accountant.records[0]
    weights = dict(zip(record.node_ids, record.weights))
    sizes = {n: len(load_partition(cfg.dataset, "", n - 1, NODES, "iid", 0.1, DEFAULT_DATA_SEED,
                                   cfg.test_fraction).y_train) for n in (1, 3)}
    cap = 10 * max(sizes.values())  # 10 x the round's median claim (of n1, n3, 1e15)
    assert weights[HOSTILE] == pytest.approx(cap / (cap + sizes[1] + sizes[3]), rel=1e-12)
    assert any("claims num-examples = 1000000000000000" in r.getMessage() for r in caplog.records)


def test_a_300_digit_num_examples_is_malformed(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 1, "weighting": "examples"})
    out, _ = run_local(cfg, _altering(change_reply=_echo(**{"num-examples": 1e300})))
    assert sorted(out.accountant.records[0].node_ids) == [1, 3]
    assert "exceeds 2**53" in _dropped(caplog)[0]


# ------------------------------------------------------------------ 16.10e duplicate partition ids
def test_two_nodes_with_the_same_partition_id_are_both_set_aside_and_neither_refusing(tmp_path, caplog):
    """Nodes 1 and 3 both hold partition 0 (a misconfiguration, or a liar: the server cannot tell which):
    neither's replies reach the model, neither is blamed or counted as refusing (issue 28.7)."""
    caplog.set_level(logging.WARNING)
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 3, "max-node-refusals": 2})
    out, _ = run_local(cfg, node_config={3: {"partition-id": 0}})
    assert [sorted(r.node_ids) for r in out.accountant.records] == [[2]] * 3
    assert "dp.partition-id = 0 is contested (claimed by nodes 1, 3)" in _dropped(caplog, 3)[0]
    assert "dp.partition-id = 0 is contested (claimed by nodes 1, 3)" in _dropped(caplog, 1)[0]
    assert _summary(out)["excluded_nodes"] == {} and out.strategy.set_aside_nodes.keys() == {1, 3}


def test_planned_and_accounted_rounds_in_the_summary(tmp_path):
    out, _ = run_local(tiny_config(tmp_path))
    summary = _summary(out)
    assert (summary["planned_rounds"], summary["accounted_rounds"]) == (2, 2)
    assert "honest nodes" in summary["node_assumptions"][0] and "5.77 sigma" in summary["node_assumptions"][1]
    replay = PrivacyAccountant.from_records(out.accountant.config, out.accountant.records)
    assert summary["final_report"]["certified"]["epsilon"] == replay.report().certified.epsilon


def test_a_300_digit_count_in_a_ledger_is_not_accepted(tmp_path):
    """A ledger written through the real writer, then its round line's num-examples made 300 digits
    long (and the hash chain repaired): neither the reader nor `verify` accepts it."""
    out, _ = run_local(tiny_config(tmp_path, **{"num-server-rounds": 1}))
    path = out.run_dir / LEDGER
    lines = path.read_bytes().splitlines()
    at = next(i for i, raw in enumerate(lines) if json.loads(raw)["kind"] == "round")
    entry = json.loads(lines[at])
    entry["metrics"]["num-examples"] = 10**299
    lines[at] = json.dumps(entry, separators=(",", ":")).encode()
    for i in range(at + 1, len(lines)):  # re-chain the lines after it
        nxt = json.loads(lines[i])
        nxt["prev"] = line_hash(lines[i - 1])
        lines[i] = json.dumps(nxt, separators=(",", ":")).encode()
    path.write_bytes(b"\n".join(lines) + b"\n")
    with pytest.raises(ValueError, match=f"line {at + 1} is not a valid ledger entry"):
        read_ledger(path)
    result = verify_ledger(path)
    assert not result.ok and result.failure_line == at + 1, result.failure


# ------------------------------------------------------------------ issue 28: 7 eviction, 9 malformed, 10 capped
LIAR, VICTIM = 1, 2  # node 1 answers first on the in-process grid; node 2's node config has partition-id 1


def _asked(grid, node: int) -> int:
    return sum(1 for m in grid.sent if m.metadata.dst_node_id == node)


def _events(out, kind: str) -> list[dict]:
    return [e["data"] for e in read_ledger(out.run_dir / LEDGER).events if e["event"] == kind]


# ------------------------------------------------------------------ 7 a liar claiming an honest site's partition
def test_a_liar_echoing_an_honest_sites_partition_id_does_not_evict_it(tmp_path, caplog):
    """Before: node 1 (first to answer) owned partition 1, node 2's replies were refusals, node 2 was excluded
    at round 2 and the log told the operator to fix node 2's config, while node 1 kept weight 1/3. Now both
    claimants are dropped and set aside (not sampled: none of their replies could be used), neither refusing."""
    caplog.set_level(logging.WARNING)
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 4, "max-node-refusals": 2})
    out, grid = run_local(cfg, _altering(change_reply=_echo(**{"dp.partition-id": 1}), node=LIAR))
    assert [sorted(r.node_ids) for r in out.accountant.records] == [[3]] * 4  # neither claimant is aggregated
    summary = _summary(out)
    assert summary["excluded_nodes"] == {}  # not excluded for refusing, not blamed ...
    assert _asked(grid, VICTIM) == _asked(grid, LIAR) == 1  # ... set aside with the liar after round 1
    assert all(r["consecutive"] == 0 for r in summary["node_refusals"].values())
    assert out.strategy.set_aside_nodes.keys() == {LIAR, VICTIM}
    reasons = _dropped(caplog, VICTIM) + _dropped(caplog, LIAR)
    assert len(reasons) == 2 and all("is contested (claimed by nodes 1, 2)" in r for r in reasons)
    assert not any("(refusal)" in r.getMessage() for r in caplog.records)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "claimed by nodes 1, 2" in errors[0] and "none counts as a refusal" in errors[0]
    assert not any("already node" in r.getMessage() or "fix the node config" in r.getMessage() for r in caplog.records)
    claims = _events(out, "partition-claimed")
    assert sorted((c["partition_id"], c["node_id"], c["round"]) for c in claims) == [(1, 1, 1), (1, 2, 1), (2, 3, 1)]


def test_a_contested_partition_id_stays_contested_after_a_resume(tmp_path, caplog):
    """The claims are ledger events: after a resume in which the victim does not answer, the liar's claim on
    partition 1 is still contested (without them it would be the only claim, and accepted), and both claimants
    stay set aside."""
    caplog.set_level(logging.WARNING)
    lying = _altering(change_reply=_echo(**{"dp.partition-id": 1}), node=LIAR)
    run_local(tiny_config(tmp_path, **{"num-server-rounds": 2}), lying)
    caplog.clear()
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 4, "resume": True})
    out, grid = run_local(cfg, lying, silent={VICTIM})
    assert [sorted(r.node_ids) for r in out.accountant.records] == [[3]] * 4
    assert _asked(grid, LIAR) == _asked(grid, VICTIM) == 0
    assert any("resume: dp.partition-id = 1 stays contested (claimed by nodes 1, 2)" in r.getMessage()
               for r in caplog.records)
    assert _summary(out)["excluded_nodes"] == {}


def test_a_node_that_changes_its_partition_id_is_refused(tmp_path, caplog):
    """A node's partition does not change within a run: a liar can contest one id only."""
    caplog.set_level(logging.WARNING)
    calls = []

    def later_another_id(reply: Message) -> None:
        calls.append(1)
        if len(calls) > 1:
            reply.content["metrics"]["dp.partition-id"] = 7
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 4, "max-node-refusals": 2})
    out, _ = run_local(cfg, _altering(change_reply=later_another_id, node=VICTIM))
    assert [sorted(r.node_ids) for r in out.accountant.records] == [[1, 2, 3], [1, 3], [1, 3], [1, 3]]
    assert "dp.partition-id = 7 differs from the dp.partition-id = 1 it echoed first" in _dropped(caplog, VICTIM)[0]
    assert _summary(out)["excluded_nodes"].keys() == {str(VICTIM)}


# ------------------------------------------------------------------ 9 malformed replies count towards exclusion
def _without_metrics(reply: Message) -> None:
    del reply.content["metrics"]


def _extra_record(reply: Message) -> None:
    reply.content["more"] = MetricRecord({"x": 1})


def _renamed_arrays(reply: Message) -> None:
    arrays = reply.content["arrays"]
    reply.content["arrays"] = ArrayRecord({f"x.{k}": a for k, a in arrays.items()})


def _nan_arrays(reply: Message) -> None:
    arrays = reply.content["arrays"]
    reply.content["arrays"] = ArrayRecord({k: Array(np.full(a.shape, np.nan, a.numpy().dtype))
                                           for k, a in arrays.items()})


def _without_num_examples(reply: Message) -> None:
    del reply.content["metrics"]["num-examples"]


@pytest.mark.parametrize("change, reason", [
    (_without_metrics, "expected exactly one MetricRecord"),
    (_extra_record, "expected exactly one MetricRecord"),
    (_renamed_arrays, "array keys/shapes/dtypes differ"),
    (_nan_arrays, "arrays contain non-finite values"),
    (_without_num_examples, "metrics lack 'num-examples'"),
    (_echo(**{"num-examples": 2.0**60}), "exceeds 2**53"),
    (_echo(**{"dp.sigma": float("inf")}), "dp.sigma = inf is not a finite number"),
])
def test_a_node_sending_malformed_replies_is_excluded(tmp_path, caplog, change, reason):
    """Before: these drops never counted, so a node sending only garbage was sampled and dropped every round."""
    caplog.set_level(logging.WARNING)
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 3, "max-node-refusals": 2})
    out, grid = run_local(cfg, _altering(change_reply=change))
    assert [sorted(r.node_ids) for r in out.accountant.records] == [[1, 3]] * 3
    assert reason in _dropped(caplog)[0]
    assert _summary(out)["excluded_nodes"].keys() == {"2"} and _asked(grid, 2) == 2  # not asked in round 3


def test_error_replies_of_a_node_count_those_the_superlink_makes_do_not(tmp_path):
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 3, "max-node-refusals": 2, "run-name": "failing"})
    failing, grid = run_local(cfg, failing={2})  # the node's own Error reply (its ClientApp failed)
    assert _summary(failing)["excluded_nodes"].keys() == {"2"} and _asked(grid, 2) == 2
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 3, "max-node-refusals": 2, "run-name": "gone"})
    gone, grid = run_local(cfg, unavailable={2})  # the SuperLink answers for a node that went away
    assert _summary(gone)["excluded_nodes"] == {} and _asked(grid, 2) == 3


# ------------------------------------------------------------------ 10 a node capped round after round
def test_a_node_capped_round_after_round_is_flagged(tmp_path, caplog):
    """Before: a WARNING per round and nothing else (the node held most of every round's model, unflagged)."""
    caplog.set_level(logging.WARNING)
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 3, "weighting": "examples", "max-node-refusals": 2})
    out, grid = run_local(cfg, _altering(change_reply=_echo(**{"num-examples": 10**15})))
    assert [sorted(r.node_ids) for r in out.accountant.records] == [[1, 2, 3]] * 3  # flagged, not excluded
    assert _asked(grid, 2) == 3
    rounds = read_ledger(out.run_dir / LEDGER).rounds
    assert [r["metrics"]["dp-capped"] for r in rounds] == [1, 1, 1]
    [event] = _events(out, "node-capped")
    assert (event["node_id"], event["round"], event["consecutive"], event["claimed"]) == (2, 2, 2, 10**15)
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "node 2 claimed num-examples = 1000000000000000" in errors[0]
    state = _summary(out)["node_refusals"]["2"]
    assert (state["capped"], state["capped_total"], state["flagged_at_round"]) == (3, 3, 2)
    assert _summary(out)["excluded_nodes"] == {}


def test_an_honest_count_resets_the_capped_streak(tmp_path):
    calls = []

    def every_other(reply: Message) -> None:
        calls.append(1)
        if len(calls) % 2:
            reply.content["metrics"]["num-examples"] = 10**15
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 3, "weighting": "examples", "max-node-refusals": 2})
    out, _ = run_local(cfg, _altering(change_reply=every_other))
    assert [r["metrics"]["dp-capped"] for r in read_ledger(out.run_dir / LEDGER).rounds] == [1, 0, 1]
    assert _events(out, "node-capped") == []


def test_a_resume_keeps_contested_partition_ids_but_not_single_claims():
    """Node ids need not survive a restart (Flower's simulation gives every run new ones): a restored single
    claim would make the same site, under its new id, contest its own partition, and a resumed simulation
    accounted nothing. Contested ids stay contested; a new node claiming a singly-claimed id is its claimant."""
    from types import SimpleNamespace

    from fl_dp_flower.reporting.ledger.events import PARTITION_CLAIMED_EVENT
    from fl_dp_flower.strategies.guard import ReplyGuard

    def claim(node, partition, round_):
        return {"event": PARTITION_CLAIMED_EVENT, "data": {"node_id": node, "partition_id": partition, "round": round_}}

    guard = ReplyGuard(accountant=None, log=logging.getLogger("test"))  # type: ignore[arg-type]
    guard.restore([claim(11, 0, 1), claim(12, 1, 1), claim(13, 1, 2)])  # partition 1 was contested before the crash
    assert guard.contested == {1: (12, 13)}
    dropped: list = []
    reply = SimpleNamespace  # the fields check_partitions reads
    kept = guard.check_partitions([reply(node_id=21, partition_id=0), reply(node_id=22, partition_id=1)], dropped, 3)
    assert [u.node_id for u in kept] == [21]  # partition 0's site under its new id trains on
    assert [(n, refusal) for n, _, refusal in dropped] == [(22, False)] and guard.contested[1] == (12, 13, 22)

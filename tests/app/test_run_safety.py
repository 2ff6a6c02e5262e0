"""The ServerApp never under-counts privacy or hides a failure (real ``run_server`` on the
in-process :class:`LocalGrid`, real ClientApp):

- ``resume = true`` without a ledger fails, naming the path (no fresh run, nothing created);
- a round that was broadcast but whose round line is torn or missing is refused on resume,
  naming the real cause and writing nothing, or accounted conservatively when the operator
  says so (``resume-unfinished-round = 'account'``);
- a node that refuses every round stops being sampled, and the run fails when too few remain;
- a SuperLink-made error reply is logged under the node it was meant for;
- every output is owner-only; the metrics endpoint can require TLS and basic auth.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import logging
import math
import ssl
import stat
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import torch

from deploy_harness import generate_certs
from fl_dp_flower.app.serverapp import CHECKPOINT, LEDGER, SUMMARY, RunFailed
from fl_dp_flower.app.config import AppConfig
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.reporting import PrivacyLedger, PrivacyMetricsExporter, read_ledger
from fl_dp_flower.testing import TINY_NODES
from fl_dp_flower.app.testing import run_local, tiny_config

NODES = TINY_NODES


def _config(tmp_path, **overrides) -> AppConfig:
    return tiny_config(tmp_path, **{"num-server-rounds": 4, **overrides})


def _run(config: AppConfig, app=None, **grid_kw):
    return run_local(config, app, **grid_kw)


class Crash(BaseException):
    """Stands for the process dying (not an Exception: nothing may catch and handle it)."""


def _crash_while_writing_round(monkeypatch, round_: int, *, fraction: float) -> None:
    """Make the ledger die while appending round ``round_``'s line, after writing ``fraction`` of it."""
    real_write = PrivacyLedger._write_locked

    def write(self, line: bytes) -> None:
        if line.startswith(b'{"kind":"round"') and f'"round":{round_},'.encode() in line:
            if fraction > 0:
                real_write(self, line[: int(len(line) * fraction)])
            raise Crash(f"killed while appending round {round_}")
        real_write(self, line)

    monkeypatch.setattr(PrivacyLedger, "_write_locked", write)


# ------------------------------------------------------------------ 2. resume without a ledger
def test_resume_without_ledger_fails_naming_the_path(tmp_path):
    cfg = _config(tmp_path, **{"run-name": "typo", "resume": True})
    with pytest.raises(RunFailed) as info:
        _run(cfg)
    assert str(tmp_path / "typo" / LEDGER) in str(info.value) and "run-name" in str(info.value)
    assert not (tmp_path / "typo").exists()  # no fresh run, not even its folder


# ------------------------------------------------------------------ 3./4. unfinished rounds
def _crashed_run(tmp_path, monkeypatch, *, fraction: float):
    with monkeypatch.context() as m:
        _crash_while_writing_round(m, 3, fraction=fraction)
        with pytest.raises(Crash):
            _run(_config(tmp_path))
    return tmp_path / "run" / LEDGER


@pytest.mark.parametrize("fraction", [0.5, 0.0], ids=["torn-line", "no-line"])
def test_unfinished_round_is_refused_by_default_and_nothing_is_written(tmp_path, monkeypatch, fraction):
    """Case 3: round 3's uploads arrived, its line is torn (or never written), the checkpoint is
    from round 2. Resuming must not account one round fewer."""
    ledger = _crashed_run(tmp_path, monkeypatch, fraction=fraction)
    assert torch.load(tmp_path / "run" / CHECKPOINT, weights_only=True)["round"] == 2
    contents = read_ledger(ledger)
    assert contents.last_round == 2 and contents.open_round == 3 and contents.torn_tail == (fraction > 0)
    before = ledger.read_bytes()
    with pytest.raises(RunFailed) as info:
        _run(_config(tmp_path, resume=True))
    msg = str(info.value)
    line = contents.line_count if fraction > 0 else contents.open_round_line
    assert "round 3 was broadcast but" in msg and f"line {line}" in msg
    assert ("torn" in msg) == (fraction > 0)
    assert "resume-unfinished-round = 'account'" in msg and "saved model is from round 2" in msg
    assert ledger.read_bytes() == before  # a refused resume writes nothing


def _three_rounds_with_round_3_torn(tmp_path) -> tuple[Path, bytes, int]:
    """A finished 3-round run whose last round line is then cut to a third: (ledger, bytes, line index)."""
    _run(_config(tmp_path, **{"num-server-rounds": 3}))
    ledger = tmp_path / "run" / LEDGER
    lines = ledger.read_bytes().split(b"\n")
    idx = max(i for i, line in enumerate(lines) if line.startswith(b'{"kind":"round"'))
    torn = b"\n".join(lines[:idx]) + b"\n" + lines[idx][: len(lines[idx]) // 3]
    ledger.write_bytes(torn)
    return ledger, torn, idx


def test_torn_line_with_up_to_date_checkpoint_names_the_torn_line(tmp_path):
    """Case 4: the checkpoint is from round 3 and round 3's line is cut. The refusal names the torn
    line, not the checkpoint, and writes nothing."""
    ledger, torn, idx = _three_rounds_with_round_3_torn(tmp_path)
    with pytest.raises(RunFailed) as info:
        _run(_config(tmp_path, **{"num-server-rounds": 4, "resume": True}))
    msg = str(info.value)
    assert f"round 3 was broadcast but its round line is torn (line {idx + 1}" in msg
    assert "saved model is from round 3" in msg and "ahead" not in msg
    assert ledger.read_bytes() == torn


def test_an_open_round_already_in_the_checkpoint_is_not_charged_as_not_applied(tmp_path):
    """Review of issue 16: the checkpoint is from round 3 and round 3's line is cut. Its aggregate is in
    the model, so charging it as not applied would leave it out of the final-model bound (which is
    not conservative): the 'account' resume is refused, naming the cause, and writes nothing."""
    ledger, torn, idx = _three_rounds_with_round_3_torn(tmp_path)
    with pytest.raises(RunFailed, match="holds open round 3's aggregate"):
        _run(_config(tmp_path, **{"num-server-rounds": 4, "resume": True, "resume-unfinished-round": "account"}))
    assert ledger.read_bytes() == torn


def test_unfinished_round_charged_as_planned_and_not_applied_on_request(tmp_path, monkeypatch, caplog):
    """Issue 16 item 9: the open round is charged as the planned round (its uploads may have reached
    the server; its aggregate reached no one), not as one client at weight 1, and is not applied."""
    ledger = _crashed_run(tmp_path, monkeypatch, fraction=0.5)
    caplog.set_level(logging.WARNING)
    out, grid = _run(_config(tmp_path, **{"resume": True, "resume-unfinished-round": "account"}))
    contents = read_ledger(ledger)
    assert [r["round"] for r in contents.rounds] == [1, 2, 3, 4]
    assert [r.clients for r in out.accountant.records] == [NODES] * 4
    assert [r.applied for r in out.accountant.records] == [True, True, False, True]
    assert contents.rounds[2]["record"]["applied"] is False
    assert contents.rounds[2]["metrics"] == {"dp-unfinished-accounted": 1}
    events = [e["event"] for e in contents.events]
    # the resume event comes first (verify accepts nothing else after a finished run's end; issue 30)
    assert events.index("torn-tail") < events.index("resume") < events.index("unfinished-round-accounted")
    # composition and local DP: never fewer rounds, exactly the planned round's charge
    cfg = _config(tmp_path)
    ran = PrivacyAccountant(cfg.accountant_config())
    for t in range(1, 5):
        ran.step(cfg.accountant_config().planned_round(t))
    for name in ("composition", "local_dp"):
        assert out.accountant.report().bounds[name].mu == ran.report().bounds[name].mu
    assert any(r.levelno == logging.WARNING and "round 3 had no complete ledger line" in r.getMessage()
               for r in caplog.records)
    assert [c["dp.round-index"] for c in (dict(m.content["config"]) for m in grid.sent)] == [3] * NODES


# ------------------------------------------------------------------ 6. refusing nodes
def test_node_refusing_every_round_is_excluded_and_reported(tmp_path, caplog):
    caplog.set_level(logging.ERROR)
    cfg = _config(tmp_path, **{"max-node-refusals": 2})
    out, grid = _run(cfg, node_config={2: {"min-sigma": 5.0}})
    sampled = [sorted(m.metadata.dst_node_id for m in grid.sent[i:i + NODES]) for i in (0, NODES)]
    assert sampled == [[1, 2, 3]] * 2
    assert sorted(m.metadata.dst_node_id for m in grid.sent[2 * NODES:]) == [1, 1, 3, 3]  # rounds 3, 4
    assert [sorted(r.node_ids) for r in out.accountant.records] == [[1, 3]] * 4
    summary = json.loads((out.run_dir / SUMMARY).read_text())
    assert list(summary["excluded_nodes"]) == ["2"] and "min-sigma" in summary["excluded_nodes"]["2"]
    assert summary["node_refusals"]["2"]["total"] == 2 and summary["node_refusals"]["2"]["excluded_at_round"] == 2
    excluded = [e["data"] for e in read_ledger(out.run_dir / LEDGER).events if e["event"] == "node-excluded"]
    assert [(e["node_id"], e["round"]) for e in excluded] == [(2, 2)]
    assert any("node 2 refused 2 rounds in a row" in r.getMessage() for r in caplog.records)


def test_run_fails_when_too_few_nodes_are_left(tmp_path):
    cfg = _config(tmp_path, **{"max-node-refusals": 1, "min-replies": 3})
    with pytest.raises(RunFailed, match=r"only 2 eligible node\(s\) left, fewer than min-replies = 3.*node 2"):
        _run(cfg, node_config={2: {"allow-fixed-seed": False}})
    summary = json.loads((tmp_path / "run" / SUMMARY).read_text())
    assert "dp.seed=0" in summary["excluded_nodes"]["2"] and summary["failure"]


# ------------------------------------------------------------------ 7. node ids of error replies
def test_superlink_error_reply_names_the_real_node(tmp_path, caplog):
    caplog.set_level(logging.WARNING)
    cfg = _config(tmp_path, **{"num-server-rounds": 1})
    out, _ = _run(cfg, first_node_id=5000, unavailable={5001})
    dropped = [r.getMessage() for r in caplog.records if "dropped reply" in r.getMessage()]
    assert dropped == ["round 1: dropped reply of node 5001: error reply (code 5): Error: Node Unavailable"]
    assert sorted(out.accountant.records[0].node_ids) == [5000, 5002]


# ------------------------------------------------------------------ 8. exposure
def test_outputs_are_owner_only(tmp_path):
    out, _ = _run(_config(tmp_path, **{"num-server-rounds": 1}))
    assert stat.S_IMODE(out.run_dir.stat().st_mode) == 0o700
    files = sorted(p.name for p in out.run_dir.iterdir())
    assert files == ["final_model.pt", "ledger.jsonl", "model-latest.pt", "privacy.png", "summary.json"]
    for p in out.run_dir.iterdir():
        assert stat.S_IMODE(p.stat().st_mode) == 0o600, p.name


def test_metrics_endpoint_with_tls_and_basic_auth(tmp_path):
    certs = generate_certs(tmp_path / "certs", supernodes=1)
    auth = tmp_path / "metrics-auth"
    auth.write_text("prometheus:s3cret\n")
    auth.chmod(0o644)
    with pytest.raises(PermissionError, match="chmod 600"):
        PrivacyMetricsExporter(0, certfile=str(certs / "superlink" / "server.pem"),
                               keyfile=str(certs / "superlink" / "server.key"), auth_file=str(auth))
    auth.chmod(0o600)
    ctx = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    with PrivacyMetricsExporter(0, certfile=str(certs / "superlink" / "server.pem"),
                                keyfile=str(certs / "superlink" / "server.key"), auth_file=str(auth)) as exp:
        url = f"https://127.0.0.1:{exp.port}/metrics"

        def get(user_password: str | None):
            req = urllib.request.Request(url)
            if user_password:
                req.add_header("Authorization", "Basic " + base64.b64encode(user_password.encode()).decode())
            with urllib.request.urlopen(req, context=ctx, timeout=10) as r:
                return r.status, r.read().decode()

        for creds in (None, "prometheus:wrong", "other:s3cret"):
            with pytest.raises(urllib.error.HTTPError) as info:
                get(creds)
            assert info.value.code == 401
        status, body = get("prometheus:s3cret")
        assert status == 200 and "fl_dp_certified_epsilon" in body
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # no plain HTTP
            urllib.request.urlopen(f"http://127.0.0.1:{exp.port}/metrics", timeout=10)
        assert get("prometheus:s3cret")[0] == 200  # and the endpoint still serves afterwards


# ------------------------------------------------------------------ applied rounds and the write-ahead invariant
def _final_model_overrides() -> dict:
    """Run-config keys of a final-model run (with the L-smoothness assertion where it exists)."""
    extra = {"assume-smooth-losses": True} if "assume_smooth_losses" in AppConfig.model_fields else {}
    return {"threat-model": "final-model", "colluding-clients": 0, **extra}  # final-model: no colluder


@pytest.mark.parametrize("fraction_evaluate", [0.0, 1.0], ids=["no-client-eval", "client-eval"])
def test_a_rounds_line_is_durable_before_its_aggregate_is_saved_or_broadcast(tmp_path, monkeypatch,
                                                                            fraction_evaluate):
    """Issue 16 item 9: the invariant the unfinished-round charge rests on. Every message that
    carries a round's aggregate (the next round's train instructions, client evaluation) and every
    checkpoint of it is sent or written only once that round's ledger line is on disk."""
    import fl_dp_flower.app.serverapp as server
    from fl_dp_flower.app.clientapp import app as client_app
    from fl_dp_flower.strategies.noisy import NoisyStrategyMixin
    from fl_dp_flower.testing import LocalGrid, task_identity

    cfg = _config(tmp_path, **{"num-server-rounds": 3})
    path = tmp_path / "run" / LEDGER
    aggregate_round: dict[int, int] = {}  # id(aggregate ArrayRecord) -> its round
    checks = {"broadcast": 0, "checkpoint": 0}
    from fl_dp_flower.checkpoint import ModelCheckpoint

    real_aggregate, real_save = NoisyStrategyMixin.aggregate_train, ModelCheckpoint.save

    def aggregate_train(self, server_round, replies):
        arrays, metrics = real_aggregate(self, server_round, replies)
        if arrays is not None:
            aggregate_round[id(arrays)] = self.accountant.records[-1].round
        return arrays, metrics

    def save(self, round_, arrays):
        assert self.path.name == CHECKPOINT
        assert read_ledger(path).last_round >= round_, "checkpoint before its round line"
        checks["checkpoint"] += 1
        real_save(self, round_, arrays)

    class Spy(LocalGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            for msg in messages:
                round_ = aggregate_round.get(id(msg.content.array_records.get("arrays")))
                if round_ is not None:
                    assert read_ledger(path).last_round >= round_, \
                        f"round {round_}'s aggregate broadcast before its round line"
                    checks["broadcast"] += 1
            return super().send_and_receive(messages, timeout=timeout)

    monkeypatch.setattr(NoisyStrategyMixin, "aggregate_train", aggregate_train)
    monkeypatch.setattr(ModelCheckpoint, "save", save)
    grid = Spy(client_app, NODES, cfg.to_run_config())
    with task_identity():
        server.run_server(grid, cfg, fraction_evaluate=fraction_evaluate)
    assert checks["checkpoint"] == 3
    assert checks["broadcast"] == NODES * (2 + (3 if fraction_evaluate else 0))  # rounds 2, 3 (+ evaluations)


@pytest.mark.parametrize("crash_round", [1, 3])
def test_round_line_without_checkpoint_resumes_and_leaves_the_final_model_bound(tmp_path, monkeypatch, crash_round):
    """Issue 18 item 7 (crash_round 1: no checkpoint at all, resume from the initial model) and
    issue 16 item 1 (the lost round is charged to composition but is not in the released model)."""
    from fl_dp_flower.reporting.verify import verify_ledger

    from fl_dp_flower.checkpoint import ModelCheckpoint

    real_save = ModelCheckpoint.save

    def save(self, saved_round, arrays):
        if self.path.name == CHECKPOINT and saved_round == crash_round:
            raise Crash(f"killed after round {crash_round}'s line, before its checkpoint")
        real_save(self, saved_round, arrays)

    overrides = _final_model_overrides()
    with monkeypatch.context() as m:
        m.setattr(ModelCheckpoint, "save", save)
        with pytest.raises(Crash):
            _run(_config(tmp_path, **overrides))
    ledger = tmp_path / "run" / LEDGER
    assert read_ledger(ledger).last_round == crash_round
    assert (tmp_path / "run" / CHECKPOINT).exists() == (crash_round > 1)
    out, _ = _run(_config(tmp_path, resume=True, **overrides))
    contents = read_ledger(ledger)
    marks = [e["data"] for e in contents.events if e["event"] == "rounds-not-applied"]
    assert [d["rounds"] for d in marks] == [[crash_round]] and marks[0]["checkpoint_round"] == crash_round - 1
    assert [r.applied for r in out.accountant.records] == [r != crash_round for r in range(1, 5)]
    acct_cfg = out.accountant.config
    applied_only = PrivacyAccountant.from_records(acct_cfg, [  # the released model's rounds, renumbered
        dataclasses.replace(r, round=i + 1) for i, r in enumerate(r for r in out.accountant.records if r.applied)])
    everything = PrivacyAccountant.from_records(acct_cfg, [dataclasses.replace(r, applied=True)
                                                           for r in out.accountant.records])
    report = out.accountant.report()
    assert report.bounds["final_model"].mu == pytest.approx(applied_only.report().bounds["final_model"].mu, rel=1e-12)
    assert report.bounds["composition"].mu == everything.report().bounds["composition"].mu
    result = verify_ledger(ledger)
    assert result.ok, result.failure
    assert result.rounds_verified == 4


def test_under_quorum_rounds_do_not_lower_the_certified_final_model_epsilon(tmp_path):
    """Issue 16 item 1 end to end: 3 nodes, min-replies 3, stage-wise, final-model; node 3 is
    silent from round 3, so the model is frozen after round 2. The old rule let the certified
    epsilon fall (0.914 -> 0.717 at round 30); it must never fall below the 2-round release's."""
    from fl_dp_flower.app.clientapp import app as client_app
    from fl_dp_flower.privacy import gdp
    from fl_dp_flower.privacy.terms import round_terms
    from fl_dp_flower.testing import LocalGrid, task_identity

    class SilentFromRound3(LocalGrid):
        def send_and_receive(self, messages, *, timeout=None):
            messages = list(messages)
            if any(dict(m.content.config_records.get("config", {})).get("dp.round-index", 0) >= 2 for m in messages):
                self.silent = {3}
            return super().send_and_receive(messages, timeout=timeout)

    cfg = _config(tmp_path, **{"num-server-rounds": 8, "min-replies": 3, "schedule": "stage",
                               **_final_model_overrides()})
    from fl_dp_flower.app.serverapp import run_server

    grid = SilentFromRound3(client_app, NODES, cfg.to_run_config())
    with task_identity():
        out = run_server(grid, cfg)
    rounds = read_ledger(tmp_path / "run" / LEDGER).rounds
    assert [r["metrics"]["dp-aggregated"] for r in rounds] == [1, 1] + [0] * 6
    certified = [r["report"]["certified"]["epsilon"] for r in rounds]
    assert min(certified[2:]) >= certified[1] * (1 - 1e-12)
    # the exact epsilon of the released 2-round model on the linear canary (docs/MATH.md §7.3):
    # w_T - w'_T ~ N(sum gamma_t, sum s_t^2), gamma_t = Gamma_t/m, s_t the noise the colluding
    # participant(s) cannot subtract (sigma*sqrt(m - c)/m)
    c, m = out.accountant.config.colluders, NODES
    first_two = out.accountant.records[:2]
    gammas = [round_terms(r, 0.0).client_sensitivity / m for r in first_two]
    stds = [r.sigma * math.sqrt(m - c) / m for r in first_two]
    exact = gdp.epsilon(math.fsum(gammas) / math.sqrt(math.fsum(s * s for s in stds)), cfg.delta)
    assert certified[-1] >= exact

"""End to end on Flower's deployment engine: real ``flower-superlink`` / ``flower-supernode``
processes on loopback with TLS and SuperNode authentication, the app submitted with
``flwr run <app dir> <connection>`` (see tests/deploy_harness.py and docs/deployment.md).

a. 2 registered SuperNodes, 2 rounds: Prometheus endpoint scraped during the run, ledger (2 round
   lines, 2 clients each), ``flwr ls`` status; a third SuperNode with an unregistered key is refused.
b. One SuperNode SIGKILLed while round 2's ClientApp is in flight: round 2 is closed by
   ``round-timeout`` and accounted with the one client that replied (``min-replies=1``).
c. The ServerApp SIGKILLed after round 1; resubmitted with ``resume=true`` and the same
   run-name/output-dir: the ledger's per-round certified mu and the rebuilt accountant equal an
   accountant that stepped through the planned rounds without a crash.

Slow (each ~1-2 min on 2 busy cores: every ClientApp message spawns a fresh process importing torch).
"""

from __future__ import annotations

import json
import math
import threading
import time
import tomllib
from pathlib import Path

import pytest

from deploy_harness import ROOT, Federation, free_port, kill_tree, pids_with_marker, scrape, wait_until
from fl_dp_flower.config import AppConfig
from fl_dp_flower.privacy import PrivacyAccountant
from fl_dp_flower.reporting import load_round_records, read_ledger

pytestmark = [pytest.mark.slow, pytest.mark.timeout(400)]

NODE_LIMITS = "min-sigma=0.1 max-clip-norm=5.0 max-local-steps=1000 max-lr=0.5"


def node_config(partition: int, partitions: int, data_dir: Path) -> str:
    return f'partition-id={partition} num-partitions={partitions} data-dir="{data_dir}" {NODE_LIMITS}'


def run_config_str(cfg: dict) -> str:
    """``--run-config`` string (space-separated TOML key=value pairs)."""
    def fmt(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, str):
            return json.dumps(v)
        return repr(v)
    return " ".join(f"{k}={fmt(v)}" for k, v in cfg.items())


def app_config(overrides: dict) -> AppConfig:
    """The AppConfig the ServerApp sees: pyproject defaults + the --run-config overrides."""
    defaults = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]
    return AppConfig.from_run_config({**defaults, **overrides})


class Scraper:
    """Scrape the Prometheus endpoint every ``interval`` s in a thread; keep every distinct snapshot."""

    def __init__(self, port: int, interval: float = 0.15) -> None:
        self.port, self.interval = port, interval
        self.snapshots: list[dict[str, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while not self._stop.is_set():
            snap = scrape(self.port, timeout=0.5)
            if snap is not None and (not self.snapshots or snap != self.snapshots[-1]):
                self.snapshots.append(snap)
            self._stop.wait(self.interval)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@pytest.fixture
def fed(tmp_path):
    federation = Federation(tmp_path / "fed")
    try:
        federation.start_superlink()
        yield federation
    finally:
        federation.stop()
    assert pids_with_marker(federation.marker) == []  # nothing of ours survives


def ledger_rounds(path: Path) -> list[dict]:
    try:
        return read_ledger(path).rounds
    except (OSError, ValueError):
        return []


# --------------------------------------------------------------------------- a
def test_tls_auth_two_supernodes_two_rounds(fed, tmp_path):
    t0 = time.monotonic()
    ids = fed.start_nodes([node_config(0, 2, tmp_path), node_config(1, 2, tmp_path)])
    t_ready = time.monotonic() - t0
    # a third SuperNode whose key was never registered
    rogue = fed.start_supernode(3, node_config(1, 2, tmp_path), max_wait=20, name="rogue")

    port = free_port()
    out = tmp_path / "out"
    cfg = {"num-server-rounds": 2, "clients-per-round": 2, "num-partitions": 2, "local-steps": 10,
           "batch-size": 32, "sigma": 0.5, "seed": 0, "round-timeout": 300.0, "metrics-port": port,
           "run-name": "tls-auth", "output-dir": str(out)}
    run_id = fed.submit(run_config_str(cfg))
    scraper = Scraper(port)
    try:
        info = fed.wait_finished(run_id, 240, interval=3)
    finally:
        scraper.stop()
    t_total = time.monotonic() - t0
    print(f"\nnodes online after {t_ready:.1f}s; run {info['elapsed']:.1f}s; test body {t_total:.1f}s")
    logs = fed.logs(run_id)
    assert info["status"] == "finished:completed", f"{info}\n{logs[-4000:]}"

    # ledger: 2 round lines, both registered nodes in each
    rounds = read_ledger(out / "tls-auth" / "ledger.jsonl").rounds
    assert [r["round"] for r in rounds] == [1, 2]
    for r in rounds:
        assert sorted(r["record"]["node_ids"]) == sorted(ids)
        assert r["report"]["clients"] == 2 and len(r["record"]["weights"]) == 2

    # Prometheus: reachable during the run, and showed round 1 exactly as the ledger has it
    assert scraper.snapshots, "the Prometheus endpoint was never reachable during the run"
    after_r1 = [s for s in scraper.snapshots if s.get("fl_dp_rounds_completed") == 1.0]
    assert after_r1, [s.get("fl_dp_rounds_completed") for s in scraper.snapshots]
    snap = after_r1[-1]
    cert = rounds[0]["report"]["certified"]
    assert math.isclose(snap["fl_dp_certified_mu"], cert["mu"], rel_tol=1e-9)
    assert math.isclose(snap["fl_dp_certified_epsilon"], cert["epsilon"], rel_tol=1e-9)
    assert snap["fl_dp_clients_aggregated"] == 2.0
    assert snap["fl_dp_last_round"] == 1.0
    assert snap['fl_dp_certified_info{bound="composition"}'] == 1.0

    # the unregistered SuperNode was refused (SuperLink: 412 + ApiError 2004; SuperNode: exit code 305)
    wait_until(lambda: rogue.popen.poll() is not None, 60, "the unregistered SuperNode to give up")
    rogue_log = rogue.text()
    assert rogue.popen.returncode != 0
    assert "Exit Code: 305" in rogue_log and "[code: 2004] Failed to activate SuperNode" in rogue_log, rogue_log[-2000:]
    link_log = fed.superlink.text()
    assert '"POST /v1/fleet/activate-node HTTP/1.1" 412' in link_log
    assert "[ApiError:2004]" in link_log and "No SuperNode found with the given public key" in link_log
    listed = fed.cli("supernode", "ls", fed.conn, "--format", "json").stdout
    assert "sn3" not in listed


# --------------------------------------------------------------------------- b
def test_supernode_killed_mid_round(fed, tmp_path):
    ids = fed.start_nodes([node_config(0, 2, tmp_path), node_config(1, 2, tmp_path)])
    victim, survivor = fed.nodes[1], ids[0]
    out = tmp_path / "out"
    timeout = 45.0
    cfg = {"num-server-rounds": 2, "clients-per-round": 2, "min-replies": 1, "round-timeout": timeout,
           "num-partitions": 2, "local-steps": 200, "batch-size": 64, "sigma": 0.5, "seed": 0,
           "run-name": "kill-node", "output-dir": str(out)}
    ledger = out / "kill-node" / "ledger.jsonl"
    t0 = time.monotonic()
    run_id = fed.submit(run_config_str(cfg))

    seen: set[int] = set()

    def round1_done():
        seen.update(fed.clientapp_pids(victim))  # round-1 ClientApps of the victim
        return len(ledger_rounds(ledger)) >= 1

    wait_until(round1_done, 180, "round 1 in the ledger", interval=0.3)
    # round 2 is in flight once the victim's SuperNode has started a new ClientApp process for it
    in_flight = wait_until(lambda: [p for p in fed.clientapp_pids(victim) if p not in seen], 60,
                           "the victim's round-2 ClientApp", interval=0.1)
    assert len(ledger_rounds(ledger)) == 1
    killed = kill_tree(victim.pid)
    t_kill = time.monotonic()
    assert set(in_flight) <= set(killed)
    print(f"\nkilled SuperNode {victim.pid} and descendants {killed[1:]} "
          f"(round-2 ClientApp {in_flight}) at {t_kill - t0:.1f}s")
    victim.popen.wait(10)

    info = fed.wait_finished(run_id, timeout + 90, interval=3)
    t_round2 = time.monotonic() - t_kill
    print(f"run finished {t_round2:.1f}s after the kill "
          f"(round-timeout {timeout}s); run {info['elapsed']:.1f}s")
    logs = fed.logs(run_id)
    assert info["status"] == "finished:completed", f"{info}\n{logs[-4000:]}"
    rounds = read_ledger(ledger).rounds
    assert [r["round"] for r in rounds] == [1, 2]
    assert sorted(rounds[0]["record"]["node_ids"]) == sorted(ids)
    assert rounds[1]["record"]["node_ids"] == [survivor]      # only the client that replied
    assert rounds[1]["record"]["weights"] == [1.0]
    assert rounds[1]["report"]["clients"] == 1
    assert rounds[1]["metrics"]["dp-aggregated"] == 1        # 1 reply >= min-replies = 1
    assert "round 2: 1 of 2 sampled nodes did not reply in time" in logs
    # fewer clients => less privacy amplification by averaging: round 2 costs more than round 1
    mu1 = rounds[0]["report"]["certified"]["mu"]
    mu2 = rounds[1]["report"]["certified"]["mu"]
    assert mu2 ** 2 - mu1 ** 2 > mu1 ** 2


# --------------------------------------------------------------------------- c
def test_serverapp_killed_and_resumed(fed, tmp_path):
    ids = fed.start_nodes([node_config(0, 2, tmp_path), node_config(1, 2, tmp_path)])
    out = tmp_path / "out"
    cfg = {"num-server-rounds": 3, "clients-per-round": 2, "num-partitions": 2, "local-steps": 5,
           "batch-size": 32, "sigma": 0.7, "clip-norm": 2.0, "schedule": "cyclic", "seed": 0,
           "round-timeout": 300.0, "run-name": "crash", "output-dir": str(out)}
    run_dir = out / "crash"
    ledger = run_dir / "ledger.jsonl"
    t0 = time.monotonic()
    first = fed.submit(run_config_str(cfg))

    wait_until(lambda: len(ledger_rounds(ledger)) >= 1, 180, "round 1 in the ledger", interval=0.2)
    victims = wait_until(fed.serverapp_pids, 10, "the flwr-serverapp process")
    for pid in victims:
        kill_tree(pid)
    wait_until(lambda: not fed.serverapp_pids(), 10, "the ServerApp to die")
    t_kill = time.monotonic() - t0
    assert [r["round"] for r in ledger_rounds(ledger)] == [1]
    header_before = ledger.read_bytes().split(b"\n")[0]
    fed.cli("stop", str(first), fed.conn)  # what an operator does with the dead run
    wait_until(lambda: fed.status(first).startswith("finished"), 60, "the crashed run to be finished")

    second = fed.submit(run_config_str({**cfg, "resume": True}))
    info = fed.wait_finished(second, 240, interval=3)
    logs = fed.logs(second)
    print(f"\nServerApp killed at {t_kill:.1f}s; first run {fed.status(first)}; resumed run "
          f"{info['elapsed']:.1f}s; total {time.monotonic() - t0:.1f}s")
    assert info["status"] == "finished:completed", f"{info}\n{logs[-4000:]}"

    contents = read_ledger(ledger)
    assert ledger.read_bytes().split(b"\n")[0] == header_before     # never rewritten
    assert [r["round"] for r in contents.rounds] == [1, 2, 3]
    resumes = [e for e in contents.events if e.get("event") == "resume"]
    assert len(resumes) == 1 and resumes[0]["data"]["rounds_accounted"] == 1
    assert all(sorted(r["record"]["node_ids"]) == sorted(ids) for r in contents.rounds)

    # reference: an accountant that ran the 3 planned rounds without a crash
    acct_cfg = app_config({k: v for k, v in cfg.items()}).accountant_config()
    assert contents.header["accountant_config"] == acct_cfg.to_dict()
    reference = PrivacyAccountant(acct_cfg)
    for t, entry in enumerate(contents.rounds, start=1):
        planned = acct_cfg.planned_round(t)
        expected = reference.step(planned).to_dict()
        got = entry["report"]
        assert math.isclose(got["certified"]["mu"], expected["certified"]["mu"], rel_tol=1e-12), (t, got, expected)
        assert got["certified"]["bound"] == expected["certified"]["bound"]
        for name, bound in expected["bounds"].items():
            assert math.isclose(got["bounds"][name]["mu"], bound["mu"], rel_tol=1e-12), (t, name)
            assert got["bounds"][name]["sound"] == bound["sound"]
        assert entry["record"]["step_sizes"] == pytest.approx(list(planned.step_sizes), rel=1e-12)

    rebuilt = PrivacyAccountant.from_records(acct_cfg, load_round_records(ledger))
    state, ref_state = rebuilt.state_dict(), reference.state_dict()
    for rec in state["records"]:
        assert sorted(rec.pop("node_ids")) == sorted(ids)
    for rec in ref_state["records"]:
        rec.pop("node_ids")
    assert state == ref_state
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["rounds_accounted"] == 3
    assert math.isclose(summary["final_report"]["certified"]["mu"], reference.report().certified.mu, rel_tol=1e-12)
    assert "resuming" in logs and "1 rounds accounted" in logs

"""The shipped Prometheus rules: promtool checks them, promtool's rule tests pin each alert's
behaviour, and a real Prometheus scraping a real run's endpoint on loopback sees the budget alert
fire. Needs Debian's `prometheus` package (promtool, prometheus); skipped with a reason without it.
"""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import threading
import time
import urllib.request
from pathlib import Path

import pytest

from deploy_harness import wait_until
from fl_dp_flower.privacy import PrivacyAccountant
from fl_dp_flower.app.testing import run_local, tiny_config

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docker" / "prometheus"
PROMTOOL, PROMETHEUS = shutil.which("promtool"), shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@needs_promtool
def test_rules_pass_promtool_check():
    r = subprocess.run([PROMTOOL, "check", "rules", str(RULES / "alerts.yml")], capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS: 5 rules found" in r.stdout, r.stdout + r.stderr


@needs_promtool
def test_each_alert_fires_on_its_series_and_not_before():
    r = subprocess.run([PROMTOOL, "test", "rules", "alerts.test.yml"], cwd=RULES, capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def _api(port: int, path: str) -> dict:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as r:
        return json.loads(r.read())


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)")
def test_real_prometheus_sees_the_budget_alert_fire_on_a_real_run(tmp_path):
    metrics_port, prom_port = _free_port(), _free_port()
    base = tiny_config(tmp_path, **{"num-server-rounds": 6})
    acct = PrivacyAccountant(base.accountant_config())
    eps = [acct.step(base.accountant_config().planned_round(t)).certified.epsilon for t in (1, 2, 3)]
    cfg = tiny_config(tmp_path, **{"num-server-rounds": 6, "target-epsilon": (eps[1] + eps[2]) / 2,
                                   "metrics-port": metrics_port, "metrics-linger": 120.0})
    rules = tmp_path / "alerts.yml"
    shutil.copy(RULES / "alerts.yml", rules)
    (tmp_path / "prometheus.yml").write_text(
        "global: {scrape_interval: 1s, evaluation_interval: 1s}\n"
        f"rule_files: ['{rules}']\n"
        f"scrape_configs: [{{job_name: fl-dp-flower, static_configs: [{{targets: ['127.0.0.1:{metrics_port}']}}]}}]\n")
    prom = subprocess.Popen([PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    box: dict = {}
    runner = threading.Thread(target=lambda: box.setdefault("out", run_local(cfg)), daemon=True)
    try:
        runner.start()

        def firing() -> list[dict]:
            try:
                alerts = _api(prom_port, "/api/v1/alerts")["data"]["alerts"]
            except OSError:
                return []
            return [a for a in alerts if a["state"] == "firing"]

        def progress():
            try:
                return len(_api(prom_port, "/api/v1/query?query=fl_dp_rounds_completed")["data"]["result"]), \
                    (tmp_path / "run" / "ledger.jsonl").stat().st_size
            except OSError:
                return None

        fired = wait_until(lambda: [a for a in firing() if a["labels"]["alertname"] == "FlDpBudgetExhausted"],
                           240, "FlDpBudgetExhausted to fire", interval=1.0, progress=progress)
        assert fired[0]["labels"]["severity"] == "critical"
        names = {a["labels"]["alertname"] for a in firing()}
        assert "FlDpBudget80PercentSpent" in names  # certified epsilon is past 80 % of the target
        assert not names & {"FlDpTooFewClients", "FlDpEpsilonJump", "FlDpNoRoundCompleted"}  # a healthy run
        got = _api(prom_port, "/api/v1/query?query=fl_dp_certified_epsilon")["data"]["result"]
        assert float(got[0]["value"][1]) == pytest.approx(eps[1], rel=1e-9)  # 2 rounds: stopped before round 3
    finally:
        prom.terminate()
        prom.wait(30)
        # end the lingering exporter: the run's thread finishes after metrics-linger; not waited for


# ------------------------------------------------------------------ endpoint hardening (real sockets)
METRICS_LOGGER = "flwr.fl_dp_flower.reporting.prometheus"


def _closed_by_server(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closed ``sock`` (EOF or reset) within ``seconds``, reading whatever it sent."""
    sock.settimeout(seconds)
    try:
        while True:
            if not sock.recv(65536):
                return True
    except (ConnectionResetError, BrokenPipeError):
        return True
    except socket.timeout:
        return False


def test_aborted_unauthenticated_tls_connections_are_one_log_line_each(tmp_path, caplog, capfd):
    """A TLS client that sends a request without credentials and hangs up before reading the 401:
    at most one line each in the ServerApp log, no traceback on stderr (the ServerApp log `flwr log`
    shows)."""
    import logging
    import ssl

    from deploy_harness import generate_certs
    from fl_dp_flower.reporting import PrivacyMetricsExporter

    certs = generate_certs(tmp_path / "certs", supernodes=1)
    auth = tmp_path / "metrics-auth"
    auth.write_text("prometheus:s3cret\n")
    auth.chmod(0o600)
    caplog.set_level(logging.DEBUG, logger=METRICS_LOGGER)
    ctx = ssl.create_default_context(cafile=str(certs / "ca.crt"))
    connections = 20  # whether the 401 is written before the hang-up is a race: about half fail here
    with PrivacyMetricsExporter(0, certfile=str(certs / "superlink" / "server.pem"),
                                keyfile=str(certs / "superlink" / "server.key"), auth_file=str(auth)) as exp:
        for _ in range(connections):
            conn = ctx.wrap_socket(socket.create_connection(("127.0.0.1", exp.port)), server_hostname="127.0.0.1")
            conn.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")
            time.sleep(0.05)
            conn.sendall(b"\r\n")
            conn.close()
        wait_until(lambda: any(r.name == METRICS_LOGGER for r in caplog.records), 60, "a log line")
        time.sleep(1.0)  # let the last connections' threads finish
    lines = [r.getMessage() for r in caplog.records if r.name == METRICS_LOGGER]
    assert 1 <= len(lines) <= connections, lines
    assert all(line.startswith("metrics endpoint: connection from 127.0.0.1:") and "\n" not in line for line in lines)
    assert all(not r.exc_info for r in caplog.records if r.name == METRICS_LOGGER)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "SSLEOFError" not in err, err


def test_trickling_clients_are_capped_and_cut(caplog):
    """At most max_connections at once (one more is closed unanswered), and a client that trickles
    its request (a byte every 0.2 s: no single read ever times out) is cut after connection_seconds."""
    import logging

    from fl_dp_flower.reporting import PrivacyMetricsExporter

    caplog.set_level(logging.INFO, logger=METRICS_LOGGER)
    stop = threading.Event()
    with PrivacyMetricsExporter(0, max_connections=2, connection_seconds=2.0) as exp:
        tricklers = [socket.create_connection(("127.0.0.1", exp.port)) for _ in range(2)]

        def trickle() -> None:
            request = b"GET /metrics HTTP/1.1\r\nX-Slow: " + b"a" * 10_000
            for i in range(len(request)):
                if stop.is_set():
                    return
                for s in tricklers:
                    try:
                        s.send(request[i:i + 1])
                    except OSError:
                        pass
                time.sleep(0.2)

        feeder = threading.Thread(target=trickle, daemon=True)
        feeder.start()
        try:
            time.sleep(0.5)  # both tricklers hold a slot
            extra = socket.create_connection(("127.0.0.1", exp.port))
            extra.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            extra.settimeout(60)
            assert extra.recv(65536) == b""  # closed, not answered: the cap holds
            extra.close()
            assert any("concurrent connections (the cap)" in r.getMessage() for r in caplog.records)
            # the tricklers are cut after connection_seconds, although they never stop sending
            assert all(_closed_by_server(s, 60) for s in tricklers)
        finally:
            stop.set()
            feeder.join(10)
            for s in tricklers:
                s.close()
        # the slots are free again: a normal scrape is served
        body = wait_until(lambda: _scrape_text(exp.port), 60, "a scrape after the tricklers were cut")
        assert "fl_dp_certified_epsilon" in body


def _scrape_text(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()
    except OSError:
        return None

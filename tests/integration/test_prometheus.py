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
    records: list[logging.LogRecord] = []  # a handler on the logger itself: another test's propagation settings
    handler = logging.Handler(logging.DEBUG)  # (Flower's logger) cannot hide these records from it
    handler.emit = records.append  # type: ignore[method-assign]
    logging.getLogger(METRICS_LOGGER).addHandler(handler)
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
        wait_until(lambda: records, 60, "a log line")
        time.sleep(1.0)  # let the last connections' threads finish
    logging.getLogger(METRICS_LOGGER).removeHandler(handler)  # the exporter's close flushed the count line
    lines = [r.getMessage() for r in records]
    assert 1 <= len(lines) <= connections, lines
    assert all((line.startswith("metrics endpoint: connection from 127.0.0.1:") or " more failed connection(s) not "
                "logged" in line) and "\n" not in line for line in lines)
    assert all(not r.exc_info for r in records)
    err = capfd.readouterr().err
    assert "Traceback" not in err and "SSLEOFError" not in err, err


def test_trickling_clients_are_evicted_and_cut(caplog):
    """A client that trickles its request (a byte every 0.2 s: no single read ever times out) holds its slot
    only until a new connection needs it (the oldest waiting one is evicted), and is cut at the request
    deadline (handshake_seconds, capped at connection_seconds) although it never stops sending."""
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
            assert "fl_dp_certified_epsilon" in _scrape_text(exp.port)  # served: the oldest trickler evicted
            assert exp._server.evicted_connections == 1 and exp._server.refused_connections == 0
            assert all(_closed_by_server(s, 60) for s in tricklers)  # evicted, or cut at the deadline
        finally:
            stop.set()
            feeder.join(10)
            for s in tricklers:
                s.close()
        body = wait_until(lambda: _scrape_text(exp.port), 60, "a scrape after the tricklers were cut")
        assert "fl_dp_certified_epsilon" in body


def test_connections_past_their_request_are_capped(caplog):
    """At most max_connections requests are served at once: with both slots busy answering (a collector
    that blocks), a new connection has no waiting connection to evict and is closed unanswered."""
    import logging

    from fl_dp_flower.reporting import PrivacyMetricsExporter

    caplog.set_level(logging.INFO, logger=METRICS_LOGGER)
    release, entered = threading.Event(), threading.Semaphore(0)

    class Blocking:
        def describe(self):  # registering does not collect
            return []

        def collect(self):
            entered.release()
            release.wait(60)
            return []

    with PrivacyMetricsExporter(0, max_connections=2, connection_seconds=120.0) as exp:
        exp.registry.register(Blocking())
        busy = [threading.Thread(target=_scrape_text, args=(exp.port,), daemon=True) for _ in range(2)]
        for t in busy:
            t.start()
        try:
            for _ in busy:
                assert entered.acquire(timeout=60)  # both requests are being answered
            extra = socket.create_connection(("127.0.0.1", exp.port))
            extra.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n")
            assert _closed_by_server(extra, 60) and exp._server.refused_connections == 1
            extra.close()
            assert any("concurrent connections past their request (the cap)" in r.getMessage() for r in caplog.records)
        finally:
            release.set()
            for t in busy:
                t.join(60)


def _scrape_text(port: int) -> str | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
            return r.read().decode()
    except OSError:
        return None


# ------------------------------------------------------------------ issue 28.11: idle connections, log volume
def _exporter(tmp_path, tls: bool, **limits):
    from fl_dp_flower.reporting import PrivacyMetricsExporter

    if not tls:
        return PrivacyMetricsExporter(0, **limits), None
    from deploy_harness import generate_certs

    certs = generate_certs(tmp_path / "certs", supernodes=1)
    exp = PrivacyMetricsExporter(0, certfile=str(certs / "superlink" / "server.pem"),
                                 keyfile=str(certs / "superlink" / "server.key"), **limits)
    return exp, str(certs / "ca.crt")


def _scrape_once(port: int, cafile: str | None) -> str:
    import ssl

    scheme, ctx = ("https", ssl.create_default_context(cafile=cafile)) if cafile else ("http", None)
    with urllib.request.urlopen(f"{scheme}://127.0.0.1:{port}/metrics", timeout=30, context=ctx) as r:
        return r.read().decode()


@pytest.mark.parametrize("tls", [False, True])
def test_idle_connections_do_not_keep_scrapes_out(tmp_path, tls):
    """Before: every slot held by an idle (pre-TLS, pre-request) connection refused each scrape (1 of 45
    succeeded in the deployment re-probe). Now a scrape evicts the oldest idle connection, and an idle
    connection is cut after handshake_seconds (connection_seconds is far away: 600 s)."""
    exp, cafile = _exporter(tmp_path, tls, max_connections=4, connection_seconds=600.0, handshake_seconds=1.0)
    idle: list[socket.socket] = []
    try:
        for _ in range(5):  # the attacker keeps every slot taken before each scrape
            idle = [s for s in idle if s.fileno() >= 0]
            idle += [socket.create_connection(("127.0.0.1", exp.port)) for _ in range(4)]
            time.sleep(0.2)  # accepted: every slot holds an idle connection
            assert "fl_dp_certified_epsilon" in _scrape_once(exp.port, cafile)
        assert exp._server.evicted_connections >= 5
        lone = socket.create_connection(("127.0.0.1", exp.port))
        assert _closed_by_server(lone, 60)  # cut at the handshake deadline, long before connection_seconds
        lone.close()
    finally:
        for s in idle:
            s.close()
        exp.close()


def test_failed_handshakes_are_logged_at_most_once_a_minute(tmp_path, caplog):
    """Before: one log line per failed handshake (2,216 of a run's 2,263 `flwr log` lines came from an
    attacker). Now one line, then a count when the endpoint closes."""
    import logging

    caplog.set_level(logging.INFO, logger=METRICS_LOGGER)
    exp, _ = _exporter(tmp_path, True)
    failures = 20
    try:
        for _ in range(failures):
            with socket.create_connection(("127.0.0.1", exp.port)) as s:
                s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")  # plain HTTP to the TLS port: the handshake fails
                _closed_by_server(s, 60)
        wait_until(lambda: exp._server.failures.total >= failures, 60, "every failed handshake counted")
    finally:
        exp.close()
    lines = [r.getMessage() for r in caplog.records if r.name == METRICS_LOGGER]
    assert len(lines) == 2, lines
    assert lines[0].startswith("metrics endpoint: connection from 127.0.0.1:") and "failed" in lines[0]
    assert lines[1] == f"metrics endpoint: {failures - 1} more failed connection(s) not logged ({failures} in all)"

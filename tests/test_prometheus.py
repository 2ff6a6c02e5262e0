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
import urllib.request
from pathlib import Path

import pytest

from deploy_harness import wait_until
from fl_dp_flower.privacy import PrivacyAccountant
from fl_dp_flower.testing import run_local, tiny_config

ROOT = Path(__file__).resolve().parents[1]
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

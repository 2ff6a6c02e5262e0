"""``flwr run .`` as a Flower user types it, on Flower's default federation (2 simulated
SuperNodes, Flower's own local SuperLink), and the ServerApp's messages in ``flwr log``:

- the app as shipped trains there (its pyproject defaults fit 2 SuperNodes) and prints the
  per-round privacy line; the run's final status is checked (``flwr run --stream`` exits 0 even
  when the run failed);
- a second run with the same run name fails and says why in ``flwr log``;
- a run that needs more SuperNodes than are connected says so (WARNING) with the fix.

Runtime dependency installation (Flower's per-run ``uv sync``) is a SuperLink setting: the app
cannot turn it off, so the environment that starts the local SuperLink sets
``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1`` (docs/flwr-run.md).
"""

from __future__ import annotations

import json
import logging
import os
import re
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from deploy_harness import wait_until
from fl_dp_flower.app.config import AppConfig
from fl_dp_flower.app.launcher import processes_of, pyproject_run_config
from fl_dp_flower.app.local_flower import stop_processes
from fl_dp_flower.reporting import read_ledger
from fl_dp_flower.app.strategy import nodes_needed
from fl_dp_flower.strategies import nodes

ROOT = Path(__file__).resolve().parents[2]
QUIET = 240.0


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Flwr:
    """``flwr`` with a private FLWR_HOME and port for Flower's own local SuperLink."""

    def __init__(self, home: Path) -> None:
        self.home = home.resolve()
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "FLWR_TELEMETRY_ENABLED": "0",
                    "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                    "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
                    "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port())}

    def stream(self, *args: str) -> tuple[int, str]:
        """``flwr run ... --stream``: (exit code, output), waiting while output comes."""
        lines: list[str] = []
        proc = subprocess.Popen(["flwr", "run", *args, "--stream"], cwd=ROOT, env=self.env, text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        reader = threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True)
        reader.start()
        wait_until(lambda: proc.poll() is not None, QUIET, "flwr run --stream to end", interval=0.5,
                   progress=lambda: len(lines))
        reader.join(10)
        return proc.returncode, "".join(lines)

    def call(self, *args: str) -> str:
        r = subprocess.run(["flwr", *args], check=False, cwd=ROOT, env=self.env, capture_output=True, text=True, timeout=600)
        return re.sub(r"\x1b\[[0-9;]*m", "", r.stdout + r.stderr)

    def status(self, run_id: str) -> str:
        text = self.call("ls", "--run-id", run_id, "--format", "json")
        try:
            return json.loads(text[text.find("{"):text.rfind("}") + 1])["runs"][0]["status"]
        except (ValueError, KeyError, IndexError):
            return ""


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_flwr_run_dot_trains_on_flowers_default_federation_and_a_second_same_name_run_says_why(tmp_path):
    flwr = Flwr(tmp_path / "flwr-home")
    out = tmp_path / "out"
    overrides = f"num-server-rounds=2 output-dir='{out}' run-name='dot'"
    try:
        code, text = flwr.stream(".", "--run-config", overrides)  # no --federation-config: Flower's default
        run_id = re.search(r"Successfully started run (\d+)", text).group(1)
        assert code == 0, text[-3000:]
        wait_until(lambda: flwr.status(run_id).startswith("finished"), QUIET, "the run's final status")
        assert flwr.status(run_id) == "finished:completed", text[-3000:]
        assert "2 simulated SuperNodes" in text  # Flower's default federation, as a new user gets it
        lines = [line for line in text.splitlines() if re.search(r"round [12] \| clients 2 \| acc .* \| certified "
                                                                  r"mu=\S+ eps=\S+ \(delta=1e-05", line)]
        assert len(lines) == 2, text[-3000:]
        ledger = read_ledger(out / "dot" / "ledger.jsonl")
        assert [r["report"]["clients"] for r in ledger.rounds] == [2, 2]
        cert = ledger.rounds[-1]["report"]["certified"]
        assert f"eps={cert['epsilon']:.4g}" in lines[-1] or f"eps={cert['epsilon']}" in lines[-1]

        # the same run name again: the ServerApp refuses (the ledger is never overwritten) and says so
        second = flwr.call("run", ".", "--run-config", overrides, "--format", "json")
        second_id = str(json.loads(second[second.find("{"):second.rfind("}") + 1])["run-id"])
        wait_until(lambda: flwr.status(second_id).startswith("finished"), QUIET, "the second run to end")
        assert flwr.status(second_id) == "finished:failed"
        log_text = flwr.call("log", second_id, "--show")
        assert f"privacy ledger {out / 'dot' / 'ledger.jsonl'} already exists" in log_text, log_text[-3000:]
        assert len(read_ledger(out / "dot" / "ledger.jsonl").rounds) == 2  # untouched
    finally:
        stop_processes(flwr.home, grace=5.0)
    assert not processes_of(flwr.home)


class _Grid:
    """A Grid whose connected SuperNodes grow by one per ``get_node_ids`` call after ``wait`` calls."""

    def __init__(self, start: int, wait: int) -> None:
        self.start, self.wait, self.calls = start, wait, 0

    def get_node_ids(self):
        self.calls += 1
        return list(range(self.start + max(self.calls - self.wait, 0)))


def test_too_few_supernodes_warn_with_the_fix(monkeypatch, caplog):
    config = AppConfig.from_run_config({**pyproject_run_config(), "clients-per-round": 10})
    clock = iter(range(0, 10_000, 30))  # each check is 30 s later
    monkeypatch.setattr(nodes.time, "monotonic", lambda: float(next(clock)))
    monkeypatch.setattr(nodes.time, "sleep", lambda s: None)
    grid = _Grid(start=2, wait=4)
    with caplog.at_level(logging.WARNING, logger="flwr"):
        nodes.warn_until_enough_nodes(grid, nodes_needed(config), config.federation_settings())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert grid.calls == 4 + 8  # returned as soon as 10 were connected
    assert warnings and warnings[0].startswith("waiting for SuperNodes: 2 connected, this run needs 10")
    assert 'flwr run . --federation-config "num-supernodes=10"' in warnings[0]
    assert len(warnings) == 6  # once a minute while waiting (a check every 30 s: 12 checks)


def test_the_pyproject_defaults_fit_flowers_default_federation():
    """Flower 1.41's default simulated federation has 2 SuperNodes; the app's defaults need no more."""
    from flwr.supercore.constant import DEFAULT_SIMULATION_CONFIG

    config = AppConfig.from_run_config(pyproject_run_config())
    assert nodes_needed(config) <= DEFAULT_SIMULATION_CONFIG.num_supernodes == 2

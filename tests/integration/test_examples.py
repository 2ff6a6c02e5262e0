"""examples/: a user's own Flower app on the public API, run with ``flwr run``; import rules."""

from __future__ import annotations

import ast
import dataclasses
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import fl_dp_flower
from fl_dp_flower.privacy import AccountantConfig, PrivacyAccountant, RoundRecord
from fl_dp_flower.privacy.screening_charge import DEFAULT_CHECK_LEVEL
from fl_dp_flower.reporting.verify import verify_ledger

ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "digits"
#: the reference app: it may use the documented sub-packages (docs/ARCHITECTURE.md), never a private name
REFERENCE_APP = [ROOT / "client_app.py", ROOT / "server_app.py", *sorted((ROOT / "fl_dp_flower" / "app").glob("*.py"))]
#: the library's documented modules (docs/ARCHITECTURE.md); the app may also import its own modules (fl_dp_flower.app)
DOCUMENTED = {"fl_dp_flower", "fl_dp_flower.vocabulary", "fl_dp_flower.privacy", "fl_dp_flower.training",
              "fl_dp_flower.settings", "fl_dp_flower.protocol", "fl_dp_flower.node", "fl_dp_flower.client",
              "fl_dp_flower.reporting", "fl_dp_flower.strategies", "fl_dp_flower.audit", "fl_dp_flower.interop",
              "fl_dp_flower.testing", "fl_dp_flower.errors", "fl_dp_flower.secagg_mod", "fl_dp_flower.run_marker",
              "fl_dp_flower.reply_checks", "fl_dp_flower.app"}


def _imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every ``from fl_dp_flower... import name`` (relative imports resolved)."""
    package = "fl_dp_flower" + "".join("." + p for p in path.relative_to(ROOT / "fl_dp_flower").parent.parts) \
        if (ROOT / "fl_dp_flower") in path.parents else ""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            module = node.module or ""
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join(base + ([module] if module else []))
            if module.split(".")[0] == "fl_dp_flower":
                found += [(module, a.name) for a in node.names]
        elif isinstance(node, ast.Import):
            found += [(a.name, "") for a in node.names if a.name.split(".")[0] == "fl_dp_flower"]
    return found


def test_examples_import_only_top_level_public_names():
    files = sorted(EXAMPLE.rglob("*.py"))
    assert files
    for path in files:
        for module, name in _imports(path):
            assert module == "fl_dp_flower" and name in fl_dp_flower.__all__, f"{path}: {module}.{name}"


def test_reference_app_imports_documented_modules_and_public_names():
    for path in REFERENCE_APP:
        for module, name in _imports(path):
            top = ".".join(module.split(".")[:2])
            assert top in DOCUMENTED, f"{path}: {module} is not a documented sub-package"
            private = name.startswith("_") and not (name.startswith("__") and name.endswith("__"))
            assert not private and not any(p.startswith("_") for p in module.split(".")), \
                f"{path}: private name {module}.{name}"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow
def test_digits_example_runs_with_flwr_run(tmp_path):
    """The example as a user runs it (`flwr run .`): ledger, certified epsilon, verify."""
    from fl_dp_flower.app.launcher import stop_processes

    app = tmp_path / "digits"
    shutil.copytree(EXAMPLE, app, ignore=shutil.ignore_patterns("__pycache__", "digits-outputs"))
    home, out = (tmp_path / "flwr-home").resolve(), (tmp_path / "out").resolve()
    env = {**os.environ, "FLWR_HOME": str(home), "FLWR_LOCAL_SUPERLINK_HTTP_API_PORT": str(_free_port()),
           "FLWR_LOCAL_CONTROL_API_PORT": str(_free_port()), "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
           "FLWR_TELEMETRY_ENABLED": "0", "FLWR_DISABLE_UPDATE_CHECK": "1",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}"}
    bin_dir = Path(sys.executable).parent
    flwr = str(bin_dir / "flwr")
    port = env["FLWR_LOCAL_SUPERLINK_HTTP_API_PORT"]
    state = home / "local-superlink"
    state.mkdir(parents=True)
    # the local SuperLink `flwr run` would start, started here to wait for it on a loaded machine
    # (flwr gives it 15 s) until it answers or dies
    superlink = subprocess.Popen([str(bin_dir / "flower-superlink"), "--insecure", "--simulation", "--isolation",
                                  "subprocess", "--host", "127.0.0.1", "--port", port, "--database",
                                  str(state / "state.db"), "--log-file", str(state / "superlink.log")],
                                 env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)

    def healthy() -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                return bool(response.status == 200)
        except OSError:
            return False

    try:
        while not healthy():
            assert superlink.poll() is None, (state / "superlink.log").read_text()[-3000:]
            time.sleep(0.5)
        r = subprocess.run([flwr, "run", str(app), "--stream", "--run-config",
                            f"output-dir='{out}' num-server-rounds=3",
                            "--federation-config", "num-supernodes=3 client-resources-num-cpus=1"],
                           cwd=app, env=env, capture_output=True, text=True, timeout=900)
    finally:
        stop_processes(home, grace=5.0)
    log = r.stdout[-4000:] + r.stderr[-2000:]
    summary_path = out / "summary.json"
    assert summary_path.exists(), log  # `flwr run --stream` exits 0 even when the run failed
    summary = json.loads(summary_path.read_text())
    ledger = out / "ledger.jsonl"
    lines = [json.loads(line) for line in ledger.read_text().splitlines()]
    rounds = [e for e in lines if e["kind"] == "round"]
    assert [e["round"] for e in rounds] == [1, 2, 3] and summary["rounds"] == 3
    assert [e["event"] for e in lines if e["kind"] == "event"][-1] == "end"
    # the certified epsilon, recomputed from the ledger's records by a fresh accountant
    config = AccountantConfig.from_dict(lines[0]["accountant_config"])
    assert config.sigma == 0.02 and config.clients == 3 and config.local_steps == 5
    fresh = PrivacyAccountant.from_records(config, [RoundRecord.from_dict(e["record"]) for e in rounds])
    assert summary["epsilon"] == pytest.approx(fresh.report().certified.epsilon, rel=1e-12)
    # every client replied as planned (node ids aside), each round screened at the library's default levels
    screened = 2 * DEFAULT_CHECK_LEVEL  # noise-check + update-bound, charged to delta (MATH §17.1)
    assert tuple(dataclasses.replace(r, node_ids=()) for r in fresh.records) == \
        tuple(dataclasses.replace(config.planned_round(t), screening_drop=screened) for t in (1, 2, 3))
    assert verify_ledger(ledger).ok, verify_ledger(ledger).to_dict()

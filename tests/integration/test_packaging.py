"""``pip install .`` (a wheel, not editable) into a fresh venv: the public API, the CLI and
``fl-dp-flower run`` work outside the checkout.

The venv gets only our wheel; its third-party dependencies (torch, flwr, ...) come from the test
interpreter's site-packages through a ``.pth`` line (this machine has no internet for a full install;
that path is appended after the venv's own site-packages and its ``.pth`` files are not run, so the
checkout's editable install is not visible). Flower's console scripts are re-created in the venv so
that every process ``flwr run`` starts runs the venv's interpreter and imports the wheel.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
FLOWER_SCRIPTS = ("flwr", "flower-superlink", "flower-superexec", "flower-supernode", "flwr-simulation",
                  "flwr-serverapp", "flwr-clientapp")

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def venv(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    clean = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                        str(tmp / "dist"), str(ROOT)], capture_output=True, text=True, timeout=600, env=clean)
    assert r.returncode == 0, r.stdout + r.stderr
    (wheel,) = (tmp / "dist").glob("fl_dp_flower-*.whl")
    env_dir = tmp / "venv"
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", str(env_dir)], check=True, timeout=300, env=clean)
    py = env_dir / "bin" / "python"
    r = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                       capture_output=True, text=True, timeout=600, env=clean)
    assert r.returncode == 0, r.stdout + r.stderr
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               capture_output=True, text=True, check=True, env=clean).stdout.strip())
    (site / "zz_test_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    for name in FLOWER_SCRIPTS:
        src = Path(sys.executable).parent / name
        if src.exists():
            body = src.read_text().split("\n", 1)[1]
            dst = env_dir / "bin" / name
            dst.write_text(f"#!{py}\n{body}")
            dst.chmod(0o755)
    return env_dir


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _env(venv: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    return {**env, **extra}


def test_wheel_gives_the_public_api_and_typed_package(venv, tmp_path):
    code = ("import fl_dp_flower, pathlib; from fl_dp_flower import DPSettings, NoisyFedAvg, dp_train, "
            "FlowerGDPAccountant, PrivacyAccountant; p = pathlib.Path(fl_dp_flower.__file__).parent; "
            "print(p); print((p / 'py.typed').exists()); "
            "from fl_dp_flower.app.app_project import app_project; print(app_project())")
    r = subprocess.run([str(venv / "bin" / "python"), "-c", code], cwd=tmp_path, capture_output=True, text=True,
                       env=_env(venv, FL_DP_FLOWER_APP_DIR=str(tmp_path / "app")), timeout=300)
    assert r.returncode == 0, r.stderr
    package, typed, app = r.stdout.split()
    assert Path(package).is_relative_to(venv) and typed == "True"
    written = tomllib.loads((Path(app) / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    checkout = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]
    assert written["components"] == {"serverapp": "fl_dp_flower.app.serverapp:app",
                                     "clientapp": "fl_dp_flower.app.clientapp:app"}
    assert written["config"] == checkout["config"]  # the wheel's app runs with the checkout's defaults


@pytest.mark.parametrize("argv", [["--help"], ["privacy", "--sigma", "1.0", "--rounds", "10", "--json"]])
def test_wheel_cli_commands(venv, tmp_path, argv):
    r = subprocess.run([str(venv / "bin" / "fl-dp-flower"), *argv], cwd=tmp_path, capture_output=True, text=True,
                       env=_env(venv), timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    if "--json" in argv:
        assert json.loads(r.stdout)["certified"]["epsilon"] > 0


def test_wheel_runs_the_quick_preset(venv, tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([str(venv / "bin" / "fl-dp-flower"), "run", "--preset", "quick", "--run-name", "wheel",
                        "--output-dir", str(out), "num-server-rounds=2"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=1500,
                       env=_env(venv, FL_DP_FLWR_HOME=str(tmp_path / "flwr-home"),
                                FL_DP_FLOWER_APP_DIR=str(tmp_path / "app"),
                                # a private local SuperLink: never another run's on the default port
                                FLWR_LOCAL_SUPERLINK_HTTP_API_PORT=str(_free_port()),
                                FLWR_LOCAL_CONTROL_API_PORT=str(_free_port())))
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-3000:]
    lines = [json.loads(line) for line in (out / "wheel" / "ledger.jsonl").read_text().splitlines()]
    assert [e["round"] for e in lines if e["kind"] == "round"] == [1, 2]

"""Static checks in the test command: ruff on the repository, mypy --strict on the privacy layer and
the public API (pyproject.toml's [tool.ruff] and [tool.mypy] configure both)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
#: modules held to mypy --strict: the privacy layer and what `from fl_dp_flower import ...` exposes
STRICT = ["fl_dp_flower/privacy/validate.py", "fl_dp_flower/privacy/schedules.py", "fl_dp_flower/privacy/records.py",
          "fl_dp_flower/privacy/gdp.py", "fl_dp_flower/privacy/accountant.py", "fl_dp_flower/__init__.py", "fl_dp_flower/settings.py", "fl_dp_flower/protocol.py",
          "fl_dp_flower/node.py", "fl_dp_flower/client.py", "fl_dp_flower/interop.py", "fl_dp_flower/app/app_project.py",
          "fl_dp_flower/reporting/rounds.py", "fl_dp_flower/privacy/terms.py", "fl_dp_flower/privacy/bounds.py",
          "fl_dp_flower/privacy/planning.py", "fl_dp_flower/privacy/sampled.py", "fl_dp_flower/privacy/sample_sampling.py",
          "fl_dp_flower/privacy/secure_aggregation.py", "fl_dp_flower/privacy/skellam.py",
          "fl_dp_flower/checkpoint.py", "fl_dp_flower/reporting/resume.py", "fl_dp_flower/privacy/preflight.py",
          "fl_dp_flower/strategies/preflight.py", "fl_dp_flower/api_docs.py",
          "fl_dp_flower/privacy/screening_charge.py", "fl_dp_flower/privacy/report.py", "fl_dp_flower/privacy/pld_rounds.py"]


def _tool(name: str) -> str:
    path = shutil.which(name, path=str(Path(sys.executable).parent)) or shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not installed (pip install -e '.[test]')")
    return path


def test_ruff_is_clean():
    r = subprocess.run([_tool("ruff"), "check", "--no-cache", "."], cwd=ROOT, capture_output=True, text=True,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy_strict_on_privacy_and_public_api():
    r = subprocess.run([_tool("mypy"), "--strict", "--no-incremental", *STRICT], cwd=ROOT, capture_output=True,
                       text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-6000:] + r.stderr[-2000:]

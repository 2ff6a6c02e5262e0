"""scripts/test.sh installs no system package unless asked (issue 21.4); CI asks."""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _executable(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IEXEC)


def _sandbox(tmp_path: Path) -> tuple[Path, Path, dict]:
    """A copy of test.sh whose setup and pytest are stubs, with root's `id` and a recording apt-get."""
    repo, calls = tmp_path / "repo", tmp_path / "apt-calls"
    (repo / "scripts").mkdir(parents=True)
    shutil.copy(ROOT / "scripts" / "test.sh", repo / "scripts" / "test.sh")
    _executable(repo / "scripts" / "setup.sh", "#!/bin/sh\nexit 0\n")
    _executable(repo / ".venv" / "bin" / "python", "#!/bin/sh\necho '1 passed'\nexit 0\n")
    bin_dir = tmp_path / "bin"
    _executable(bin_dir / "apt-get", f"#!/bin/sh\necho \"$@\" >> {calls}\nexit 1\n")
    _executable(bin_dir / "id", "#!/bin/sh\necho 0\n")
    path = f"{bin_dir}:{os.path.dirname(shutil.which('bash'))}:/usr/bin:/bin"
    env = {"PATH": path, "HOME": str(tmp_path)}
    return repo, calls, env


def test_test_sh_installs_no_system_package_without_the_opt_in(tmp_path):
    repo, calls, env = _sandbox(tmp_path)
    if shutil.which("promtool", path=env["PATH"]):
        return  # promtool is installed: nothing would be installed anyway
    out = subprocess.run(["bash", str(repo / "scripts" / "test.sh")], env=env, capture_output=True, text=True, check=False,
                         timeout=60)
    assert out.returncode == 0, out.stderr
    assert not calls.exists(), calls.read_text()
    assert "FL_DP_INSTALL_SYSTEM_PACKAGES=1" in out.stdout and "will skip" in out.stdout


def test_ci_opts_in():
    text = (ROOT / ".ci" / "run").read_text()
    assert "export FL_DP_INSTALL_SYSTEM_PACKAGES=1" in text and "scripts/test.sh" in text

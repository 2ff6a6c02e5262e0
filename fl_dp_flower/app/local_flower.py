"""The launcher's private local Flower: one SuperLink per run, and the ``flwr`` calls against it.

Flower's own local SuperLink (``flwr run`` with the ``:local:`` connection) listens on one
machine-wide port (127.0.0.1:39091) and keeps its state in ``~/.flwr``: two runs on one machine
share it, and stopping one run's processes stops the other's. Here every run gets

- its own Flower home (``FLWR_HOME``): a fresh owner-only temporary folder (removed at the end),
  or the folder named by ``FL_DP_FLWR_HOME`` (tests; kept);
- its own SuperLink, started by this module on a free port, checked to be the process that
  listens there (a port taken between the pick and the bind makes it exit: another port is
  tried), and named in the home's ``config.toml`` as an explicit address, so ``flwr`` never
  starts or reuses another SuperLink;
- processes found by that ``FLWR_HOME`` in their environment, so a stop stops only this run's.

Waits are bounded by liveness, not by a quiet machine's timings: a SuperLink that is still
alive gets more time (and the waiting is printed), one that exited is replaced.

``flwr`` status calls (:class:`StatusPoller`) run in the background: a slow or failing call
never blocks the caller and never raises; it is retried with exponential backoff.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from collections.abc import Callable
from typing import Any
from fl_dp_flower.errors import FlDpError

ANSI = re.compile(r"\x1b\[[0-9;]*m")
CONNECTION = "fl-dp-flower"  # the connection name written into the private config.toml
START_PATIENCE = 600.0  # seconds a live SuperLink may take to answer before the launcher gives up
START_ATTEMPTS = 4  # ports tried when a SuperLink exits at start (its port was taken meanwhile)


class FlowerStartError(FlDpError, RuntimeError):
    """The private SuperLink could not be started (the message says why and where its log is)."""


# ------------------------------------------------------------------ processes
def _environ_has(pid: int, needle: bytes) -> bool:
    try:
        return needle in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


def processes_of(flwr_home: Path) -> list[int]:
    """Live processes started for this FLWR_HOME (SuperLink, SuperExec, flwr-simulation, Ray)."""
    needle = f"FLWR_HOME={flwr_home}\0".encode()
    me = os.getpid()
    return [int(d.name) for d in Path("/proc").iterdir()
            if d.name.isdigit() and int(d.name) != me and _environ_has(int(d.name), needle)]


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def stop_processes(flwr_home: Path, grace: float = 10.0, *, spare_superlink: bool = False) -> list[int]:
    """SIGTERM every process of ``flwr_home``, SIGKILL what is left after ``grace`` seconds.

    ``spare_superlink``: stop only what trains (SuperExec, ``flwr-simulation``, Ray), so that the
    SuperLink can still record the run as stopped.
    """
    def targets() -> list[int]:
        pids = processes_of(flwr_home)
        return [p for p in pids if not (spare_superlink and "flower-superlink" in cmdline(p))]

    victims = targets()
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in targets():
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while targets() and time.monotonic() < deadline:
            time.sleep(0.2)
        if not targets():
            break
    return victims


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the SuperLink's bind decides)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def listening_pids(port: int, pids: list[int]) -> list[int]:
    """Those of ``pids`` that hold the listening TCP socket of ``port`` (read from /proc)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if len(cols) > 9 and cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{cols[9]}]")
    owners = []
    for pid in pids:
        try:
            fds = list(Path(f"/proc/{pid}/fd").iterdir())
        except OSError:
            continue
        if any(_readlink(fd) in inodes for fd in fds):
            owners.append(pid)
    return owners


def _readlink(path: Path) -> str:
    try:
        return os.readlink(path)
    except OSError:
        return ""


# ------------------------------------------------------------------ the private SuperLink
class LocalFlower:
    """A private Flower home and SuperLink for one run; ``env`` is what every ``flwr`` call uses."""

    def __init__(self, home: Path | None = None, *, say: Callable[[str], None] = print) -> None:
        self.owned = home is None  # a temporary home is removed by close()
        self.home = Path(tempfile.mkdtemp(prefix="fl-dp-flower-")) if home is None else home
        self.home = self.home.resolve()
        self.say = say
        self.port: int | None = None
        self.bin = Path(sys.executable).parent
        self.env = {**os.environ, "FLWR_HOME": str(self.home), "FLWR_TELEMETRY_ENABLED": "0",
                    "FLWR_DISABLE_UPDATE_CHECK": "1", "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
                    "PATH": f"{self.bin}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONWARNINGS": "ignore"}

    @property
    def log_file(self) -> Path:
        return self.home / "local-superlink" / "superlink.log"

    def start(self, cwd: Path) -> None:
        """Start the SuperLink (cwd: the ServerApp's working directory) and point ``flwr`` at it."""
        self.home.mkdir(mode=0o700, parents=True, exist_ok=True)
        self.log_file.parent.mkdir(mode=0o700, exist_ok=True)
        for _ in range(START_ATTEMPTS):
            port = free_port()
            if self._start_on(port, cwd):
                self.port = port
                config = (f'[superlink]\ndefault = "{CONNECTION}"\n\n[superlink.{CONNECTION}]\n'
                          f'address = "127.0.0.1:{port}"\ninsecure = true\n')
                fd = os.open(self.home / "config.toml", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w") as f:
                    f.write(config)
                return
        raise FlowerStartError(f"the local SuperLink exited at start on {START_ATTEMPTS} free ports; "
                               f"see its log {self.log_file}")

    def _start_on(self, port: int, cwd: Path) -> bool:
        """True once a SuperLink of this home listens on ``port``; False if it exited first."""
        command = [str(self.bin / "flower-superlink"), "--insecure", "--simulation", "--isolation", "subprocess",
                   "--host", "127.0.0.1", "--port", str(port), "--database", str(self.home / "local-superlink" /
                   "state.db"), "--log-file", str(self.log_file)]
        try:
            proc = subprocess.Popen(command, env=self.env, cwd=cwd, stdout=subprocess.DEVNULL,
                                    stderr=subprocess.DEVNULL, start_new_session=True)
        except OSError as err:
            raise FlowerStartError(f"cannot start flower-superlink: {err}") from None
        start = last_said = time.monotonic()
        while proc.poll() is None:
            if _healthy(port) and listening_pids(port, [proc.pid]):
                return True
            now = time.monotonic()
            if now - start > START_PATIENCE:
                proc.kill()
                raise FlowerStartError(f"the local SuperLink did not answer within {START_PATIENCE:.0f}s although "
                                       f"it is running; see its log {self.log_file}")
            if now - last_said >= 15.0:
                last_said = now
                self.say(f"waiting for the local SuperLink on 127.0.0.1:{port} to answer ({now - start:.0f} s; "
                         "the machine is busy)")
            time.sleep(0.3)
        return False

    def flwr(self, *args: str, cwd: Path, timeout: float = 120) -> subprocess.CompletedProcess:
        """A blocking ``flwr`` call against this home's SuperLink."""
        return subprocess.run([str(self.bin / "flwr"), *args], check=False, env=self.env, cwd=cwd, capture_output=True,
                              text=True, timeout=timeout)

    def close(self) -> None:
        """Stop every process of this home; remove the home if it is a temporary one."""
        stop_processes(self.home)
        if self.owned:
            shutil.rmtree(self.home, ignore_errors=True)


def _healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return 200 <= r.status < 300
    except (OSError, ValueError):
        return False


def parse_json_output(text: str) -> dict[str, Any]:
    """The JSON object in a ``flwr ... --format json`` output ({} when there is none)."""
    text = ANSI.sub("", text)
    try:
        data = json.loads(text[text.find("{"):text.rfind("}") + 1])
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


# ------------------------------------------------------------------ status calls
class StatusPoller:
    """``flwr ls --run-id`` in the background, retried with exponential backoff.

    :meth:`poll` never blocks and never raises: it starts a call when one is due, collects a
    finished one, kills one that ran past ``call_timeout`` (a failure), and returns the latest
    status read (``{}`` until one was). After a failure the next call waits ``interval`` x 2^k
    seconds (k = failures in a row), at most ``max_backoff``.
    """

    def __init__(self, command: list[str], env: dict[str, str], cwd: Path, *, interval: float = 2.0,
                 call_timeout: float = 120.0, max_backoff: float = 60.0) -> None:
        self.command, self.env, self.cwd = command, env, cwd
        self.interval, self.call_timeout, self.max_backoff = interval, call_timeout, max_backoff
        self.latest: dict[str, Any] = {}
        self.failures = 0  # in a row
        self.last_error = ""
        self._proc: subprocess.Popen | None = None
        self._started = 0.0
        self._next = 0.0
        self._out: Any = None

    def poll(self) -> dict[str, Any]:
        now = time.monotonic()
        if self._proc is not None:
            if self._proc.poll() is None:
                if now - self._started > self.call_timeout:
                    self._kill()
                    self._failed(f"`flwr ls` gave no answer within {self.call_timeout:.0f}s", now)
                return self.latest
            self._collect(now)
        if self._proc is None and now >= self._next:
            self._launch(now)
        return self.latest

    @property
    def next_in(self) -> float:
        """Seconds until the next call is due (0 when one is running or due)."""
        return 0.0 if self._proc is not None else max(self._next - time.monotonic(), 0.0)

    def close(self) -> None:
        if self._proc is not None:
            self._kill()

    def _launch(self, now: float) -> None:
        self._out = tempfile.TemporaryFile("w+")  # noqa: SIM115 (closed by _collect or _kill)
        try:
            self._proc = subprocess.Popen(self.command, env=self.env, cwd=self.cwd, stdout=self._out,
                                          stderr=subprocess.STDOUT, text=True, start_new_session=True)
        except OSError as err:
            self._proc = None
            self._out.close()
            self._failed(f"cannot run `flwr ls`: {err}", now)
            return
        self._started = now

    def _collect(self, now: float) -> None:
        assert self._proc is not None
        code = self._proc.returncode
        self._proc = None
        self._out.seek(0)
        text = self._out.read()
        self._out.close()
        runs = parse_json_output(text).get("runs") if code == 0 else None
        if not isinstance(runs, list) or not runs or not isinstance(runs[0], dict):
            last = ANSI.sub("", text).strip().splitlines()[-1:] or ["no output"]
            self._failed(f"`flwr ls` exited {code}: {last[0][:200]}", now)
            return
        self.latest, self.failures, self._next = runs[0], 0, now + self.interval

    def _failed(self, why: str, now: float) -> None:
        self.failures += 1
        self.last_error = why
        self._next = now + min(self.interval * 2 ** self.failures, self.max_backoff)

    def _kill(self) -> None:
        assert self._proc is not None
        try:
            os.killpg(self._proc.pid, signal.SIGKILL)
        except OSError:
            pass
        self._proc.wait()
        self._proc = None
        self._out.close()

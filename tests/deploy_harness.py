"""Run Flower 1.41's deployment engine (SuperLink + SuperNodes) as local processes on loopback.

Used by tests/integration/test_deployment.py. Stdlib only in the test process; the Flower executables come
from the interpreter's ``bin/`` (the project venv), which is also put first on ``PATH`` (the
SuperLink/SuperNode spawn ``flower-superexec`` by name).

- TLS and SuperNode authentication as in production: ``docker/gen-certs.sh`` makes the CA, the
  SuperLink certificate (SAN 127.0.0.1) and OpenSSH EC key pairs; the SuperLink runs with
  ``--ssl-* --enable-supernode-auth``; keys are registered with ``flwr supernode register``.
- One ``FLWR_HOME`` per component and one for the CLI (``config.toml`` with an absolute
  ``root-certificates``); free ports; ``FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1``.
- Every process starts in its own session (``start_new_session``) and carries a unique
  environment marker, so teardown can find the SuperExec/ServerApp/ClientApp processes the
  SuperLink/SuperNodes spawned (they run in their own sessions) and nothing else.
- Every wait, ``flwr`` CLI calls included, fails only after ``QUIET`` seconds without progress
  (growth of any process log, of the CLI call's own output, or of files the test names), with
  ``HARD_LIMIT`` as a generous cap on the whole wait: a loaded machine that is still working gets
  more time, a stuck one fails.
"""

from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import ssl
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

ROOT = Path(__file__).resolve().parents[1]
QUIET = 240.0        # seconds a wait tolerates without any progress
HARD_LIMIT = 1200.0  # seconds any single wait may take in all, progress or not
UMASK = 0o077        # as docs/deployment.md §2.3 runs every component (systemd UMask=0077)
GEN_CERTS = ROOT / "docker" / "gen-certs.sh"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def last_json(text: str):
    """The JSON object printed last by a ``flwr ... --format json`` command."""
    text = ANSI.sub("", text)
    start = text.find("{")
    if start < 0:
        raise ValueError(f"no JSON in: {text!r}")
    return json.loads(text[start:text.rfind("}") + 1])


# ------------------------------------------------------------------ /proc helpers
def _stat(pid: int) -> tuple[str, int] | None:
    """(state, ppid) of a process, None if it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    rest = raw[raw.rfind(")") + 2:].split()
    return rest[0], int(rest[1])


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def alive(pid: int) -> bool:
    st = _stat(pid)
    return st is not None and st[0] != "Z"


def descendants(pid: int) -> list[int]:
    """All live descendants of ``pid`` (by parent pid, any session)."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            st = _stat(int(d.name))
            if st is not None and st[0] != "Z":
                children.setdefault(st[1], []).append(int(d.name))
    out, todo = [], [pid]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def pids_with_marker(marker: str) -> list[int]:
    """Live processes whose environment carries our marker (never the test process itself)."""
    pids, needle = [], f"FLWR_DEPLOY_TEST_MARKER={marker}".encode()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            if needle in (d / "environ").read_bytes() and alive(int(d.name)):
                pids.append(int(d.name))
        except OSError:
            continue
    return pids


def kill_tree(pid: int, sig: int = signal.SIGKILL) -> list[int]:
    """Send ``sig`` to ``pid``, its process group if it leads one, and every descendant (collected
    first). Returns the pids signalled."""
    victims = [pid, *descendants(pid)]
    try:
        if os.getpgid(pid) == pid:  # start_new_session=True => pgid == pid
            os.killpg(pid, sig)
    except ProcessLookupError:
        pass
    for v in victims:
        try:
            os.kill(v, sig)
        except ProcessLookupError:
            pass
    return victims


def wait_until(cond: Callable[[], object], timeout: float, what: str, *, interval: float = 0.25,
               check: Callable[[], None] | None = None, progress: Callable[[], object] | None = None,
               hard_limit: float = HARD_LIMIT):
    """Poll ``cond`` until truthy (returned) or raise TimeoutError naming ``what``.

    Without ``progress``, ``timeout`` is a plain deadline. With it, ``timeout`` is the longest
    time allowed *without progress* (``progress()`` returning a new value): a loaded machine that
    is still working gets more time, a stuck one fails after ``timeout`` quiet seconds, and
    ``hard_limit`` bounds the whole wait.
    """
    start = last_change = time.monotonic()
    seen = progress() if progress is not None else None
    while True:
        if check is not None:
            check()
        value = cond()
        if value:
            return value
        now = time.monotonic()
        if progress is not None:
            current = progress()
            if current != seen:
                seen, last_change = current, now
        if now - last_change >= timeout or now - start >= hard_limit:
            quiet = "" if progress is None else f" ({now - last_change:.0f}s without progress)"
            raise TimeoutError(f"timed out after {now - start:.0f}s waiting for {what}{quiet}")
        time.sleep(interval)


# ------------------------------------------------------------------ certificates
def generate_certs(out_dir: Path, supernodes: int = 3) -> Path:
    """Run docker/gen-certs.sh (TLS CA + SuperLink cert + SuperNode key pairs) into ``out_dir``."""
    r = subprocess.run(["bash", str(GEN_CERTS), str(out_dir), "--supernodes", str(supernodes)],
                       capture_output=True, text=True, timeout=HARD_LIMIT)
    if r.returncode != 0:
        raise RuntimeError(f"gen-certs.sh failed ({r.returncode}):\n{r.stdout}\n{r.stderr}")
    return out_dir


# ------------------------------------------------------------------ federation
@dataclass
class Proc:
    name: str
    popen: subprocess.Popen
    log: Path
    fh: object = None

    @property
    def pid(self) -> int:
        return self.popen.pid

    def text(self) -> str:
        try:
            return ANSI.sub("", self.log.read_text(errors="replace"))
        except OSError:
            return ""


@dataclass
class Federation:
    """One TLS SuperLink with SuperNode authentication, plus SuperNodes started on demand."""

    workdir: Path
    app_dir: Path = ROOT
    supernode_keys: int = 3
    bin_dir: Path = field(default_factory=lambda: Path(sys.executable).parent)
    conn: str = "deploy-test"
    procs: list[Proc] = field(default_factory=list)
    nodes: list[Proc] = field(default_factory=list)
    superlink: Proc | None = None

    def __post_init__(self) -> None:
        self.marker = uuid.uuid4().hex
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.certs = generate_certs(self.workdir / "certs", self.supernode_keys)
        self.ca = self.certs / "ca.crt"
        self.env = dict(os.environ)
        self.env.update({
            "PATH": f"{self.bin_dir}{os.pathsep}{self.env.get('PATH', '')}",
            "FLWR_TELEMETRY_ENABLED": "0",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "PYTHONUNBUFFERED": "1",
            "FLWR_DEPLOY_TEST_MARKER": self.marker,
        })
        self.env.pop("FLWR_HOME", None)
        self.cli_home = self.workdir / "home-cli"
        self.cli_home.mkdir(exist_ok=True)
        self._new_link_port()

    def _new_link_port(self) -> None:
        """A free port for the SuperLink, and the flwr CLI's config pointing at it."""
        self.link_port = free_port()
        (self.cli_home / "config.toml").write_text(
            f'[superlink]\ndefault = "{self.conn}"\n\n'
            f'[superlink.{self.conn}]\naddress = "127.0.0.1:{self.link_port}"\n'
            f'root-certificates = "{self.ca.resolve()}"\n')

    # -------------------------------------------------------------- processes
    def spawn(self, name: str, args: list[str], home: str) -> Proc:
        flwr_home = self.workdir / f"home-{home}"
        flwr_home.mkdir(mode=0o700, exist_ok=True)  # as docs/deployment.md §2.3 creates it
        env = dict(self.env, FLWR_HOME=str(flwr_home))
        log = self.workdir / f"{name}.log"
        fh = open(log, "ab")
        popen = subprocess.Popen(args, env=env, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                 start_new_session=True, cwd=self.workdir, umask=UMASK)
        proc = Proc(name, popen, log, fh)
        self.procs.append(proc)
        return proc

    def start_superlink(self, quiet: float = QUIET, *, database: Path | None = None) -> None:
        """Start the SuperLink and wait for /health. The port was free when chosen, but another test's process
        (parallel workers) may bind it first: then a new port is chosen, up to three times."""
        for attempt in range(3):
            try:
                return self._start_superlink(quiet, database)
            except RuntimeError as err:
                if "address already in use" not in str(err) or attempt == 2:
                    raise
                self.procs.remove(self.superlink)
                if hasattr(self.superlink.fh, "close"):
                    self.superlink.fh.close()
                self._new_link_port()

    def _start_superlink(self, quiet: float, database: Path | None) -> None:
        link = self.certs / "superlink"
        self.superlink = self.spawn("superlink", [
            str(self.bin_dir / "flower-superlink"),
            "--ssl-ca-certfile", str(self.ca), "--ssl-certfile", str(link / "server.pem"),
            "--ssl-keyfile", str(link / "server.key"), "--enable-supernode-auth",
            "--host", "127.0.0.1", "--port", str(self.link_port),
            "--disable-runtime-dependency-installation",
            *(["--database", str(database)] if database is not None else []),
        ], "superlink")
        wait_until(self.healthy, quiet, "SuperLink /health over HTTPS", check=self._check_alive([self.superlink]),
                   progress=self.progress)

    def healthy(self) -> bool:
        ctx = ssl.create_default_context(cafile=str(self.ca))
        try:
            with urllib.request.urlopen(f"https://127.0.0.1:{self.link_port}/health", timeout=2, context=ctx) as r:
                return r.status == 200
        except (urllib.error.URLError, ConnectionError, OSError, ssl.SSLError):
            return False

    def key(self, i: int) -> Path:
        """Private key of SuperNode i (1-based, as made by gen-certs.sh)."""
        return self.certs / "keys" / f"supernode-{i}"

    def register(self, i: int) -> int:
        """``flwr supernode register`` of key i; returns the node id."""
        r = self.cli("supernode", "register", str(self.key(i)) + ".pub", self.conn, "--name", f"sn{i}",
                     "--format", "json")
        if r.returncode != 0:
            raise RuntimeError(f"flwr supernode register failed: {r.stdout}\n{r.stderr}")
        return int(last_json(r.stdout)["node-id"])

    def start_supernode(self, i: int, node_config: str, *, max_wait: float = 60, name: str | None = None) -> Proc:
        proc = self.spawn(name or f"supernode{i}", [
            str(self.bin_dir / "flower-supernode"),
            "--root-certificates", str(self.ca), "--superlink", f"127.0.0.1:{self.link_port}",
            "--auth-supernode-private-key", str(self.key(i)),
            "--host", "127.0.0.1", "--port", str(free_port()),
            "--node-config", node_config, "--max-wait-time", str(max_wait),
        ], f"sn{i}")
        return proc

    def start_nodes(self, configs: Iterable[str], quiet: float = QUIET) -> list[int]:
        """Register keys 1..n, start those SuperNodes, wait until all are online; returns node ids."""
        ids = []
        for i, cfg in enumerate(configs, start=1):
            ids.append(self.register(i))
            self.nodes.append(self.start_supernode(i, cfg))
        wait_until(lambda: set(ids) <= self.online_ids(), quiet, f"{len(ids)} SuperNodes online",
                   interval=0.5, check=self._check_alive([self.superlink, *self.nodes]), progress=self.progress)
        return ids

    def online_ids(self) -> set[int]:
        try:
            nodes = last_json(self.cli("supernode", "ls", self.conn, "--format", "json").stdout)["nodes"]
        except (ValueError, KeyError):
            return set()
        return {int(n["node-id"]) for n in nodes if n.get("status") == "online"}

    def _check_alive(self, procs: list[Proc | None]) -> Callable[[], None]:
        def check() -> None:
            for p in procs:
                if p is not None and p.popen.poll() is not None:
                    raise RuntimeError(f"{p.name} exited early (rc={p.popen.returncode}):\n{self.tail(p)}")
        return check

    # -------------------------------------------------------------- CLI
    def cli(self, *args: str, quiet: float = QUIET) -> subprocess.CompletedProcess:
        """``flwr *args`` with this federation's CLI home. It may take as long as the federation keeps
        making progress (:meth:`progress`, or the command's own output growing); it is killed and
        TimeoutError raised after ``quiet`` seconds without any, or after ``HARD_LIMIT``."""
        argv = [str(self.bin_dir / "flwr"), *args]
        with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
            popen = subprocess.Popen(argv, env=dict(self.env, FLWR_HOME=str(self.cli_home)), stdout=out,
                                     stderr=err, stdin=subprocess.DEVNULL, cwd=self.workdir)
            try:
                wait_until(lambda: popen.poll() is not None, quiet, f"`flwr {' '.join(args[:2])}` to return",
                           interval=0.05, progress=lambda: (self.progress(), os.fstat(out.fileno()).st_size,
                                                            os.fstat(err.fileno()).st_size))
            finally:
                if popen.poll() is None:
                    popen.kill()
                    popen.wait(10)
            out.seek(0)
            err.seek(0)
            return subprocess.CompletedProcess(argv, popen.returncode, out.read().decode(errors="replace"),
                                               err.read().decode(errors="replace"))

    def submit(self, run_config: str) -> int:
        """``flwr run <app> <conn> --run-config ... --format json``; returns the run id."""
        r = self.cli("run", str(self.app_dir), self.conn, "--run-config", run_config, "--format", "json")
        if r.returncode != 0:
            raise RuntimeError(f"flwr run failed (rc={r.returncode}): {r.stdout}\n{r.stderr}")
        data = last_json(r.stdout)
        if not data.get("success"):
            raise RuntimeError(f"flwr run did not succeed: {r.stdout}\n{r.stderr}")
        return int(data["run-id"])

    def run_info(self, run_id: int) -> dict:
        r = self.cli("ls", self.conn, "--run-id", str(run_id), "--format", "json")
        return last_json(r.stdout)["runs"][0]

    def status(self, run_id: int) -> str:
        try:
            return self.run_info(run_id)["status"]
        except (ValueError, KeyError, IndexError):
            return ""

    def progress(self, *extra: Path) -> tuple[int, ...]:
        """Bytes written so far to every process log (and to ``extra`` files, e.g. a ledger): it
        changes while the federation works, however slowly a loaded machine runs it."""
        sizes = []
        for path in [p.log for p in self.procs] + list(extra):
            try:
                sizes.append(path.stat().st_size)
            except OSError:
                sizes.append(-1)
        return tuple(sizes)

    def wait_finished(self, run_id: int, quiet: float, *, extra: tuple[Path, ...] = (),
                      interval: float = 2.0) -> dict:
        """Poll ``flwr ls`` until the run's status is ``finished:*``. Fails (and ``flwr stop`` s the
        run) only after ``quiet`` seconds without progress (see :meth:`progress`)."""
        state: dict = {}

        def finished():
            state["info"] = self.run_info(run_id)
            return state["info"]["status"].startswith("finished")

        try:
            wait_until(finished, quiet, f"run {run_id} to finish", interval=interval,
                       progress=lambda: self.progress(*extra))
        except TimeoutError as err:
            self.cli("stop", str(run_id), self.conn)
            raise TimeoutError(f"{err}\n{self.logs(run_id)[-4000:]}\n"
                               + "\n".join(self.tail(p) for p in self.procs)) from None
        return state["info"]

    def logs(self, run_id: int) -> str:
        """``flwr log ID --show`` (the default ``--stream`` blocks until the run ends)."""
        r = self.cli("log", str(run_id), self.conn, "--show")
        return ANSI.sub("", r.stdout + r.stderr)

    # -------------------------------------------------------------- process tree
    def serverapp_pids(self) -> list[int]:
        """flwr-serverapp processes below our SuperLink (subprocess isolation)."""
        if self.superlink is None:
            return []
        return [p for p in descendants(self.superlink.pid) if "flwr-serverapp" in cmdline(p)]

    def clientapp_pids(self, node: Proc) -> list[int]:
        return [p for p in descendants(node.pid) if "flwr-clientapp" in cmdline(p)]

    # -------------------------------------------------------------- teardown
    def stop(self, grace: float = 10) -> None:
        for group in (self.nodes + [p for p in self.procs if p not in self.nodes and p is not self.superlink],
                      [self.superlink]):
            group = [p for p in group if p is not None and p.popen.poll() is None]
            for p in group:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
            for p in group:
                try:
                    p.popen.wait(grace)  # reap: SuperExec's parent watchdog cannot see zombies
                except subprocess.TimeoutExpired:
                    kill_tree(p.pid)
                    p.popen.wait(5)
        for p in self.procs:  # reap anything killed earlier by a test
            try:
                p.popen.wait(5)
            except subprocess.TimeoutExpired:
                kill_tree(p.pid)
        deadline = time.monotonic() + grace
        while pids_with_marker(self.marker) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in pids_with_marker(self.marker):  # orphaned SuperExec / flwr-*app of OUR federation only
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        wait_until(lambda: not pids_with_marker(self.marker), 10, "our processes to exit")
        for p in self.procs:
            if p.fh:
                p.fh.close()

    def tail(self, p: Proc, n: int = 3000) -> str:
        return f"--- {p.name} (rc={p.popen.poll()}) ---\n" + p.text()[-n:]


def scrape(port: int, timeout: float = 1.0, *, cafile: Path | None = None,
           basic_auth: str | None = None) -> dict[str, float] | None:
    """Prometheus text exposition at http(s)://127.0.0.1:port/metrics as {series: value}; None if
    down. ``cafile``: HTTPS verified against that CA; ``basic_auth``: ``"user:password"``."""
    scheme = "https" if cafile else "http"
    req = urllib.request.Request(f"{scheme}://127.0.0.1:{port}/metrics")
    if basic_auth:
        req.add_header("Authorization", "Basic " + base64.b64encode(basic_auth.encode()).decode())
    ctx = ssl.create_default_context(cafile=str(cafile)) if cafile else None
    try:
        with urllib.request.urlopen(req, timeout=timeout, context=ctx) as r:
            text = r.read().decode()
    except (urllib.error.URLError, ConnectionError, OSError):
        return None
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        try:
            out[name] = float(value)
        except ValueError:
            continue
    return out

"""Static checks of docker/ (no Docker engine needed) and of docker/gen-certs.sh.

Every compose file is parsed with PyYAML; every CLI flag used in a compose command must be a
current, non-deprecated flag of the installed ``flower-superlink`` / ``flower-supernode`` /
``flower-superexec`` (their ``--help``); certificates, keys and outputs must be mounted as
described in docs/deployment.md; Dockerfiles must not enable runtime dependency installation.
gen-certs.sh is run into a temporary directory and its output inspected with openssl/ssh-keygen.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCKER = ROOT / "docker"
BIN = Path(sys.executable).parent
COMPOSE_FILES = sorted(DOCKER.glob("compose*.yml"))
DOCKERFILES = sorted(DOCKER.glob("*Dockerfile"))
GUARDRAILS = ("min-sigma", "max-clip-norm", "max-local-steps", "max-lr")
# values for the ${VAR:?...} placeholders of compose.supernode.yml
ENV = {"SUPERLINK_ADDRESS": "flower.example.org:8000", "SUPERNODE_INDEX": "3", "PARTITION_ID": "2",
       "NUM_PARTITIONS": "10", "GPU_DEVICE": "1"}
INTERP = re.compile(r"\$\{([A-Z_][A-Z0-9_]*)(?::?([-?])([^}]*))?\}")


def interpolate(value):
    """Compose-style ${VAR}, ${VAR:-default}, ${VAR:?error} with ENV (unset -> default)."""
    if isinstance(value, str):
        def sub(m):
            name, op, arg = m.group(1), m.group(2), m.group(3)
            if name in ENV:
                return ENV[name]
            if op == "-":
                return arg
            raise AssertionError(f"${{{name}}} has no default and no test value")
        return INTERP.sub(sub, value)
    if isinstance(value, list):
        return [interpolate(v) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v) for k, v in value.items()}
    return value


@functools.cache
def compose(path: Path) -> dict:
    return interpolate(yaml.safe_load(path.read_text()))


@functools.cache
def help_flags(exe: str) -> dict[str, str]:
    """{--flag: help text} of an installed Flower executable."""
    env = dict(os.environ, FLWR_TELEMETRY_ENABLED="0", FLWR_DISABLE_UPDATE_CHECK="1")
    out = subprocess.run([str(BIN / exe), "--help"], capture_output=True, text=True, timeout=120, env=env).stdout
    options = out[out.index("options:"):]
    flags: dict[str, str] = {}
    current = None
    for line in options.splitlines()[1:]:
        m = re.match(r"^  (?:-\w(?: \S+)?, )?(--[a-z0-9-]+)(.*)$", line)
        if m:
            current = m.group(1)
            flags[current] = m.group(2)
        elif current:
            flags[current] += " " + line.strip()
    assert "--help" in flags and len(flags) > 5, out
    return flags


def deprecated(exe: str) -> set[str]:
    return {f for f, text in help_flags(exe).items() if "deprecated" in text.lower()}


PROMETHEUS_IMAGE = "prom/prometheus:"


def executable(service: dict) -> str:
    """Which Flower executable a service's container runs (from its image or Dockerfile)."""
    if "entrypoint" in service:
        return "custom"
    image = service.get("image", "")
    if image.startswith(PROMETHEUS_IMAGE):
        return "custom"
    dockerfile = (service.get("build") or {}).get("dockerfile", "")
    for exe, key in (("flower-superlink", "superlink"), ("flower-supernode", "supernode"),
                     ("flower-superexec", "superexec")):
        if re.search(rf"(^|/)(flwr|fl-dp-flower)/{key}:", image) or key in Path(dockerfile).name:
            return exe
    raise AssertionError(f"cannot tell which program image {image!r} runs")


def services(kind: str | None = None):
    for path in COMPOSE_FILES:
        for name, svc in compose(path)["services"].items():
            if kind is None or executable(svc) == kind:
                yield path, name, svc


def arg(cmd: list[str], flag: str) -> str:
    assert flag in cmd, f"{flag} missing from {cmd}"
    return cmd[cmd.index(flag) + 1]


def mounts(svc: dict) -> dict[str, tuple[str, str]]:
    """{container path: (source, mode)} of a service's short-syntax volumes."""
    out = {}
    for v in svc.get("volumes", []):
        parts = v.split(":")
        assert len(parts) in (2, 3), v
        out[parts[1]] = (parts[0], parts[2] if len(parts) == 3 else "rw")
    return out


# ------------------------------------------------------------------ structure
def test_compose_files_exist():
    names = {p.name for p in COMPOSE_FILES}
    assert {"compose.yml", "compose.server.yml", "compose.supernode.yml"} <= names


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_every_service_has_an_image_or_a_buildable_dockerfile(path):
    data = compose(path)
    assert data["services"]
    built = {svc["image"] for svc in data["services"].values() if "build" in svc}
    for name, svc in data["services"].items():
        assert "image" in svc or "build" in svc, name
        if "build" in svc:
            context = (path.parent / svc["build"]["context"]).resolve()
            assert context.is_dir(), (name, context)
            assert (context / svc["build"]["dockerfile"]).is_file(), name
        elif svc["image"].startswith(PROMETHEUS_IMAGE):
            assert re.fullmatch(r"prom/prometheus:v\d+\.\d+\.\d+", svc["image"]), svc["image"]  # pinned
        elif not svc["image"].startswith("flwr/"):
            assert svc["image"] in built and svc.get("pull_policy") == "never", (name, svc["image"])
        image = svc.get("image", "")
        if image.startswith("flwr/"):
            assert re.fullmatch(r"flwr/(superlink|supernode|superexec):1\.41\.\d+(-[\w.-]+)?", image), image
    for vol in {m[0] for svc in data["services"].values() for m in mounts(svc).values()}:
        if not vol.startswith((".", "/")):
            assert vol in (data.get("volumes") or {}), f"named volume {vol} not declared"


@pytest.mark.parametrize("path", COMPOSE_FILES, ids=lambda p: p.name)
def test_restart_policy(path):
    for name, svc in compose(path)["services"].items():
        if "entrypoint" in svc:  # one-shot job (key registration)
            assert svc.get("restart") == "no", name
        else:
            assert svc.get("restart") == "unless-stopped", name


def test_every_flag_is_a_current_flag_of_the_installed_flower():
    seen = set()
    for path, name, svc in services():
        exe = executable(svc)
        if exe == "custom":
            continue
        cmd = svc.get("command")
        assert isinstance(cmd, list) and cmd, f"{path.name}:{name}: command must be a list"
        valid = help_flags(exe)
        for token in cmd:
            if token.startswith("--"):
                flag = token.split("=", 1)[0]
                assert flag in valid, f"{path.name}:{name}: {flag} is not a flag of {exe} {sorted(valid)}"
                assert flag not in deprecated(exe), f"{path.name}:{name}: {flag} is deprecated in {exe}"
                seen.add((exe, flag))
        assert "--allow-runtime-dependency-installation" not in cmd
        assert "--insecure" not in cmd, f"{path.name}:{name}: compose files are for real deployments (TLS)"
    assert ("flower-superlink", "--enable-supernode-auth") in seen
    assert ("flower-supernode", "--auth-supernode-private-key") in seen


def test_superlink_services():
    found = 0
    for path, name, svc in services("flower-superlink"):
        found += 1
        cmd, mnt = svc["command"], mounts(svc)
        assert arg(cmd, "--host") == "0.0.0.0"
        port = arg(cmd, "--port")
        assert f"{port}:{port}" in svc["ports"]
        assert "--enable-supernode-auth" in cmd and "--disable-runtime-dependency-installation" in cmd
        assert arg(cmd, "--isolation") == "process"
        for flag in ("--ssl-ca-certfile", "--ssl-certfile", "--ssl-keyfile"):
            target = arg(cmd, flag)
            assert target in mnt and mnt[target][1] == "ro", (path.name, name, flag)
        db = Path(arg(cmd, "--database"))
        assert str(db.parent) in mnt and not mnt[str(db.parent)][0].startswith((".", "/")), "state on a named volume"
    assert found == 2  # compose.yml and compose.server.yml


def test_supernode_services():
    found = 0
    for path, name, svc in services("flower-supernode"):
        found += 1
        cmd, mnt = svc["command"], mounts(svc)
        for flag in ("--root-certificates", "--auth-supernode-private-key", "--ssl-certfile", "--ssl-keyfile",
                     "--ssl-ca-certfile"):
            target = arg(cmd, flag)
            assert target in mnt and mnt[target][1] == "ro", (path.name, name, flag)
        assert arg(cmd, "--isolation") == "process"
        host, _, port = arg(cmd, "--superlink").rpartition(":")
        assert host and port.isdigit()
        from flwr.common.config import parse_config_args
        node_config = parse_config_args([arg(cmd, "--node-config")])
        assert isinstance(node_config["partition-id"], int) and isinstance(node_config["num-partitions"], int)
        assert 0 <= node_config["partition-id"] < node_config["num-partitions"]
        assert node_config["data-dir"] == "/app/data"
        for key in GUARDRAILS:
            assert isinstance(node_config[key], (int, float)) and node_config[key] > 0, key
    assert found == 3
    # compose.yml: distinct partitions
    parts = [arg(s["command"], "--node-config") for p, n, s in services("flower-supernode") if p.name == "compose.yml"]
    assert len(set(parts)) == len(parts) == 2


def test_superexec_services_and_gpu_reservations():
    for path, name, svc in services("flower-superexec"):
        data = compose(path)
        cmd, mnt = svc["command"], mounts(svc)
        assert arg(cmd, "--root-certificates") in mnt and mnt[arg(cmd, "--root-certificates")][1] == "ro"
        host, _, port = arg(cmd, "--runtime-api-address").rpartition(":")
        target = data["services"][host]  # the Runtime API it connects to is a service of the same file
        assert arg(target["command"], "--port") == port
        assert executable(target) in ("flower-superlink", "flower-supernode")
        if executable(target) == "flower-supernode":  # ClientApp executor: GPU, data read-only
            devices = svc["deploy"]["resources"]["reservations"]["devices"]
            assert len(devices) == 1 and devices[0]["driver"] == "nvidia"
            assert "gpu" in devices[0]["capabilities"]
            assert ("count" in devices[0]) != ("device_ids" in devices[0])
            assert mnt["/app/data"][1] == "ro"
        else:  # ServerApp executor: outputs on a named volume, Prometheus published
            source, mode = mnt["/app/outputs"]
            assert mode == "rw" and source in data["volumes"]
            assert "127.0.0.1:9464:9464" in svc["ports"]  # plain HTTP: this host only (docs/deployment.md §3)
    ids = [svc["deploy"]["resources"]["reservations"]["devices"][0]["device_ids"]
           for p, n, svc in services("flower-superexec") if p.name == "compose.yml" and "deploy" in svc]
    assert len(ids) == 2 and ids[0] != ids[1]  # one GPU per ClientApp executor


def test_only_the_superlink_port_is_published_beyond_this_host():
    """The SuperLink's 8000 must reach the GPU hosts; everything else (the ServerApp's plain-HTTP metrics,
    Prometheus' UI) is published on 127.0.0.1 only: the prometheus service scrapes over the compose network."""
    for path, name, svc in services():
        for port in svc.get("ports", []):
            if executable(svc) == "flower-superlink":
                assert port == "8000:8000", (path.name, name, port)
            else:
                assert port.startswith("127.0.0.1:"), (path.name, name, port)


def test_certificate_and_key_mounts_are_read_only():
    for path, name, svc in services():
        for target, (source, mode) in mounts(svc).items():
            if "certs" in source or target.startswith(("/app/certificates", "/app/keys", "/app/registration")):
                assert mode == "ro", (path.name, name, target)


# ------------------------------------------------------------------ Dockerfiles
@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_dockerfile_has_no_runtime_dependency_installation(path):
    text = path.read_text()
    code = "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))
    assert "--allow-runtime-dependency-installation" not in code
    assert "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1" in code
    froms = re.findall(r"^FROM\s+(\S+)", code, re.M)
    assert froms and all(f.startswith("flwr/") for f in froms)
    assert re.search(r"^ARG FLWR_VERSION=1\.41\.\d+$", code, re.M)
    for line in re.findall(r"^(?:ENTRYPOINT|CMD)\s+(.*)$", code, re.M):
        assert not re.search(r"\b(pip|uv|apt-get|conda)\b", line), line
    entry = re.findall(r"^ENTRYPOINT\s+(.*)$", code, re.M)
    assert entry and ("flower-superexec" in entry[-1] or "flower-superlink" in entry[-1])
    for sources in re.findall(r"^COPY\s+(?:--\S+\s+)*(.+)\s+\S+$", code, re.M):
        for src in sources.split():
            assert (ROOT / src).exists(), f"COPY source {src} does not exist"


def test_superexec_image_installs_the_app_at_build_time():
    code = (DOCKER / "superexec.Dockerfile").read_text()
    assert "py3.11" in code  # pyproject: requires-python >=3.11,<3.12
    assert "pip install -c constraints.txt -r /tmp/requirements.txt" in code and "pip install --no-deps ." in code
    assert "import flwr, torch, fl_dp_flower.app.serverapp, fl_dp_flower.app.clientapp" in code
    # torch/torchvision at the tested versions (scripts/constraints.txt), not the newest the ranges allow
    assert "COPY --chown=app:app scripts/constraints.txt ./constraints.txt" in code
    ignore = (DOCKER / "superexec.Dockerfile.dockerignore").read_text().splitlines()
    assert "!scripts/constraints.txt" in ignore  # in the build context
    pins = dict(line.split("==") for line in (ROOT / "scripts" / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert {"torch", "torchvision"} <= set(pins)
    install = (ROOT / "docs" / "deployment.md").read_text()
    assert f"torch=={pins['torch']} torchvision=={pins['torchvision']}" in install  # §2.1's CPU install line


# ------------------------------------------------------------------ gen-certs.sh
def _san(cert: Path) -> set[str]:
    text = subprocess.run(["openssl", "x509", "-in", str(cert), "-noout", "-text"], capture_output=True,
                          text=True, check=True).stdout
    line = text[text.index("Subject Alternative Name"):].splitlines()[1]
    return {item.strip().replace("IP Address:", "IP:") for item in line.split(",")}


def _snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.skipif(not (shutil.which("openssl") and shutil.which("ssh-keygen")), reason="needs openssl, ssh-keygen")
def test_gen_certs(tmp_path):
    out = tmp_path / "certs"

    def run(*a: str) -> subprocess.CompletedProcess:
        return subprocess.run(["bash", str(DOCKER / "gen-certs.sh"), str(out), *a], capture_output=True,
                              text=True, timeout=120)

    r = run("--supernodes", "2", "--san", "IP:10.77.0.1", "--san", "DNS:flower.example.org")
    assert r.returncode == 0, r.stderr
    first = _snapshot(out)
    r = run("--supernodes", "2", "--san", "IP:10.77.0.1", "--san", "DNS:flower.example.org")
    assert r.returncode == 0, r.stderr
    assert _snapshot(out) == first, "a second run with the same arguments must change nothing"

    ca = out / "ca.crt"
    link = out / "superlink" / "server.pem"
    subprocess.run(["openssl", "verify", "-CAfile", str(ca), str(link)], check=True, capture_output=True)
    san = _san(link)
    long_running = {name for name, svc in compose(DOCKER / "compose.yml")["services"].items()
                    if executable(svc) != "custom"}  # Flower services (Prometheus serves no TLS of ours)
    assert {"IP:127.0.0.1", "DNS:localhost", "IP:10.77.0.1", "DNS:flower.example.org"} <= san
    assert {f"DNS:{n}" for n in long_running} <= san, (long_running, san)
    for i in (1, 2):
        runtime = out / f"supernode-{i}" / "runtime.pem"
        subprocess.run(["openssl", "verify", "-CAfile", str(ca), str(runtime)], check=True, capture_output=True)
        assert {f"DNS:supernode-{i}", "DNS:supernode", "IP:127.0.0.1"} <= _san(runtime)

    # SuperNode keys: what flower-supernode --auth-supernode-private-key / flwr supernode register load
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.serialization import load_ssh_private_key, load_ssh_public_key
    from flwr.supercore.primitives.asymmetric import uses_nist_ec_curve
    csv = (out / "supernodes.csv").read_text().splitlines()
    assert csv[0].startswith("name,partition_id,public_key_file") and len(csv) == 3
    for i in (1, 2):
        key = out / "keys" / f"supernode-{i}"
        assert (key.stat().st_mode & 0o077) == 0, "private key must be owner-only"
        priv = load_ssh_private_key(key.read_bytes(), None)
        pub = load_ssh_public_key((out / "keys" / f"supernode-{i}.pub").read_bytes())
        assert isinstance(priv, ec.EllipticCurvePrivateKey) and uses_nist_ec_curve(pub)
        assert priv.public_key().public_numbers() == pub.public_numbers()
        assert f"supernode-{i},{i - 1},keys/supernode-{i}.pub," in csv[i]
    assert "root-certificates" in (out / "cli" / "config.toml").read_text()
    assert os.access(out / "register-supernodes.sh", os.X_OK)

    # a new SAN re-issues the leaf certificate from the same CA, keeps CA and keys
    r = run("--supernodes", "2", "--san", "IP:10.77.0.9")
    assert r.returncode == 0, r.stderr
    after = _snapshot(out)
    assert "IP:10.77.0.9" in _san(link) and "IP:10.77.0.1" not in _san(link)
    for name in ("ca.crt", "ca.key", "keys/supernode-1", "keys/supernode-2.pub", "supernode-1/runtime.pem"):
        assert after[name] == first[name], name
    # bad arguments are rejected
    assert run("--san", "bogus").returncode != 0


# ------------------------------------------------------------------ docs/deployment.md
def _doc_commands() -> list[tuple[str, str, str]]:
    """(section title, executable, command line) of every Flower command in the docs' code blocks."""
    text = (ROOT / "docs" / "deployment.md").read_text()
    out, section = [], ""
    in_block = False
    lines = text.replace("\\\n", " ").splitlines()
    for line in lines:
        if line.startswith("## "):
            section = line
        if line.startswith("```"):
            in_block = not in_block
            continue
        src = line if in_block else (line.split("ExecStart=", 1)[1] if "ExecStart=" in line else "")
        for exe in ("flower-superlink", "flower-supernode", "flower-superexec"):
            m = re.search(rf"(?:^|[\s/]){exe}(\s.*)?$", src)
            if m and "--version" not in src and "--" in (m.group(1) or ""):
                out.append((section, exe, m.group(1) or ""))
    return out


def test_docs_use_current_flags_and_insecure_only_in_the_local_test_section():
    commands = _doc_commands()
    assert {exe for _, exe, _ in commands} >= {"flower-superlink", "flower-supernode"}
    for section, exe, line in commands:
        flags = re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", line)
        valid = help_flags(exe)
        for flag in flags:
            assert flag in valid, f"docs: {flag} is not a flag of {exe}: {line}"
            assert flag not in deprecated(exe), f"docs: {flag} is deprecated in {exe}"
        if "--insecure" in flags:
            assert "Local test only" in section and "INSECURE" in section, (section, line)
        elif exe == "flower-superlink":
            assert "--enable-supernode-auth" in flags and "--ssl-certfile" in flags, line
            assert "--host" in flags and "--disable-runtime-dependency-installation" in flags, line
        elif exe == "flower-supernode":
            assert "--root-certificates" in flags and "--auth-supernode-private-key" in flags, line
    doc = (ROOT / "docs" / "deployment.md").read_text()
    assert "insecure = true" in doc.split("## 6.")[1] and "insecure = true" not in doc.split("## 6.")[0]


@pytest.mark.parametrize("path", [p for p in COMPOSE_FILES if p.name != "compose.supernode.yml"], ids=lambda p: p.name)
def test_prometheus_service_loads_the_shipped_config_and_rules(path):
    svc = compose(path)["services"]["prometheus"]
    assert "--config.file=/etc/prometheus/prometheus.yml" in svc["command"]
    sources = {m.split(":")[0] for m in svc["volumes"]}
    for name in ("prometheus.yml", "alerts.yml"):
        assert f"./prometheus/{name}" in sources and (path.parent / "prometheus" / name).is_file()
    assert all(p.startswith("127.0.0.1:") for p in svc["ports"])  # UI/API on this host only
    scrape = yaml.safe_load((path.parent / "prometheus" / "prometheus.yml").read_text())
    assert scrape["rule_files"] == ["/etc/prometheus/alerts.yml"]
    assert scrape["scrape_configs"][0]["static_configs"][0]["targets"] == ["superexec-serverapp:9464"]

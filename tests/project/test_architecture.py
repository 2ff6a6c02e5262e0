"""The layering the README promises: privacy math imports no torch/flwr/pydantic (and only numpy/scipy, except
privacy/sampled.py and privacy/client_sampling.py, the PLD accountants of client sampling, which use dp-accounting);
reporting no torch/flwr."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PRIVACY = [f"fl_dp_flower.privacy.{m}" for m in
           ("schedules", "records", "gdp", "terms", "planned_terms", "bounds", "closed_forms", "final_model",
            "planned_bounds", "accountant", "report", "planning", "sampled", "sample_sampling", "secure_aggregation",
            "skellam", "plan_rules", "running_sum", "preflight", "pld_rounds")]
REPORTING = [f"fl_dp_flower.reporting.{m}" for m in ("ledger", "console", "prometheus", "plot", "durable",
                                                                "logfilter", "resume", "rounds")]


def _loaded_after_import(modules: list[str]) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize(
    "modules, forbidden",
    [
        (PRIVACY, {"torch", "flwr", "pydantic", "torchvision"}),
        (["fl_dp_flower.app.cli"], {"torch", "flwr", "pydantic", "torchvision", "numpy", "scipy", "matplotlib"}),
        (["fl_dp_flower.app.launcher"], {"torch", "flwr", "torchvision", "numpy", "scipy", "matplotlib"}),
        (REPORTING, {"torch", "flwr", "torchvision"}),
        (["fl_dp_flower.audit.attack"], {"torch", "flwr", "pydantic", "torchvision"}),
    ],
)
def test_layers_do_not_import_heavier_layers(modules, forbidden):
    loaded = _loaded_after_import(modules)
    assert not (loaded & forbidden), f"{modules} pulled in {sorted(loaded & forbidden)}"


def test_every_package_module_is_at_most_400_lines():
    """The project's rule (short modules): split by theme rather than grow past 400 lines."""
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "fl_dp_flower"
    long = {str(p.relative_to(package)): n for p in package.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long


def _runtime_imports(package_dir, module_names):
    """{module: modules of the package it imports at run time} (imports under TYPE_CHECKING excluded)."""
    import ast

    graph = {}
    for name, path in module_names.items():
        tree = ast.parse(path.read_text())
        skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If)
                and getattr(node.test, "id", getattr(node.test, "attr", None)) == "TYPE_CHECKING"
                for n in ast.walk(node)}
        is_pkg = path.name == "__init__.py"
        out = set()
        for node in ast.walk(tree):
            if id(node) in skip:
                continue
            if isinstance(node, ast.ImportFrom):
                parts = name.split(".") if is_pkg else name.split(".")[:-1]
                base = ".".join(parts[:len(parts) - node.level + 1] + ([node.module] if node.module else [])) \
                    if node.level else (node.module or "")
                for alias in node.names:
                    target = f"{base}.{alias.name}" if f"{base}.{alias.name}" in module_names else base
                    out.add(target)
            elif isinstance(node, ast.Import):
                out.update(a.name for a in node.names)
        graph[name] = {t for t in out if t in module_names and t != name}
    return graph


def test_no_import_cycle_in_the_package():
    """Issue 17: dependencies point one way (e.g. cli <-> audit.commands was a cycle)."""
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "fl_dp_flower"
    names = {}
    for path in package.rglob("*.py"):
        parts = ("fl_dp_flower", *path.relative_to(package).with_suffix("").parts)
        names[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph = _runtime_imports(package, names)
    done, stack = set(), []

    def visit(node):
        if node in stack:
            raise AssertionError("import cycle: " + " -> ".join(stack[stack.index(node):] + [node]))
        if node in done:
            return
        stack.append(node)
        for nxt in sorted(graph[node]):
            if nxt.startswith(node + ".") or node.startswith(nxt + "."):
                continue  # a package and its own modules (__init__ re-exports) are one unit
            visit(nxt)
        stack.pop()
        done.add(node)

    for node in sorted(graph):
        visit(node)


def test_only_privacy_sampled_imports_dp_accounting():
    """privacy/ is numpy/scipy only, except the PLD accountants of client sampling: privacy/sampled.py (issue 19
    item 2) and privacy/client_sampling.py (the secret sample, issue 31) are the modules that import dp_accounting."""
    import ast
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "fl_dp_flower"
    users = set()
    for path in package.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            if any(n == "dp_accounting" or n.startswith("dp_accounting.") for n in names):
                users.add(str(path.relative_to(package)))
    assert users == {"privacy/sampled.py", "privacy/client_sampling.py", "privacy/sample_sampling.py"}


def test_a_run_without_client_sampling_does_not_load_dp_accounting():
    """dp-accounting is imported lazily: the accountant of a fixed-size run never loads it."""
    code = ("import sys\n"
            "from fl_dp_flower.privacy.records import AccountantConfig\n"
            "from fl_dp_flower.privacy.accountant import PrivacyAccountant\n"
            "cfg = AccountantConfig()\n"
            "a = PrivacyAccountant(cfg); a.step(cfg.planned_round(1)).to_dict()\n"
            "print('dp_accounting' in sys.modules)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


def _all_imports(path):
    """Every module named by an import of ``path`` (TYPE_CHECKING and function-level imports included)."""
    import ast

    tree = ast.parse(path.read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                names.add("." * node.level + (node.module or ""))
            else:
                names.add(node.module or "")
                names.update(f"{node.module}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


def test_the_library_never_imports_the_reference_app():
    """Issue 29: two floors. Nothing outside fl_dp_flower/app/ imports fl_dp_flower.app (not even for type
    checking or inside a function), and no relative import climbs into it."""
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "fl_dp_flower"
    offenders = {}
    for path in package.rglob("*.py"):
        rel = path.relative_to(package)
        if rel.parts[0] == "app":
            continue
        bad = {n for n in _all_imports(path) if n == "fl_dp_flower.app" or n.startswith("fl_dp_flower.app.")
               or (n.startswith(".") and n.lstrip(".").split(".")[0] == "app"
                   and len(n) - len(n.lstrip(".")) == len(rel.parts))}
        if bad:
            offenders[str(rel)] = sorted(bad)
    assert not offenders, offenders
    # the package root holds the library only: the app's modules are in app/
    root_modules = {p.stem for p in package.glob("*.py")}
    assert not root_modules & {"config", "presets", "launcher", "cli", "preflight", "run_plan", "plan_flags",
                               "local_flower", "app_project", "run_output"}, root_modules
    assert not list((package / "apps").glob("*.py"))


def test_no_import_cycle_even_for_type_checking():
    """Issue 29: no two modules of a folder import each other, not even under TYPE_CHECKING (strategies/replies and
    strategies/screening did: the reply type now lives in strategies/echo.py)."""
    from pathlib import Path

    package = Path(__file__).resolve().parents[2] / "fl_dp_flower"
    for folder in [package, *(p for p in package.iterdir() if p.is_dir() and (p / "__init__.py").exists())]:
        mods = {p.stem: p for p in folder.glob("*.py") if p.stem != "__init__"}
        prefix = "fl_dp_flower" + "".join(f".{part}" for part in folder.relative_to(package).parts)
        edges = {}
        for stem, path in mods.items():
            targets = set()
            for n in _all_imports(path):
                if n.startswith(".") and not n.startswith(".."):
                    head = n[1:].split(".")[0]
                elif n.startswith(prefix + "."):
                    head = n[len(prefix) + 1:].split(".")[0]
                else:
                    continue
                if head in mods and head != stem:
                    targets.add(head)
            edges[stem] = targets
        pairs = {tuple(sorted((a, b))) for a, ts in edges.items() for b in ts if a in edges.get(b, set())}
        assert not pairs, f"{folder.name}: modules importing each other: {sorted(pairs)}"

"""The layering the README promises: privacy math imports no torch/flwr/pydantic (and only numpy/scipy, except
privacy/sampled.py, the one module that uses dp-accounting); reporting no torch/flwr."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PRIVACY = [f"fl_dp_flower.privacy.{m}" for m in
           ("schedules", "records", "gdp", "terms", "planned_terms", "bounds", "closed_forms", "final_model",
            "planned_bounds", "accountant", "planning", "sampled", "sample_sampling", "secure_aggregation", "skellam", "plan_rules",
            "running_sum")]
REPORTING = [f"fl_dp_flower.reporting.{m}" for m in ("ledger", "console", "prometheus", "plot", "durable",
                                                                "logfilter")]


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
        (["fl_dp_flower.cli"], {"torch", "flwr", "pydantic", "torchvision", "numpy", "scipy", "matplotlib"}),
        (["fl_dp_flower.launcher"], {"torch", "flwr", "torchvision", "numpy", "scipy", "matplotlib"}),
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
    """privacy/ is numpy/scipy only, except the PLD accountant of client sampling: privacy/sampled.py is the one
    module of the package that imports dp_accounting (issue 19 item 2)."""
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
    assert users == {"privacy/sampled.py", "privacy/sample_sampling.py"}


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

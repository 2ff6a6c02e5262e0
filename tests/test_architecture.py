"""The layering the README promises: privacy math imports no torch/flwr/pydantic; reporting no torch/flwr."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PRIVACY = [f"fl_dp_flower.privacy.{m}" for m in
           ("schedules", "records", "gdp", "terms", "planned_terms", "bounds", "closed_forms", "final_model",
            "planned_bounds", "accountant", "planning")]
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

    package = Path(__file__).resolve().parents[1] / "fl_dp_flower"
    long = {str(p.relative_to(package)): n for p in package.rglob("*.py")
            if (n := len(p.read_text().splitlines())) > 400}
    assert not long, long

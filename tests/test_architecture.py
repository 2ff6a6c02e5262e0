"""The layering the README promises: privacy math imports no torch/flwr/pydantic; reporting no torch/flwr."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

PRIVACY = ["schedules", "records", "gdp", "terms", "bounds", "accountant", "planning"]
REPORTING = ["ledger", "console", "prometheus", "plot", "durable"]


def _loaded_after_import(modules: list[str]) -> set[str]:
    code = (
        "import importlib, json, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "print(json.dumps(sorted({n.split('.')[0] for n in sys.modules})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    return set(json.loads(out.stdout))


@pytest.mark.parametrize(
    "package, names, forbidden",
    [
        ("fl_dp_flower.privacy", PRIVACY, {"torch", "flwr", "pydantic", "torchvision"}),
        ("fl_dp_flower.reporting", REPORTING, {"torch", "flwr", "torchvision"}),
    ],
)
def test_layers_do_not_import_heavier_layers(package, names, forbidden):
    loaded = _loaded_after_import([f"{package}.{n}" for n in names] + ["fl_dp_flower.cli"] * (package.endswith("privacy")))
    assert not (loaded & forbidden), f"{package} pulled in {sorted(loaded & forbidden)}"

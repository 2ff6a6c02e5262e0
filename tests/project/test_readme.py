"""The README's own-app snippets, extracted and run as written (server and client, in-process grid),
and the README's length."""

from __future__ import annotations

import json
import re
import sys
import types
from pathlib import Path

import torch
from flwr.app import Context, RecordDict
from torch import nn

from fl_dp_flower.testing import LocalGrid, task_identity

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"


def _snippets() -> dict[str, str]:
    """``# <file>.py``-headed python blocks of the README, by file name."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    return {block.split("\n", 1)[0].lstrip("# ").strip(): block for block in blocks if block.startswith("# ")}


def _my_model() -> types.ModuleType:
    """The user's module the snippets import: a small model and this node's data."""
    module = types.ModuleType("my_model")

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.layers(x)

    def load_data(context: Context) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(int(context.node_config["partition-id"]))
        x = torch.randn(64, 8, generator=g)
        return x, (x[:, :2] > 0).long() @ torch.tensor([1, 2])

    module.Net, module.load_data = Net, load_data
    return module


def test_readme_is_at_most_200_lines():
    assert len(README.read_text().splitlines()) <= 200


def test_readme_server_and_client_snippets_run(tmp_path, monkeypatch):
    snippets = _snippets()
    assert {"server_app.py", "client_app.py"} <= set(snippets)
    monkeypatch.setitem(sys.modules, "my_model", _my_model())
    monkeypatch.chdir(tmp_path)
    client_ns: dict = {}
    exec(compile(snippets["client_app.py"], "README:client_app.py", "exec"), client_ns)  # noqa: S102
    server_ns: dict = {}
    exec(compile(snippets["server_app.py"], "README:server_app.py", "exec"), server_ns)  # noqa: S102
    grid = LocalGrid(client_ns["app"], 3)
    context = Context(run_id=0, node_id=0, node_config={}, state=RecordDict(), run_config={})
    with task_identity():
        server_ns["main"](grid, context)
    lines = [json.loads(line) for line in (tmp_path / "outputs" / "ledger.jsonl").read_text().splitlines()]
    rounds = [e for e in lines if e["kind"] == "round"]
    events = [e["event"] for e in lines if e["kind"] == "event"]
    # the snippet's budget (epsilon 10) stops the 20-round run early, before a round would exceed it
    assert 1 <= len(rounds) < 20 and events[-2:] == ["budget-stop", "end"]
    assert rounds[-1]["report"]["certified"]["epsilon"] <= 10.0

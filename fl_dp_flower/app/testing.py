"""The reference app in process, for tests, benchmarks and scripts: a tiny validated run config and
the real ServerApp (``run_server``) on a :class:`~fl_dp_flower.testing.LocalGrid` of the real ClientApp."""

from __future__ import annotations

from flwr.clientapp import ClientApp

from fl_dp_flower.app.config import AppConfig
from fl_dp_flower.testing import TINY_NODES, LocalGrid, task_identity


def tiny_config(tmp_path, **overrides):
    """A validated AppConfig for a ~1 s run on TINY_NODES in-process nodes (fixed seed: reproducible)."""
    rc = {
        "local-steps": 2, "batch-size": 16, "lr": 0.05, "sigma": 0.5, "clip-norm": 1.0,
        "num-server-rounds": 2, "clients-per-round": TINY_NODES, "min-replies": 1,
        "num-partitions": TINY_NODES, "seed": 0, "output-dir": str(tmp_path), "run-name": "run",
        "round-timeout": 30.0,
    }
    rc.update(overrides)
    return AppConfig.from_run_config(rc)


def run_local(config, app: ClientApp | None = None, *, nodes: int = TINY_NODES, **grid_kw):
    """The real ServerApp (``run_server``) on a LocalGrid of the real ClientApp: (outcome, grid)."""
    from fl_dp_flower.app.clientapp import app as client_app
    from fl_dp_flower.app.serverapp import run_server

    grid = LocalGrid(app or client_app, nodes, config.to_run_config(), **grid_kw)
    with task_identity():
        return run_server(grid, config), grid

"""Flower ServerApp entry point (``serverapp = "server_app:app"`` in pyproject.toml)."""

from fl_dp_flower.app.serverapp import app

__all__ = ["app"]

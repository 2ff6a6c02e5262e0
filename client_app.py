"""Flower ClientApp entry point (``clientapp = "client_app:app"`` in pyproject.toml)."""

from fl_dp_flower.app.clientapp import app

__all__ = ["app"]

"""Flower ClientApp entry point (``clientapp = "client_app:app"`` in pyproject.toml)."""

from fl_dp_flower.apps.client import app

__all__ = ["app"]

"""The package's one error base class: ``except FlDpError`` catches every error fl-dp-flower raises
on purpose (each also keeps its standard base: ValueError, RuntimeError, or Flower's
``PrivacyBudgetExhausted`` for a budget stop). Standard library only."""

from __future__ import annotations

__all__ = ["FlDpError"]


class FlDpError(Exception):
    """Base of every error this package raises on purpose (config, refusals, budget, failed runs)."""

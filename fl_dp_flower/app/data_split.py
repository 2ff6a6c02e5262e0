"""A resume keeps the data split (review R1): the keys that decide which images the clients train on and which
ones the server evaluates on (its test and validation metrics are published un-noised).

Changing ``validation-fraction`` (or ``test-fraction``, ``dataset``) between a run and its resume moves images
between the clients' data, which the ledger's guarantee covers, and the server's evaluation sets: an image the
clients trained on in the accounted rounds would then sit in the validation set, whose exact loss and accuracy the
server publishes every round, a release of that image no bound describes. The ledger header's ``app_config``
records the split the run started with; a resume that differs is refused before anything is written.
"""

from __future__ import annotations

from typing import Any

__all__ = ["DATA_SPLIT_KEYS", "data_split_changes"]

#: run-config keys that decide which images are client data and which the server's evaluation sets
DATA_SPLIT_KEYS = ("dataset", "test-fraction", "validation-fraction")


def data_split_changes(header: dict[str, Any], run_config: dict[str, Any]) -> str | None:
    """Why a resume under ``run_config`` (dash keys) would move images between the clients and the server's
    evaluation sets recorded in the ledger ``header`` (its ``app_config``); None when it keeps the split (or the
    header records no run config: a library ledger, whose data the package does not load)."""
    recorded = header.get("app_config")
    if not isinstance(recorded, dict) or not recorded:
        return None
    diff = [f"{key}: ledger {recorded[key]!r} != now {run_config.get(key)!r}" for key in DATA_SPLIT_KEYS
            if key in recorded and recorded[key] != run_config.get(key)]
    if not diff:
        return None
    return ("the data split differs from the one the run started with (" + ", ".join(diff) + "): images the clients "
            "trained on would move into the server's test or validation set, whose metrics are published un-noised "
            "(no bound covers them); resume with the run's own " + ", ".join(DATA_SPLIT_KEYS))

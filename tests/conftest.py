"""Shared pytest fixtures (shared helpers: local_grid.py, deploy_harness.py, doc_commands.py)."""

import pytest

from local_grid import task_identity


@pytest.fixture(autouse=True)
def _flower_task_identity():
    """Flower's TaskIdentity set for every test (messages can be built outside a runtime)."""
    with task_identity():
        yield

"""Shared pytest fixtures (shared helpers: fl_dp_flower.testing, deploy_harness.py, doc_commands.py)."""

import pytest

from fl_dp_flower.testing import task_identity


@pytest.fixture(autouse=True)
def _flower_task_identity():
    """Flower's TaskIdentity set for every test (messages can be built outside a runtime)."""
    with task_identity():
        yield

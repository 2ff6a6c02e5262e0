"""Shared pytest fixtures (shared helpers: fl_dp_flower.testing, deploy_harness.py, doc_commands.py)."""

import pytest

from fl_dp_flower.testing import task_identity


@pytest.fixture(autouse=True)
def _flower_task_identity():
    """Flower's TaskIdentity set for every test (messages can be built outside a runtime)."""
    with task_identity():
        yield


def pytest_collection_modifyitems(config, items):
    """The real-process runs (marked ``slow``) first: under pytest-xdist (scripts/test.sh runs the suite on
    several workers) the longest runs then start at once rather than last, and the rest fills in around them.
    A stable sort: the order within each group is the collection order."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)

"""Shared pytest fixtures."""

import pytest


@pytest.fixture(autouse=True)
def _flower_task_identity():
    """Flower >= 1.4x reads TaskIdentity.run_id/node_id/task_id to build instruction Messages;
    outside a Flower runtime they are unset (RuntimeError). Set them per test, restore after."""
    from flwr.supercore.task_identity import TaskIdentity  # internal API, no public alternative

    names = ("_run_id", "_node_id", "_task_id")
    saved = {k: getattr(TaskIdentity, k) for k in names}
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 0, 1, 1
    yield
    for k, v in saved.items():
        setattr(TaskIdentity, k, v)

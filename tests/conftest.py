"""Shared pytest fixtures (shared helpers: fl_dp_flower.testing, deploy_harness.py, doc_commands.py)."""

import logging

import pytest

from fl_dp_flower.testing import task_identity

#: how long the longest real-process runs take (seconds, this machine, 3 workers): scheduled first, longest first
LONGEST = {
    "test_secure_aggregation_survives_a_supernode_killed_mid_protocol": 165,
    "test_quick_start_word_for_word": 110,
    "test_supernode_killed_mid_round": 95,
    "test_serverapp_killed_and_resumed": 70,
    "test_fixed_seed_refused_by_a_node_that_does_not_allow_it": 66,
    "test_ctrl_c_stops_training_and_the_run_resumes_by_name": 64,
    "test_tls_auth_two_supernodes_two_rounds": 56,
}


@pytest.fixture(autouse=True)
def _flower_task_identity():
    """Flower's TaskIdentity set for every test (messages can be built outside a runtime)."""
    with task_identity():
        yield


def pytest_collection_modifyitems(config, items):
    """The real-process runs (marked ``slow``) first, the longest of them (:data:`LONGEST`) first of all: under
    pytest-xdist (scripts/test.sh: several workers, handed two tests at a time) the longest runs then start at
    once on different workers rather than last on one, and the rest fills in around them. A stable sort."""
    items.sort(key=lambda item: (item.get_closest_marker("slow") is None, -LONGEST.get(item.originalname, 0)))


@pytest.fixture(autouse=True)
def _flower_logger_restored():
    """Each test leaves Flower's logger as it found it: the reference ServerApp installs its dump filter on it
    for the process's life, which would hide Flower's records from later tests of the same worker."""
    flwr = logging.getLogger("flwr")
    filters, level, propagate = list(flwr.filters), flwr.level, flwr.propagate
    yield
    flwr.filters[:] = filters
    flwr.setLevel(level)
    flwr.propagate = propagate

"""Waiting for SuperNodes, said where the operator looks: the ServerApp's log (``flwr log``).

Flower's ``sample_nodes`` waits without a deadline and logs at INFO once a second; a run that
needs more SuperNodes than the federation has (Flower 1.41's default simulated federation has 2)
would wait forever without a word a user sees. This says, as a WARNING at once and every minute,
how many are missing and how to fix it.
"""

from __future__ import annotations

import logging
import time

from flwr.serverapp import Grid

from fl_dp_flower.settings import FederationSettings

log = logging.getLogger("flwr").getChild(__name__)  # Flower's handlers: shows in `flwr log`

NODES_WARNING_EVERY = 60.0  # seconds between warnings while a round waits for SuperNodes


def warn_until_enough_nodes(grid: Grid, needed: int, config: FederationSettings) -> None:
    """Wait until ``needed`` SuperNodes are connected, warning (in the ServerApp's log, i.e.
    ``flwr log``) at once and every minute how many are missing and how to fix it."""
    said = -NODES_WARNING_EVERY
    while (connected := len(list(grid.get_node_ids()))) < needed:
        now = time.monotonic()
        if now - said >= NODES_WARNING_EVERY:
            said = now
            cohort = f" / clients-per-node {config.clients_per_node}" if config.clients_per_node > 1 else ""
            log.warning("waiting for SuperNodes: %d connected, this run needs %d (clients-per-round %d%s). In "
                        "Flower's simulation (its default federation has 2 SuperNodes) run `flwr run . "
                        "--federation-config \"num-supernodes=%d\"`, or lower clients-per-round, or set "
                        "clients-per-node > 1 (cohort mode); in a deployment, start more SuperNodes",
                        connected, needed, config.clients_per_round, cohort, needed)
        time.sleep(1.0)

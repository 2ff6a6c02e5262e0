"""The runtime note on shared training statistics (node config ``share-metrics=true``, :mod:`fl_dp_flower.node`).

A node that opts in sends un-noised statistics of its local training (``train-loss``, ``clipped-fraction``,
``train-seconds``, ``nonfinite-gradients``, :func:`fl_dp_flower.client.shared_statistics`; any other scalar a
train function adds to its reply is treated alike); the server averages them into every round line, the ledger and
the :class:`~flwr.serverapp.strategy.Result`. They are neither noised nor accounted: no certified number covers
them, under any threat model. With Poisson-sampled batches (the ``batch_sampled`` bound, docs/MATH.md §23) they
also depend on the batches the node drew (``train-seconds`` grows with the realized batch sizes; the loss and the
clipped fraction are means over the drawn samples), while that bound assumes that nothing else a node sends
depends on them: for a node that shares them, its batch amplification is void.

The strategy says so once per run, at WARNING, when the first reply carrying such statistics arrives
(:class:`SharedStatisticsNote`); :func:`shared_statistics_note` is the wording, for whatever a run publishes
about its assumptions (the reference app's summary).

A node keeps sending ``train-seconds`` under Poisson batches: withholding it alone would not restore the
``batch_sampled`` assumption (the other statistics depend on the drawn batches too), and the reply's arrival time
carries the same training time to the server whatever the reply says (the assumption already asks the node to
keep it from revealing the batches). ``share-metrics`` stays the node's explicit choice; this note tells the
server's operator what it costs.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from typing import Any

from fl_dp_flower import protocol

#: the statistics :func:`fl_dp_flower.client.train_reply` sends with ``share_metrics``
SHARED_STATISTICS = ("train-loss", "clipped-fraction", "train-seconds", "nonfinite-gradients")
NOT_STATISTICS = ("num-examples",)  # the weight, screened and capped (not a training statistic)


def shared_keys(metrics: Mapping[str, Any]) -> list[str]:
    """The un-noised statistics a reply's metrics carry: scalar keys outside the ``dp.*`` contract other than
    ``num-examples`` (the shared statistics and any a train function adds), sorted."""
    return sorted(k for k, v in metrics.items() if not k.startswith(protocol.PREFIX) and k not in NOT_STATISTICS
                  and isinstance(v, (int, float)) and not isinstance(v, bool))


def shared_statistics_note(batch_sampled: bool, keys: Iterable[str] = SHARED_STATISTICS) -> str:
    """What shared statistics do to the certificate (``batch_sampled``: the run's batches are Poisson-sampled)."""
    text = (f"un-noised training statistics ({', '.join(keys)}: sent by a node whose config sets share-metrics=true, "
            "or added by its train function) are averaged into every round line, the ledger and the Result (a secret "
            "sample: the members file): they are neither noised nor accounted, so they are outside the privacy "
            "certificate (no certified epsilon covers them, under any threat model)")
    if batch_sampled:
        text += ("; with Poisson-sampled batches they may also reveal the batches a node drew (train-seconds grows "
                 "with the batch sizes; the loss and clipped fraction are means over the drawn samples), which voids "
                 "that node's batch amplification (the batch_sampled bound assumes nothing else a node sends "
                 "depends on its batches)")
    return text


class SharedStatisticsNote:
    """Warns once per run, when the first reply carrying shared statistics arrives; ``nodes``: the nodes whose
    replies carried them (for a run's summary)."""

    def __init__(self, batch_sampled: bool, log: logging.Logger) -> None:
        self.batch_sampled, self.log = batch_sampled, log
        self.nodes: set[int] = set()

    def see(self, server_round: int, replies: Iterable[tuple[int, Mapping[str, Any]]]) -> None:
        """``replies``: (node id, metrics) of the round's usable replies."""
        for node, metrics in replies:
            keys = shared_keys(metrics)
            if not keys:
                continue
            if not self.nodes:
                self.log.warning("round %d: node %d shares training statistics: %s", server_round, node,
                                 shared_statistics_note(self.batch_sampled, keys))
            self.nodes.add(node)

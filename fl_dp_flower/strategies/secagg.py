"""Server side of secure aggregation (docs/ARCHITECTURE.md "Secure aggregation").

:class:`SecAggGrid` wraps the run's Grid. Train instructions (one ``send_and_receive`` per round,
from the Message-API strategy) are not sent as they are: the four stage methods of Flower's
``SecAggPlusWorkflow`` run over the inner Grid instead (setup, share keys, collect masked vectors
carrying the strategy's own train content plus the grid keys ``dp.sum-grid-*``, unmask), with a
small context whose ``strategy`` hands the workflow our nodes (``configure_fit``) and takes the
unmasked sum back (``aggregate_fit``). The sum is decoded exactly (training/secure_sum.py: the
clients' integer uploads clamp(round(Delta/s) + Skellam) + 2^29, summed modulo 2^32).
The strategy then receives one reply per client whose masked vector entered the sum: its arrays
are ``w_t + sum / m`` (the same for every reply, never one client's upload) and its metrics that
client's echoes. Every other message passes through unchanged.

The clients run ``ClientApp(mods=[secaggplus_mod, secure_upload_mod])`` (apps/secagg_mod.py), which
upload their integer update with weight 1, so the average is uniform over the contributors. A cohort node
(``dp.members``, docs/MATH.md §20.6) uploads its members' integer sum as its one masked vector: the sum is
divided by the clients (the nodes' members), and a node's reply holds M (w_t + sum / clients) for its M
members, as a cohort reply holds its members' summed models.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.app.message_type import MessageType
from flwr.common import FitIns, Parameters, parameters_to_ndarrays
from flwr.compat.common.recorddict_compat import arrayrecord_to_parameters
from flwr.server.workflow import SecAggPlusWorkflow
from flwr.server.workflow.constant import MAIN_CONFIGS_RECORD, MAIN_PARAMS_RECORD
from flwr.server.workflow.constant import Key as WorkflowKey
from flwr.server.workflow.secure_aggregation.secaggplus_workflow import WorkflowState
from flwr.serverapp import Grid

from fl_dp_flower.privacy.plan_rules import SECAGG_HONEST_MINIMUM
from fl_dp_flower.protocol import MEMBERS, from_secure_echo, sum_grid_config
from fl_dp_flower.training.secure_sum import FLOWER_LEVELS, FLOWER_MODULUS, FLOWER_RANGE, SumGrid, decode_sum

__all__ = ["HONEST_MINIMUM", "SecAggGrid", "SecureRound", "clients_in", "members_of"]

log = logging.getLogger(__name__)
#: the fewest contributors outside the coalition a sum is unmasked for (privacy/plan_rules.py, the one rule)
HONEST_MINIMUM = SECAGG_HONEST_MINIMUM


@dataclass
class SecureRound:
    """What one secure round revealed: who entered the sum, the average update, the echoes."""

    contributors: list[int] = field(default_factory=list)
    average: list[np.ndarray] = field(default_factory=list)  # (sum of the rounded updates + noise) / m, float64
    metrics: dict[int, dict[str, Any]] = field(default_factory=dict)
    completed: bool = False


class _Adapter:
    """The legacy-strategy and client-manager surface the workflow's stage methods use."""

    def __init__(self, messages: list[Message], parameters: Parameters, grid: SumGrid) -> None:
        self._nodes = [m.metadata.dst_node_id for m in messages]
        self._parameters = parameters
        self._grid = grid
        self.round = SecureRound()

    def configure_fit(self, server_round: int, parameters: Parameters, client_manager: Any) -> list[tuple[Any, FitIns]]:
        return [(SimpleNamespace(node_id=nid), FitIns(self._parameters, {})) for nid in self._nodes]

    def num_available(self) -> int:
        return len(self._nodes)

    def aggregate_fit(self, server_round: int, results: list[tuple[Any, Any]], failures: list[Any]) -> tuple[None, dict[str, Any]]:
        self.round.contributors = sorted(proxy.node_id for proxy, _ in results)
        self.round.metrics = {proxy.node_id: from_secure_echo(dict(res.metrics)) for proxy, res in results}
        if results:  # one upload per node (its members' integer sum); the average is over the clients
            total = decode_sum(parameters_to_ndarrays(results[0][1].parameters), len(results), self._grid)
            self.round.average = [t / clients_in(self.round.metrics.values()) for t in total]
        self.round.completed = True
        return None, {}


def members_of(metrics: dict[str, Any]) -> int:
    """The clients one node's upload sums: its echoed ``dp.members`` (a cohort node), else 1. The strategy's
    admission checks the echo against the slots it asked for before any sum is unmasked."""
    slots = metrics.get(MEMBERS)
    return len(slots) if isinstance(slots, list) and slots else 1


def clients_in(echoes: Iterable[dict[str, Any]]) -> int:
    """The clients of a secure sum: its nodes' members (docs/MATH.md §20.6)."""
    return sum(members_of(m) for m in echoes)


class SecAggGrid(Grid):
    """A Grid whose train rounds go through SecAgg+ (module docstring); ``rounds`` keeps each round's
    :class:`SecureRound` (what the server learned), for the ledger and for tests. ``grid``: the
    integer grid (step s), from :func:`fl_dp_flower.training.secure_sum.plan_grid`; the
    accountant's ``sum_grid_step``/``sum_dimension`` must name the same step (the strategy checks).

    ``min_contributors``: a round whose masked vectors came from fewer clients is abandoned before
    unmasking (nothing is revealed, the strategy gets no reply); pass the strategy's ``min-replies``,
    the count its budget check assumes for ``secure-aggregation`` (strategies/budget.py)."""

    def __init__(self, inner: Grid, grid: SumGrid, *, min_contributors: int, num_shares: int | float = 1.0,
                 reconstruction_threshold: int | float = 0.5) -> None:
        if not (isinstance(min_contributors, int) and min_contributors >= 1):
            raise ValueError(f"min_contributors must be an integer >= 1 (the strategy's min-replies), got "
                             f"{min_contributors!r}")
        self._inner = inner
        if not isinstance(grid, SumGrid):
            raise TypeError("grid must be a fl_dp_flower.training.secure_sum.SumGrid")
        self.grid = grid
        self._num_shares = num_shares
        self._threshold = reconstruction_threshold
        self.rounds: list[SecureRound] = []
        self.min_contributors = min_contributors
        # set by the strategy (strategies.sampling.check_grid): the accountant's sum_dimension (checked each
        # round), its coalition in NODES, ceil(c / clients-per-node) (SecAgg+'s threshold must exceed it; at least
        # HONEST_MINIMUM other nodes; docs/MATH.md §20.6) and the admission check run on the contributors' echoes
        # before any sum is unmasked
        self.expected_dimension: int | None = None
        self.colluders = 0
        self.honest_minimum = 1  # HONEST_MINIMUM under threat model secure-aggregation
        self.admit: Callable[[dict[int, dict[str, Any]]], list[tuple[int, str]]] | None = None

    # ------------------------------------------------------------- passthrough
    def set_run(self, run_id: Any) -> None:
        self._inner.set_run(run_id)

    @property
    def run(self) -> Any:
        return self._inner.run

    def create_message(self, content: RecordDict, message_type: str, dst_node_id: int, group_id: str,
                       ttl: float | None = None) -> Message:
        return self._inner.create_message(content, message_type, dst_node_id, group_id, ttl)

    def get_node_ids(self) -> Iterable[int]:
        return self._inner.get_node_ids()

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self._inner.push_messages(messages)

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self._inner.pull_messages(message_ids)

    # ------------------------------------------------------------- secure rounds
    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        msgs = list(messages)
        if not msgs or any(m.metadata.message_type != MessageType.TRAIN for m in msgs):
            return self._inner.send_and_receive(msgs, timeout=timeout)
        return self._secure_round(msgs, timeout)

    def _secure_round(self, msgs: list[Message], timeout: float | None) -> list[Message]:
        for original in msgs:  # as a Grid sets it on push: replies (and the strategy's admission check) refer to it
            original.metadata.__dict__["_message_id"] = original.object_id
        arrays: ArrayRecord = msgs[0].content.array_records["arrays"]
        keys = list(arrays.keys())
        values = sum(int(np.prod(arrays[k].shape)) for k in keys)
        if self.expected_dimension is not None and values != self.expected_dimension:
            raise ValueError(f"the model has {values} values but the accountant's sum_dimension is "
                             f"{self.expected_dimension}: its bound would not describe this sum")
        adapter = _Adapter(msgs, arrayrecord_to_parameters(arrays, keep_input=True), self.grid)
        stated = msgs[0].content.config_records["config"].get("server-round")
        server_round = stated if isinstance(stated, int) else len(self.rounds) + 1
        context = SimpleNamespace(
            state=RecordDict({MAIN_CONFIGS_RECORD: ConfigRecord({WorkflowKey.CURRENT_ROUND: server_round}),
                              MAIN_PARAMS_RECORD: arrays}),
            strategy=adapter, client_manager=adapter, history=SimpleNamespace())
        workflow = SecAggPlusWorkflow(self._num_shares, self._threshold, max_weight=1.0, clipping_range=FLOWER_RANGE,
                                      quantization_range=FLOWER_LEVELS, modulus_range=FLOWER_MODULUS, timeout=timeout)
        state = WorkflowState()
        by_node = {m.metadata.dst_node_id: m for m in msgs}
        ok = workflow.setup_stage(self._inner, context, state)  # type: ignore[arg-type]
        bounded = isinstance(self._num_shares, int) and self._num_shares > 1  # a ring of num_shares - 1 neighbours
        if ok and (self.colluders >= state.threshold or (bounded and self.colluders > state.num_shares - 4)):
            log.error("secure round %s: not run: the %d colluding clients reach SecAgg+'s reconstruction threshold %d "
                      "(of %d shares) or leave a client fewer than 3 honest neighbours; raise 'secagg-threshold' or "
                      "'secagg-num-shares' (docs/MATH.md §20.3)", server_round, self.colluders, state.threshold,
                      state.num_shares)
            ok = False
        if ok:  # the collect stage carries the strategy's own train content (arrays + config)
            for nid in state.nid_to_fitins:
                config = ConfigRecord({**by_node[nid].content.config_records["config"],
                                       **sum_grid_config(self.grid.step)})
                state.nid_to_fitins[nid] = RecordDict({"arrays": by_node[nid].content.array_records["arrays"],
                                                       "config": config})
        for stage in (workflow.share_keys_stage, workflow.collect_masked_vectors_stage):
            ok = ok and stage(self._inner, context, state)  # type: ignore[arg-type]
        # never unmask a sum of fewer than min_contributors (the budget was checked for that many, budget.py), of
        # fewer than honest_minimum clients outside the coalition (Flower's masks: 32-bit seeds, docs/MATH.md §20.3),
        # or one with a contributor the strategy would drop (its upload would be in a sum the ledger misdescribes)
        n = len(state.active_node_ids)  # nodes (SecAgg+ participants); min_contributors counts clients (members)
        echoes = {proxy.node_id: from_secure_echo(dict(res.metrics)) for proxy, res in state.legacy_results}
        clients = clients_in(echoes.values())
        ok = ok and clients >= self.min_contributors and n - min(self.colluders, n - 1) >= self.honest_minimum
        if ok and self.admit is not None:
            rejected = self.admit(echoes)
            for nid, why in rejected:
                log.error("secure round %s: not unmasked: node %d would be dropped (%s)", server_round, nid, why)
            ok = not rejected
        ok = ok and workflow.unmask_stage(self._inner, context, state)  # type: ignore[arg-type]
        secure = adapter.round
        self.rounds.append(secure)
        if not (ok and secure.completed):
            return []  # the protocol halted: no sum was revealed, nothing to aggregate
        model = [arrays[k].numpy().astype(np.float64) + secure.average[i] for i, k in enumerate(keys)]
        replies = []
        for nid in secure.contributors:  # a cohort node's reply stands for its M members: M (w_t + sum / clients)
            original, m = by_node[nid], members_of(secure.metrics[nid])
            held = ArrayRecord({k: Array(np.asarray(m * model[i] if m > 1 else model[i], dtype=arrays[k].numpy().dtype))
                                for i, k in enumerate(keys)})
            content = RecordDict({"arrays": held, "metrics": MetricRecord(secure.metrics[nid])})
            replies.append(Message(content, reply_to=original))
        return replies


"""Noisy-FedAvg / Noisy-FedProx on ``flwr.serverapp.strategy`` with a per-round accountant.

Per round (``Strategy.start`` drives it):

1. ``configure_train``: budget pre-check (:mod:`.budget`; may raise :class:`BudgetExhausted`
   before anything is sent), sample exactly ``clients-per-round`` eligible nodes, add the
   ``dp.*`` keys (and FedProx's ``proximal-mu``) to the train ConfigRecord.
2. ``aggregate_train``: screen replies (errors and malformed replies are dropped and logged
   with the real node id; echoes outside the plan, uploads too far from the broadcast model or
   with too little noise, duplicate partition ids and echoes the accountant cannot account are
   dropped as refusals: :mod:`.screening`, :mod:`.guard`, docs/MATH.md §17), track node refusals, build the :class:`RoundRecord` of what
   *arrived* (node ids, weights, least private of planned vs echoed settings), the exact
   budget check on that record (threat models that see only global models), then aggregate
   with uniform weights (or by ``num-examples``), ``accountant.step(record)``, and merge
   ``dp-*`` numbers into the metrics.
3. before any client-evaluation broadcast (``configure_evaluate``), after central evaluation:
   call the reporters
   ``on_round(round, record, report, metrics)`` in order (the ServerApp wires ledger ->
   checkpoint -> log line -> Prometheus), then the next round is broadcast.

Round numbering: the schedule index t (``dp.round-index``, 0-based) is the number of rounds
accounted so far, so after a resume it continues from the ledger; the record's ``round`` is
t + 1. A round in which no usable reply arrived releases nothing and is not accounted; it
does not advance t (the next round retries the same schedule position).

Under-quorum rounds (1 <= usable replies < ``min-replies``): the uploads were seen by the
server, so the round is accounted with the clients that replied (composition and local DP can
only grow), but the global model is not updated: the record says ``applied = False`` and the
final-model bound leaves the round out (adding a noisy round would lower it although its noise
never reached the released model, docs/MATH.md §14.3a).

A non-finite aggregate (which screening makes impossible short of a bug) is not used: the round
stays accounted and recorded, then :class:`ModelNotFinite` fails the run.

Refusing nodes: a node that refuses (``Error`` reply from its guardrails or policy)
``max-node-refusals`` rounds in a row is no longer sampled (logged at ERROR, reported in
the summary and as a ``node-excluded`` ledger event). When fewer eligible nodes than
``clients-per-round`` remain, every eligible node is sampled; when fewer than
``min-replies`` remain, the run fails with :class:`NotEnoughNodes`.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedProx, Result
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from fl_dp_flower.config import AppConfig
from fl_dp_flower.privacy.accountant import Budget, PrivacyAccountant, PrivacyReport
from fl_dp_flower.privacy.records import RoundRecord

from fl_dp_flower.reporting.rounds import RoundOutcome, dp_metrics

from .budget import BudgetExhausted, check_before_broadcast, check_replies
from .guard import ReplyGuard, all_finite
from .nodes import warn_until_enough_nodes
from .replies import (Applied, average_arrays, average_metrics, member_id, mismatches, reconcile, screen,
                      weights_for)
from .screening import rules_for

log = logging.getLogger("flwr").getChild(__name__)  # Flower's handlers: shows in `flwr log`

Reporter = Callable[[RoundOutcome], None]
EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


@dataclass
class PendingRound:
    """The round in flight: what was sent, then what was accounted (rounds never overlap)."""

    server_round: int
    planned: Applied  # the settings sent (schedule index t = planned.round_index)
    sent: list[Message]  # instructions; the Grid sets their message ids when pushing
    reference: ArrayRecord  # the broadcast global model
    slots: dict[int, tuple[int, ...]] | None = None  # cohort mode: node -> sampled member slots
    record: RoundRecord | None = None  # set once accounted
    report: PrivacyReport | None = None
    metrics: dict[str, Any] | None = None


class ModelNotFinite(RuntimeError):
    """The aggregated global model has non-finite values: the run cannot continue."""


class NotEnoughNodes(RuntimeError):
    """Fewer eligible nodes than ``min-replies`` remain after excluding refusing nodes."""


@dataclass
class NodeRefusals:
    """Refusals of one node: ``consecutive`` since its last usable reply, ``total`` overall."""

    consecutive: int = 0
    total: int = 0
    last_reason: str = ""
    excluded_at_round: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"consecutive": self.consecutive, "total": self.total, "last_reason": self.last_reason,
                "excluded_at_round": self.excluded_at_round}


class NoisyStrategyMixin:
    """Shared per-round logic; must precede FedAvg/FedProx in the MRO."""

    # attributes provided by FedAvg
    arrayrecord_key: str
    configrecord_key: str
    min_available_nodes: int

    def _init_dp(self, config: AppConfig, accountant: PrivacyAccountant, reporters: Sequence[Any]) -> None:
        if accountant.config != config.accountant_config():
            raise ValueError("the accountant's configuration does not match the app config")
        self.dp_config = config
        self.accountant = accountant
        self.reporters: list[Reporter] = list(reporters)
        self.budget = Budget(config.target_epsilon, config.delta) if config.target_epsilon > 0 else None
        self.global_arrays: ArrayRecord | None = None
        self.stop_reason: str | None = None
        self.echo_mismatches = 0
        self._last_mismatch = 0
        self.refusals: dict[int, NodeRefusals] = {}
        self.on_event: Callable[[str, dict[str, Any]], None] | None = None  # ledger events (ServerApp)
        self._round: PendingRound | None = None
        self._user_evaluate_fn: EvaluateFn | None = None
        self._closed: tuple[int, MetricRecord | None] | None = None  # round closed before its evaluation
        self._train_metrics: dict[int, MetricRecord] = {}  # the Result so far, per server round
        self._eval_metrics: dict[int, MetricRecord] = {}
        self.guard = ReplyGuard(accountant, log)  # duplicate partition ids, per-reply accountant errors
        self.residual_energies: list[tuple[int, int, float | None]] = []  # (round, node, E): tests, never published
        self.diverged: str | None = None

    # ------------------------------------------------------------------ planning
    @property
    def round_index(self) -> int:
        """0-based schedule index t of the next round (= rounds accounted so far)."""
        return self.accountant.num_releases

    def planned(self, t: int) -> Applied:
        c = self.dp_config
        return Applied(
            sigma=c.sigma, clip_norm=c.clip_norm, local_steps=c.local_steps, lr=c.lr, round_index=t,
            batch_size=c.batch_size, prox_alpha=c.prox_alpha if c.algorithm == "fedprox" else None,
        )

    def train_settings(self, t: int) -> dict[str, Any]:
        """The contract's ``dp.*`` train keys for schedule index ``t``."""
        c = self.dp_config
        return {
            "dp.round-index": t,
            "dp.algorithm": c.algorithm,
            "dp.schedule": c.schedule,
            "dp.lr": float(c.lr),
            "dp.local-steps": int(c.local_steps),
            "dp.clip-norm": float(c.clip_norm),
            "dp.sigma": float(c.sigma),
            "dp.clipping": c.clipping,
            "dp.batch-size": int(c.batch_size),
            "dp.prox-alpha": float(c.prox_alpha) if c.algorithm == "fedprox" else 0.0,
            "dp.seed": int(c.seed),
        }

    # ------------------------------------------------------------------ training
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Budget check, then exactly ``clients-per-round`` train instructions."""
        if self.budget is not None:
            check_before_broadcast(self.accountant, self.budget)
        t = self.round_index
        c = self.dp_config
        slots, available = self._sample(grid, t)
        members = sorted(member_id(n, j, c.clients_per_node) for n, js in slots.items() for j in js) \
            if self.cohort else sorted(slots)
        log.info("round %d (t=%d): sampled %d clients on %d of %d nodes", server_round, t, len(members),
                 len(slots), len(available))
        self._event("round-open", {"round": t + 1, "node_ids": members})  # write-ahead
        base = ConfigRecord(dict(config))  # start() reuses one record for all rounds: never alias it
        base["server-round"] = server_round
        for key, value in self.train_settings(t).items():
            base[key] = value
        if isinstance(self, FedProx):
            base["proximal-mu"] = float(self.proximal_mu)
        messages = []
        for node, js in slots.items():
            node_config = base
            if self.cohort:  # each node trains the virtual clients sampled on it
                node_config = ConfigRecord(dict(base))
                node_config["dp.members"] = list(js)
            record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: node_config})
            messages.append(Message(content=record, dst_node_id=node, message_type=MessageType.TRAIN))
        # the Grid sets each message's id when it pushes it: kept to name the node of an error reply
        self._round = PendingRound(server_round, self.planned(t), messages, arrays,
                                   slots=slots if self.cohort else None)
        return messages

    @property
    def cohort(self) -> bool:
        """Cohort mode: every node stands for ``clients-per-node`` virtual clients."""
        return self.dp_config.clients_per_node > 1

    @property
    def excluded_nodes(self) -> dict[int, str]:
        """Nodes no longer sampled, with their last refusal reason."""
        return {n: r.last_reason for n, r in self.refusals.items() if r.excluded_at_round is not None}

    def _sample(self, grid: Grid, t: int) -> tuple[dict[int, tuple[int, ...]], list[int]]:
        """``clients-per-round`` distinct clients of eligible nodes, grouped by node: node -> its
        sampled member slots (``(0,)`` outside cohort mode). Waits until enough nodes are connected.

        Eligible: connected and not excluded for refusing. In cohort mode every eligible node
        offers ``clients-per-node`` slots and the clients are sampled uniformly among all slots.
        With ``seed`` >= 0 the sample is a function of (seed, t, exclusions) only, so a resumed
        run samples like an uninterrupted one; otherwise it uses OS entropy.
        """
        c = self.dp_config
        cpn = c.clients_per_node
        warn_until_enough_nodes(grid, self.min_available_nodes, c)
        _, available = sample_nodes(grid, self.min_available_nodes, self.min_available_nodes)  # waits
        excluded = self.excluded_nodes
        eligible = sorted(n for n in available if n not in excluded)
        if len(eligible) * cpn < c.min_replies:
            raise NotEnoughNodes(
                f"only {len(eligible)} eligible node(s) left, fewer than min-replies = {c.min_replies}: "
                f"{len(excluded)} node(s) excluded after {c.max_node_refusals} consecutive refusals ("
                + "; ".join(f"node {n}: {why}" for n, why in sorted(excluded.items())) + ")"
            )
        population = [(n, j) for n in eligible for j in range(cpn)]
        k = min(c.clients_per_round, len(population))
        if k < c.clients_per_round:
            log.warning("round t=%d: only %d eligible clients (%d nodes excluded for refusing): sampling all of them",
                        t, len(population), len(excluded))
        rng = random.Random(f"{c.seed}:{t}") if c.seed >= 0 else random.SystemRandom()
        slots: dict[int, list[int]] = {}
        for node, j in sorted(rng.sample(population, k)):
            slots.setdefault(node, []).append(j)
        return {n: tuple(js) for n, js in slots.items()}, available

    def _event(self, kind: str, data: dict[str, Any]) -> None:
        if self.on_event is not None:
            self.on_event(kind, data)

    def _track_refusals(self, server_round: int, usable: list, dropped: list[tuple[int, str, bool]]) -> None:
        """Count consecutive refusals per node; exclude a node after ``max-node-refusals``."""
        for u in usable:
            if u.node_id in self.refusals:
                self.refusals[u.node_id].consecutive = 0
        limit = self.dp_config.max_node_refusals
        for node, reason, refused in dropped:
            if not refused:
                continue
            state = self.refusals.setdefault(node, NodeRefusals())
            state.consecutive += 1
            state.total += 1
            state.last_reason = reason
            if state.excluded_at_round is None and state.consecutive >= limit:
                state.excluded_at_round = server_round
                log.error("round %d: node %d refused %d rounds in a row; it is no longer sampled "
                          "(last refusal: %s)", server_round, node, state.consecutive, reason)
                self._event("node-excluded", {"node_id": node, "round": server_round,
                                              "consecutive_refusals": state.consecutive, "reason": reason})

    def aggregate_train(
        self, server_round: int, replies: Iterable[Message]
    ) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate usable replies, account the round, merge ``dp-*`` metrics."""
        pending = self._round
        if pending is None or pending.server_round != server_round:
            raise RuntimeError(f"round {server_round} was not configured by this strategy")
        reference, planned = pending.reference, pending.planned
        asked = {m.metadata.dst_node_id: m.metadata.message_id for m in pending.sent}
        usable, dropped = screen(
            list(replies), asked=asked, reference=reference, arrays_key=self.arrayrecord_key,
            fedprox=self.dp_config.algorithm == "fedprox", slots=pending.slots,
            clients_per_node=self.dp_config.clients_per_node, rules=rules_for(self.dp_config, planned),
        )
        usable = self.guard.check_partitions(usable, dropped)
        usable = self.guard.accountable(usable, dropped, planned, lambda us: self._record(
            server_round, planned, us, self._weights(us), applied=True, quiet=True))
        self.residual_energies.extend((server_round, u.node_id, u.residual_energy) for u in usable)
        for node, reason, refused in dropped:
            log.warning("round %d: dropped reply of node %d: %s%s", server_round, node, reason,
                        " (refusal)" if refused else "")
        self._track_refusals(server_round, usable, dropped)
        missing = len(asked) - len(usable) - len(dropped)
        if missing > 0:
            log.warning("round %d: %d of %d sampled nodes did not reply in time", server_round, missing, len(asked))
        if not usable:
            log.warning("round %d: no usable reply; nothing aggregated or accounted", server_round)
            self._event("round-void", {"round": planned.round_index + 1, "reason": "no usable reply"})
            return None, None

        weights = self._weights(usable)
        arrived = sum(len(u.members) for u in usable)
        aggregated = arrived >= self.dp_config.min_replies
        arrays = average_arrays(usable, weights, reference) if aggregated else None
        if arrays is not None and not all_finite(arrays):  # not applied; accounted; then the run fails
            self.diverged = f"round {server_round}: the aggregated global model has non-finite values"
            log.error("%s: the global model is kept and the run stops after recording the round", self.diverged)
            arrays, aggregated = None, False
        record = self._record(server_round, planned, usable, weights, applied=aggregated)
        if self.budget is not None:
            try:
                check_replies(self.accountant, self.budget, record)
            except BudgetExhausted:  # the round is discarded unaggregated; the run stops
                self._event("round-void", {"round": record.round, "reason": "budget", "replies": record.clients})
                raise
        before = self.accountant.report().certified.epsilon
        expected = self.accountant.peek(self.accountant.config.planned_round(record.round)).certified.epsilon
        report = self.accountant.step(record)
        if not aggregated and self.diverged is None:
            log.warning(
                "round %d: %d usable clients < min-replies %d: global model kept; round accounted "
                "with the %d clients that replied, as not applied (it stays out of the final-model bound)",
                server_round, arrived, self.dp_config.min_replies, arrived,
            )
        metrics = {**average_metrics(usable, weights), **dp_metrics(report), "dp-aggregated": int(aggregated),
                   "dp-dropped": len(dropped), "dp-echo-mismatch": self._last_mismatch,
                   "dp-epsilon-increase": report.certified.epsilon - before,
                   "dp-expected-epsilon-increase": expected - before}
        # global_arrays (what a stop saves as the final model) changes only once the round line is durable
        pending.record, pending.report, pending.metrics = record, report, metrics
        self._train_metrics[server_round] = MetricRecord(metrics)
        return arrays, MetricRecord(metrics)

    def _weights(self, usable: list) -> tuple[float, ...]:
        return weights_for(usable, self.dp_config.weighting, self.dp_config.examples_cap_ratio)

    def _record(self, server_round: int, planned: Applied, usable: list, weights: tuple[float, ...], *,
                applied: bool, quiet: bool = False) -> RoundRecord:
        """The least private record of the replies; ``quiet``: a trial (ReplyGuard), nothing logged."""
        c = self.dp_config
        if not quiet:
            self._last_mismatch = 0
            for u in usable:
                diff = mismatches(planned, u.applied)
                if diff:
                    self._last_mismatch += 1
                    log.error("round %d: node %d applied other settings than sent (%s); accounting the least "
                              "private values", server_round, u.node_id, "; ".join(diff))
            self.echo_mismatches += self._last_mismatch
        worst, etas = reconcile(planned, [u.applied for u in usable], c.schedule, c.clipping == "per-sample")
        return RoundRecord(
            round=planned.round_index + 1, algorithm=c.algorithm, step_sizes=etas, clip_norm=worst.clip_norm,
            sigma=worst.sigma, weights=weights, clipping=c.clipping, batch_size=worst.batch_size,
            prox_alpha=worst.prox_alpha, node_ids=tuple(m for u in usable for m in u.members), applied=applied,
        )

    # ------------------------------------------------------------ round closing
    def configure_evaluate(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Close the round (central evaluation, round line, checkpoint) before any evaluation
        instruction carries its aggregate to the clients: a round's aggregate is never
        broadcast before its ledger line is durable (what an unfinished-round resume relies on)."""
        self._closed = (server_round, self._after_round(server_round, arrays, self._user_evaluate_fn))
        return super().configure_evaluate(server_round, arrays, config, grid)  # type: ignore[misc]

    def _evaluate(self, server_round: int, arrays: ArrayRecord) -> MetricRecord | None:
        """``Strategy.start``'s evaluate_fn: the initial evaluation, or the result of the round
        closed in :meth:`configure_evaluate` (closed here when that was not called)."""
        closed, self._closed = self._closed, None
        if closed is not None and closed[0] == server_round:
            return closed[1]
        return self._after_round(server_round, arrays, self._user_evaluate_fn)

    def _after_round(self, server_round: int, arrays: ArrayRecord, user_fn: EvaluateFn | None) -> MetricRecord | None:
        result = user_fn(server_round, arrays) if user_fn is not None else None
        if result is not None:
            self._eval_metrics[server_round] = result
        pending, self._round = self._round, None
        if server_round == 0 or pending is None or pending.record is None:
            return result  # the initial evaluation, or a round that accounted nothing
        merged = {**pending.metrics, **(dict(result) if result is not None else {})}
        self.global_arrays = arrays
        outcome = RoundOutcome(pending.record.round, pending.record, pending.report, merged, arrays)
        for reporter in self.reporters:
            reporter(outcome)
        if self.diverged is not None:  # the round is recorded; the model it produced is not used
            raise ModelNotFinite(self.diverged)
        return result

    def start(
        self,
        grid: Grid,
        initial_arrays: ArrayRecord,
        num_rounds: int | None = None,
        timeout: float | None = None,
        train_config: ConfigRecord | None = None,
        evaluate_config: ConfigRecord | None = None,
        evaluate_fn: EvaluateFn | None = None,
    ) -> Result:
        """``Strategy.start`` with the run's defaults and a clean stop on budget exhaustion.

        ``num_rounds`` defaults to ``num-server-rounds`` minus the rounds already accounted
        (resume), ``timeout`` to ``round-timeout``. On :class:`BudgetExhausted` the partial
        :class:`Result` (last global model, metrics so far) is returned and ``stop_reason`` set.
        """
        if num_rounds is None:
            num_rounds = max(self.dp_config.num_server_rounds - self.accountant.num_releases, 0)
        timeout = self.dp_config.round_timeout if timeout is None else timeout
        self.global_arrays = initial_arrays
        self._user_evaluate_fn, self._closed = evaluate_fn, None
        t0 = time.time()
        try:
            return super().start(  # type: ignore[misc]
                grid=grid, initial_arrays=initial_arrays, num_rounds=num_rounds, timeout=timeout,
                train_config=train_config, evaluate_config=evaluate_config, evaluate_fn=self._evaluate,
            )
        except BudgetExhausted as exc:
            self.stop_reason = exc.reason
            log.warning("%s (after %.1fs)", exc.reason, time.time() - t0)
            return self.partial_result()

    def partial_result(self) -> Result:
        """The :class:`Result` so far (last global model, metrics of the rounds that ran)."""
        return Result(
            arrays=self.global_arrays, train_metrics_clientapp=dict(self._train_metrics),
            evaluate_metrics_serverapp=dict(self._eval_metrics),
        )


def nodes_needed(config: AppConfig) -> int:
    """Connected nodes a round waits for: enough to offer ``clients-per-round`` clients."""
    return -(-config.clients_per_round // config.clients_per_node)


class NoisyFedAvg(NoisyStrategyMixin, FedAvg):
    """FedAvg whose clients upload K clipped GD steps + N(0, sigma^2 I) (Noisy-FedAvg)."""

    def __init__(self, config: AppConfig, accountant: PrivacyAccountant, *, reporters: Sequence[Any] = (),
                 fraction_evaluate: float = 0.0, **fedavg_kwargs: Any) -> None:
        m = nodes_needed(config)
        super().__init__(fraction_train=1.0, fraction_evaluate=fraction_evaluate, min_train_nodes=m,
                         min_evaluate_nodes=m if fraction_evaluate > 0 else 0, min_available_nodes=m, **fedavg_kwargs)
        self._init_dp(config, accountant, reporters)


class NoisyFedProx(NoisyStrategyMixin, FedProx):
    """FedProx (sends ``proximal-mu`` = alpha) with noisy uploads (Noisy-FedProx)."""

    def __init__(self, config: AppConfig, accountant: PrivacyAccountant, *, reporters: Sequence[Any] = (),
                 fraction_evaluate: float = 0.0, **fedprox_kwargs: Any) -> None:
        m = nodes_needed(config)
        super().__init__(fraction_train=1.0, fraction_evaluate=fraction_evaluate, min_train_nodes=m,
                         min_evaluate_nodes=m if fraction_evaluate > 0 else 0, min_available_nodes=m,
                         proximal_mu=config.prox_alpha, **fedprox_kwargs)
        self._init_dp(config, accountant, reporters)


def make_strategy(config: AppConfig, accountant: PrivacyAccountant, **kwargs: Any) -> NoisyStrategyMixin:
    """NoisyFedAvg or NoisyFedProx according to ``algorithm``."""
    cls = NoisyFedProx if config.algorithm == "fedprox" else NoisyFedAvg
    return cls(config, accountant, **kwargs)

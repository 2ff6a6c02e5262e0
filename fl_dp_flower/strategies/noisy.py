"""Noisy-FedAvg / Noisy-FedProx on ``flwr.serverapp.strategy`` with a per-round accountant.

Per round (``Strategy.start`` drives it; docs/ARCHITECTURE.md has the data flow): ``configure_train`` (budget
pre-check, sampling, the ``dp.*`` instruction), ``aggregate_train`` (screening: :mod:`.replies`,
:mod:`.screening`, :mod:`.guard`; the record of what arrived; the exact budget check; ``accountant.step``;
aggregation), then, before any client-evaluation broadcast, central evaluation and the sinks (``on_round``;
events go to their ``on_event``).

Library use: ``NoisyFedAvg(DPSettings(...), accountant, federation=..., budget=..., sinks=[...])`` with any
initial ``ArrayRecord``; the accountant's plan must match the settings (checked, naming the field). The
reference app builds the same objects from its run config (``fl_dp_flower.app.strategy.make_strategy``).

Round numbering: the schedule index t (``dp.round-index``, 0-based) is the number of rounds accounted so far, so
after a resume it continues from the ledger; the record's ``round`` is t + 1. A round in which no usable reply
arrived releases nothing and is not accounted; it does not advance t (the next round retries the same schedule
position).

Under-quorum rounds (1 <= usable replies < ``min-replies``): the uploads were seen by the server, so the round
is accounted with the clients that replied (composition and local DP can only grow), but the global model is not
updated: the record says ``applied = False`` and the final-model bound leaves the round out (adding a noisy
round would lower it although its noise never reached the released model, docs/MATH.md §14.3a).

A non-finite aggregate (which screening makes impossible short of a bug) is not used: the round stays accounted
and recorded, then :class:`ModelNotFinite` fails the run. Sampling and refusing nodes: :mod:`.sampling`. Server
optimizer and averaged release (post-processing of the accounted aggregate): :mod:`.server_opt`."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import FedAvg, FedProx, Result

from fl_dp_flower import protocol
from fl_dp_flower.privacy.accountant import Budget, PrivacyAccountant, PrivacySpent
from fl_dp_flower.privacy.records import RoundRecord
from fl_dp_flower.reporting.rounds import PrivacySink, RoundOutcome, dp_metrics, without_dp_metrics
from fl_dp_flower.settings import DPSettings, FederationSettings

from .construction import check_arguments, check_flower_keywords
from .budget import UPLOAD_OBSERVING, BudgetExhausted, check_before_broadcast, check_replies
from .guard import ReplyGuard, all_finite, unreplied_charge
from .pending import ModelNotFinite, PendingRound
from .preflight import check_budget, check_final_model_outputs, log_preflight, nothing_accounted
from .sampling import NodeRefusals, NodeSampling, check_plan
from .echo import Applied
from .replies import Usable, average_metrics, batch_rate, charged_echoes, member_id, mismatches, reconcile
from .screening import ReplyChecks, ScreeningRules, rules_for
from .server_opt import ServerUpdate
from .shared_stats import SharedStatisticsNote

log = logging.getLogger("flwr").getChild(__name__)  # Flower's handlers: shows in `flwr log`

EvaluateFn = Callable[[int, ArrayRecord], MetricRecord | None]


class NoisyStrategyMixin(NodeSampling):
    """Shared per-round logic; must precede FedAvg/FedProx in the MRO."""

    # attributes provided by FedAvg
    arrayrecord_key: str
    configrecord_key: str
    min_available_nodes: int
    #: True when the reference app drives the strategy: it logs its own preflight and fails a run that accounted
    #: nothing itself (fl_dp_flower.app.strategy sets it); library use: the strategy does both
    app_managed: bool = False

    def _init_dp(self, settings: DPSettings, accountant: PrivacyAccountant, federation: FederationSettings,
                 budget: Budget | None, sinks: Sequence[PrivacySink], reply_checks: ReplyChecks | None) -> None:
        check_arguments(settings, accountant, federation, budget, sinks, reply_checks)  # TypeError naming the argument
        check_plan(settings, accountant.config, federation, reply_checks)
        check_budget(budget, accountant.config, federation.num_server_rounds, reply_checks)
        self.settings = settings
        self.federation = federation
        self.reply_checks = reply_checks or ReplyChecks()
        self.accountant = accountant
        self.sinks: list[PrivacySink] = list(sinks)
        self.budget = budget
        self.global_arrays: ArrayRecord | None = None
        self.stop_reason: str | None = None
        self.echo_mismatches = 0
        self._void_drop = 0.0  # screening drop probability of void rounds, charged with the next record (MATH §17.1)
        self._last_mismatch = 0
        self.refusals: dict[int, NodeRefusals] = {}
        self._round: PendingRound | None = None
        self._user_evaluate_fn: EvaluateFn | None = None
        self._closed: tuple[int, MetricRecord | None] | None = None  # round closed before its evaluation
        self._train_metrics: dict[int, MetricRecord] = {}  # the Result so far, per server round
        self._eval_metrics: dict[int, MetricRecord] = {}
        self.guard = ReplyGuard(accountant, log, self._event)  # partition claims, per-reply accountant errors
        self.residual_energies: list[tuple[int, int, float | None]] = []  # (round, node, E): tests, never published
        self.diverged: str | None = None
        self.shared_statistics = SharedStatisticsNote(settings.batch_sampling == "poisson", log)  # share-metrics
        self.server_update = ServerUpdate(federation, accountant.config.threat_model)  # refused under final-model

    # ------------------------------------------------------------------ planning
    @property
    def round_index(self) -> int:
        """0-based schedule index t of the next round (= rounds accounted so far)."""
        return self.accountant.num_releases

    def privacy_spent(self, delta: float | None = None) -> PrivacySpent:
        """Cumulative certified spend (like Flower's DP wrappers' ``privacy_spent()``)."""
        return self.accountant.get_privacy_spent(delta)

    def planned(self, t: int) -> Applied:
        c = self.settings
        return Applied(
            sigma=c.sigma, clip_norm=c.clip_norm, local_steps=c.local_steps, lr=c.lr, round_index=t,
            batch_size=c.batch_size, prox_alpha=c.fedprox_alpha,
        )

    def instruction(self, t: int) -> protocol.TrainInstruction:
        """The train instruction of schedule index ``t``."""
        c = self.settings
        return protocol.TrainInstruction(
            round_index=t, algorithm=c.algorithm, schedule=c.schedule, lr=c.lr, local_steps=c.local_steps,
            clip_norm=c.clip_norm, sigma=c.sigma, clipping=c.clipping, batch_size=c.batch_size,
            prox_alpha=c.prox_alpha if c.algorithm == "fedprox" else 0.0, seed=c.seed,
            batch_sampling=c.batch_sampling,
        )

    def train_settings(self, t: int) -> dict[str, Any]:
        """The contract's ``dp.*`` train keys for schedule index ``t``."""
        return self.instruction(t).to_config()

    # ------------------------------------------------------------------ training
    def configure_train(
        self, server_round: int, arrays: ArrayRecord, config: ConfigRecord, grid: Grid
    ) -> Iterable[Message]:
        """Budget check, then exactly ``clients-per-round`` train instructions."""
        if self.budget is not None:
            check_before_broadcast(self.accountant, self.budget, self.federation.min_replies)
        t, arrays = self.round_index, self.server_update.broadcast(arrays)  # clients train from the iterate
        slots, available = self._sample(grid, t)
        members = sorted(member_id(n, j, self.federation.clients_per_node) for n, js in slots.items() for j in js) \
            if self.cohort else sorted(slots)
        log.info("round %d (t=%d): sampled %d clients on %d of %d nodes", server_round, t, len(members),
                 len(slots), len(available))
        # write-ahead, with what a resume charges if the round is left open (min-replies: the smallest sum)
        self._open_round(t + 1, members, min_replies=self.federation.min_replies,
                         screening_drop=self._screening_rules(self.planned(t)).drop_probability)
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
                node_config[protocol.MEMBERS] = list(js)
            record = RecordDict({self.arrayrecord_key: arrays, self.configrecord_key: node_config})
            messages.append(Message(content=record, dst_node_id=node, message_type=MessageType.TRAIN))
        # the Grid sets each message's id when it pushes it: kept to name the node of an error reply
        self._round = PendingRound(server_round, self.planned(t), messages, arrays,
                                   slots=slots if self.cohort else None)
        return messages

    @property
    def cohort(self) -> bool:
        """Cohort mode: every node stands for ``clients-per-node`` virtual clients."""
        return self.federation.clients_per_node > 1

    def _event(self, kind: str, data: dict[str, Any]) -> None:
        kind, data = self._routed(kind, data)  # a secret sample's node ids: the members file only
        for sink in self.sinks:
            sink.on_event(kind, data)

    def aggregate_train(self, server_round: int, replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Aggregate usable replies, account the round, merge ``dp-*`` metrics."""
        pending = self._round
        if pending is None or pending.server_round != server_round:
            raise RuntimeError(f"round {server_round} was not configured by this strategy")
        reference, planned = pending.reference, pending.planned
        asked = {m.metadata.dst_node_id: m.metadata.message_id for m in pending.sent}
        dropped: list[tuple[int, str, bool]] = []
        seen: list[Usable] = []  # curious-server: the dropped uploads the server holds (docs/MATH.md §23.2)
        usable = self._screen_replies(list(replies), pending, dropped, seen)
        self.shared_statistics.see(server_round, ((u.node_id, u.metrics) for u in usable))  # WARNING once per run
        self.residual_energies.extend((server_round, u.node_id, u.residual_energy) for u in usable)
        for node, reason, refused in dropped:
            log.warning("round %d: dropped reply of node %d: %s%s", server_round, node, reason, " (refusal)" * refused)
        self._track_refusals(server_round, usable, dropped)
        missing = len(set(asked) - {u.node_id for u in usable} - {node for node, _, _ in dropped})
        if missing > 0:
            log.warning("round %d: %d of %d sampled nodes did not reply in time", server_round, missing, len(asked))
        late = missing > 0 and self.accountant.config.threat_model in UPLOAD_OBSERVING  # may hold late uploads
        if not usable and not seen and not late and not self.federation.poisson:  # Poisson: accounted even so
            log.warning("round %d: no usable reply; nothing aggregated or accounted", server_round)
            self._event("round-void", {"round": planned.round_index + 1, "reason": "no usable reply"})
            self._void_drop += self._screening_rules(planned).drop_probability  # a drop may have voided it
            return None, None

        charged = usable or seen  # a curious server saw the dropped uploads: charged, never aggregated
        weights = self._weights(charged)
        arrived = sum(len(u.members) for u in usable)
        aggregated = bool(usable) and arrived >= self.federation.min_replies
        arrays = self._aggregate(usable, weights, reference) if aggregated else None
        if arrays is not None and not all_finite(arrays):  # not applied; accounted; then the run fails
            self.diverged = f"round {server_round}: the aggregated global model has non-finite values"
            log.error("%s: the global model is kept and the run stops after recording the round", self.diverged)
            arrays, aggregated = None, False
        record = unreplied_charge(self._record(server_round, planned, charged, weights, applied=aggregated, seen=seen)
                                  if charged or self.federation.poisson else None, self.accountant.config, missing, planned.round_index + 1)
        if self.budget is not None:
            try:
                check_replies(self.accountant, self.budget, record)
            except BudgetExhausted:  # the round is discarded unaggregated; the run stops
                self._event("round-void", {"round": record.round, "reason": "budget", "replies": record.clients})
                raise
        before = self.accountant.report().certified.epsilon
        expected = self.accountant.peek_epsilon(self.accountant.config.planned_round(record.round))
        report = self.accountant.step(record)
        self._void_drop = 0.0
        arrays = self.server_update.apply(reference, arrays, record.round) if arrays is not None else None
        if not aggregated and self.diverged is None:
            log.warning(
                "round %d: %d usable clients < min-replies %d: global model kept; round accounted "
                "with the %d clients that replied, as not applied (it stays out of the final-model bound)",
                server_round, arrived, self.federation.min_replies, arrived,
            )
        metrics: dict[str, Any] = {
                   **self._published_stats(record.round, {**(average_metrics(usable, weights) if usable else {}),
                                                          "dp-capped": self._last_capped, "dp-echo-mismatch": self._last_mismatch}),
                   **dp_metrics(report), "dp-aggregated": int(aggregated), "dp-dropped": len(dropped),
                   "dp-epsilon-increase": report.certified.epsilon - before,
                   "dp-expected-epsilon-increase": expected - before}
        # global_arrays (what a stop saves as the final model) changes only once the round line is durable
        pending.record, pending.report, pending.metrics = record, report, metrics
        self._train_metrics[server_round] = MetricRecord(metrics)  # the Result's: every dp-* number (start)
        return arrays, MetricRecord(without_dp_metrics(metrics))  # what Flower prints every round and at the end

    def _screening_rules(self, planned: Applied) -> ScreeningRules:
        """The reply checks of this round (:class:`ReplyChecks`: the library's defaults unless given)."""
        return rules_for(planned, self.settings, self.accountant.config, self.reply_checks)

    def _record(self, server_round: int, planned: Applied, usable: list, weights: tuple[float, ...], *,
                applied: bool, quiet: bool = False, seen: Sequence[Usable] = ()) -> RoundRecord:
        """The least private record of the replies (``seen``: dropped uploads a curious server holds, replies.py's
        charged_echoes, batch_rate); ``quiet``: a trial (ReplyGuard), nothing logged."""
        c = self.settings
        if not quiet:
            self._last_mismatch = 0
            for u in usable:
                diff = mismatches(planned, u.applied)
                if diff:
                    self._last_mismatch += 1
                    log.error("round %d: node %d applied other settings than sent (%s); accounting the least "
                              "private values", server_round, u.node_id, "; ".join(diff))
            self.echo_mismatches += self._last_mismatch
        worst, etas = reconcile(planned, charged_echoes(usable, seen, self._screening_rules(planned)), c.schedule,
                                c.clipping == "per-sample")
        return RoundRecord(
            round=planned.round_index + 1, algorithm=c.algorithm, step_sizes=etas, clip_norm=worst.clip_norm,
            sigma=worst.sigma, weights=weights, clipping=c.clipping, batch_size=worst.batch_size,
            prox_alpha=worst.prox_alpha, applied=applied,
            node_ids=self._published_ids(planned.round_index + 1, tuple(m for u in usable for m in u.members), quiet=quiet),
            screening_drop=min(1.0, self._screening_rules(planned).drop_probability + self._void_drop),
            batch_rate=batch_rate([*usable, *seen]) if c.batch_sampling == "poisson" else None, **self._sampling_fields(usable))

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
        merged = {**(pending.metrics or {}), **(dict(result) if result is not None else {})}
        self.global_arrays = arrays
        outcome = RoundOutcome(pending.record.round, pending.record, pending.report, merged, arrays)
        for sink in self.sinks:
            sink.on_round(outcome)
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
        The sinks get ``budget-stop`` (if so) and ``end`` events when it returns.
        """
        if num_rounds is None:
            num_rounds = max(self.federation.num_server_rounds - self.accountant.num_releases, 0)
        timeout = self.federation.round_timeout if timeout is None else timeout
        check_final_model_outputs(self.accountant.config.threat_model, getattr(self, "fraction_evaluate", 0.0), evaluate_fn)
        self.global_arrays = initial_arrays
        self._user_evaluate_fn, self._closed = evaluate_fn, None
        if not self.app_managed:  # library use (the reference app logs its own)
            log_preflight(self.accountant, self.budget, initial_arrays, num_rounds, log)
        t0 = time.time()
        accounted_before = self.accountant.num_releases
        try:
            result: Result = super().start(  # type: ignore[misc]
                grid=grid, initial_arrays=initial_arrays, num_rounds=num_rounds, timeout=timeout,
                train_config=train_config, evaluate_config=evaluate_config, evaluate_fn=self._evaluate,
            )
            result.train_metrics_clientapp = dict(self._train_metrics)  # Flower printed them without dp-*
        except BudgetExhausted as exc:
            self.stop_reason = exc.reason
            log.warning("%s (after %.1fs)", exc.reason, time.time() - t0)
            self._event("budget-stop", {"reason": exc.reason, "rounds_accounted": self.accountant.num_releases})
            result = self.partial_result()
        self._event("end", {"rounds_accounted": self.accountant.num_releases,
                            "rounds_this_run": self.accountant.num_releases - accounted_before,
                            "stopped_by_budget": self.stop_reason is not None})
        if not self.app_managed and self.accountant.num_releases == accounted_before and self.stop_reason is None:
            nothing_accounted(num_rounds)  # library use (the ServerApp fails such a run itself, RunFailed)
        return result

    def partial_result(self) -> Result:
        """The :class:`Result` so far (last global model, metrics of the rounds that ran)."""
        return Result(
            arrays=self.global_arrays if self.global_arrays is not None else ArrayRecord(),
            train_metrics_clientapp=dict(self._train_metrics),
            evaluate_metrics_serverapp=dict(self._eval_metrics),
        )


class NoisyFedAvg(NoisyStrategyMixin, FedAvg):
    """FedAvg whose clients upload K clipped GD steps + N(0, sigma^2 I) (Noisy-FedAvg).

    settings: what every client does; accountant: a :class:`PrivacyAccountant` whose plan matches
    them (``settings.accountant_config(clients=...)``); federation: sampling and quorum (default
    :class:`FederationSettings`); budget: stop before the certified epsilon would exceed it;
    sinks: :class:`PrivacySink` s (ledger, console, Prometheus, your own); reply_checks: the server's checks of
    each reply (:class:`~fl_dp_flower.strategies.screening.ReplyChecks`; default: its defaults).
    """

    def __init__(self, settings: DPSettings, accountant: PrivacyAccountant, *,
                 federation: FederationSettings | None = None, budget: Budget | None = None,
                 sinks: Sequence[PrivacySink] = (), fraction_evaluate: float = 0.0,
                 reply_checks: ReplyChecks | None = None, **fedavg_kwargs: Any) -> None:
        check_flower_keywords("NoisyFedAvg", fedavg_kwargs)  # those it sets itself, naming where they belong
        federation = federation or FederationSettings()
        m = federation.nodes_needed
        super().__init__(fraction_train=1.0, fraction_evaluate=fraction_evaluate, min_train_nodes=m,
                         min_evaluate_nodes=m if fraction_evaluate > 0 else 0, min_available_nodes=m, **fedavg_kwargs)
        self._init_dp(settings, accountant, federation, budget, sinks, reply_checks)


class NoisyFedProx(NoisyStrategyMixin, FedProx):
    """FedProx (sends ``proximal-mu`` = alpha) with noisy uploads (Noisy-FedProx); arguments as
    :class:`NoisyFedAvg` (``settings.algorithm`` must be ``"fedprox"``)."""

    def __init__(self, settings: DPSettings, accountant: PrivacyAccountant, *,
                 federation: FederationSettings | None = None, budget: Budget | None = None,
                 sinks: Sequence[PrivacySink] = (), fraction_evaluate: float = 0.0,
                 reply_checks: ReplyChecks | None = None, **fedprox_kwargs: Any) -> None:
        if settings.algorithm != "fedprox":
            raise ValueError(f"NoisyFedProx needs settings.algorithm = 'fedprox', got {settings.algorithm!r}")
        check_flower_keywords("NoisyFedProx", fedprox_kwargs)
        federation = federation or FederationSettings()
        m = federation.nodes_needed
        super().__init__(fraction_train=1.0, fraction_evaluate=fraction_evaluate, min_train_nodes=m,
                         min_evaluate_nodes=m if fraction_evaluate > 0 else 0, min_available_nodes=m,
                         proximal_mu=settings.prox_alpha, **fedprox_kwargs)
        self._init_dp(settings, accountant, federation, budget, sinks, reply_checks)

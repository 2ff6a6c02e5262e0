"""Which nodes a round asks: sampling of eligible clients and exclusion of refusing nodes.

Two samplers (``client-sampling``): "fixed" draws exactly ``clients-per-round`` distinct clients;
"poisson" includes every eligible client (eligible nodes x ``clients-per-node`` virtual clients,
the population N_t) independently with probability q = ``sampling-rate``, and its aggregate has
the fixed denominator q N_t: w_t + sum of (upload - w_t) over the contributions that arrived,
divided by q N_t (a sum mechanism, docs/MATH.md §19). A Poisson round that samples nobody, or
from which nothing usable arrives, keeps the global model and is accounted all the same (with no
contribution: the amplified bound charges it as if the target alone might have taken part).

A node that refuses (``Error`` reply from its guardrails or policy, or any reply of its own that
screening drops: malformed, rejected) ``max-node-refusals`` rounds in a row is no longer sampled
(logged at ERROR, reported in the summary and as a ``node-excluded`` ledger event). The claimants of
a contested partition id (:mod:`.guard`) are set aside: not sampled, since none of their replies
could be used (a secure sum with one of them would never be unmasked), and not counted as refusing.
When fewer eligible nodes than ``clients-per-round`` remain, every eligible node is sampled; when
fewer than ``min-replies`` remain, the run fails with :class:`NotEnoughNodes`.

``weighting = "examples"``: a node whose num-examples is capped (``examples-cap-ratio`` times the
round's median claim) in ``max-node-refusals`` of its usable replies in a row is *flagged*, not
excluded (a site may truly hold ten times the median): an ERROR naming it and its claim, a
``node-capped`` ledger event, its counts in the summary's ``node_refusals``; every round's ``dp-capped``
metric counts its capped replies. The accountant uses the capped weights as aggregated, so the
bound stays sound; what the flag says is that one node steers most of the model.
"""

from __future__ import annotations

import contextlib
import logging
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy.strategy_utils import sample_nodes

from fl_dp_flower import protocol
from .screening import ReplyChecks
from fl_dp_flower.errors import FlDpError
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.plan_rules import colluding_nodes, secret_echo_problems, secure_contributor_problems
from fl_dp_flower.privacy.records import AccountantConfig
from fl_dp_flower.privacy.secure_aggregation import NOT_YET_CERTIFIABLE, SECURE_AGGREGATION_THREAT
from fl_dp_flower.reporting.ledger.events import MEMBERS_EVENT, NODE_ID_EVENTS
from fl_dp_flower.settings import DPSettings, FederationSettings

from .guard import UnaccountableSum
from .nodes import warn_until_enough_nodes
from .ndarrays import array_values
from .replies import Usable, average_arrays, capped_examples, screen, weights_for

log = logging.getLogger("flwr").getChild(__name__)


class NotEnoughNodes(FlDpError, RuntimeError):
    """Fewer eligible nodes than ``min-replies`` remain after excluding refusing nodes. The message names them;
    ``counts`` says the same in counts (what a secret sample's ledger may hold: a refusing node was drawn)."""

    def __init__(self, message: str, counts: str | None = None) -> None:
        super().__init__(message)
        self.counts = message if counts is None else counts


@dataclass
class NodeRefusals:
    """Refusals of one node: ``consecutive`` since its last usable reply, ``total`` overall; with
    ``weighting = "examples"``, ``capped`` / ``capped_total``: its usable replies whose num-examples was
    capped, in a row and overall, and ``flagged_at_round``: the round its claims were flagged."""

    consecutive: int = 0
    total: int = 0
    last_reason: str = ""
    excluded_at_round: int | None = None
    capped: int = 0
    capped_total: int = 0
    flagged_at_round: int | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"consecutive": self.consecutive, "total": self.total, "last_reason": self.last_reason,
                "excluded_at_round": self.excluded_at_round, "capped": self.capped,
                "capped_total": self.capped_total, "flagged_at_round": self.flagged_at_round}


def check_plan(settings: DPSettings, config: AccountantConfig, federation: FederationSettings,
               reply_checks: ReplyChecks | None = None) -> None:
    """Raise ``ValueError`` naming each field where the accountant's plan differs from the settings,
    the planned contributions per round and the sampler included, for secure aggregation without
    the integer sum's grid (the real-valued sum's bound is for planning only), and for a secret sample
    whose ``reply_checks`` accept echoes other than the plan (docs/MATH.md §22)."""
    tolerance = reply_checks.echo_tolerance if isinstance(reply_checks, ReplyChecks) else 1.0  # a wrong type: later
    for problem in secret_echo_problems(federation.sample_secrecy, tolerance):
        raise ValueError(problem)
    if config.threat_model == SECURE_AGGREGATION_THREAT:
        if config.sum_grid_step is None:
            raise ValueError(f"threat_model '{SECURE_AGGREGATION_THREAT}' without sum_grid_step is for planning only "
                             f"(plan, calibrate, `fl-dp-flower privacy`): {NOT_YET_CERTIFIABLE}")
        if config.sum_clients_per_upload != federation.clients_per_node:
            raise ValueError(f"the accountant's sum_clients_per_upload {config.sum_clients_per_upload} is not the "
                             f"federation's clients_per_node {federation.clients_per_node}: a cohort node uploads its "
                             "members' integer sum, whose clamp the accountant charges (docs/MATH.md §20.6)")
        for problem in secure_contributor_problems(federation.clients_per_round, federation.min_replies,
                                                   config.colluders, federation.clients_per_node):
            raise ValueError(problem)  # before round 1: otherwise every round is abandoned, silently
    if config.sample_secrecy != federation.sample_secrecy:
        raise ValueError(f"the accountant's sample_secrecy {config.sample_secrecy!r} does not match the federation's "
                         f"{federation.sample_secrecy!r}: a secret-sample bound needs a ledger without member ids, and "
                         "a ledger without them is certified as such")
    if config.sampling_rate != federation.accountant_sampling_rate:
        raise ValueError(f"the accountant's sampling_rate {config.sampling_rate!r} does not match the federation "
                         f"(client_sampling {federation.client_sampling!r}, sampling_rate {federation.sampling_rate!r}"
                         f"; expected {federation.accountant_sampling_rate!r})")
    settings.check_accountant(config, federation.planned_clients)


def check_grid(grid: Grid, config: AccountantConfig, min_replies: int = 1,
               admit: Callable[[dict[int, dict[str, Any]]], list[tuple[int, str]]] | None = None) -> None:
    """The Grid the threat model needs. ``secure-aggregation``: a :class:`~.secagg.SecAggGrid` whose grid step is
    the accountant's (on a plain Grid the server would hold every upload, where only local DP holds), at least
    ``min_replies`` contributors per sum; it is told the accountant's dimension (checked against the model),
    the colluders (SecAgg+'s threshold must exceed them; :data:`~.secagg.HONEST_MINIMUM` others per sum) and
    ``admit``, the strategy's check of the contributors' echoes before a sum is unmasked. ``curious-server``: no SecAggGrid (its
    replies all hold the unmasked average, which the per-reply checks may drop, and a dropped round would
    leave a sum the server has seen unaccounted; all-rounds and final-model trust the server: a dropped
    round releases nothing to their adversary)."""
    from .secagg import HONEST_MINIMUM, SecAggGrid

    if isinstance(grid, SecAggGrid) and config.threat_model == "curious-server":
        raise ValueError("SecAggGrid is refused under threat_model 'curious-server': a round whose replies "
                         "screening drops would leave the unmasked sum unaccounted (docs/MATH.md §20.5); use "
                         f"threat_model '{SECURE_AGGREGATION_THREAT}'")
    if config.threat_model == SECURE_AGGREGATION_THREAT:
        if not isinstance(grid, SecAggGrid):
            raise ValueError(f"threat_model '{SECURE_AGGREGATION_THREAT}' needs a SecAggGrid (strategies.secagg): on "
                             f"{type(grid).__name__} the server would hold every client's upload")
        if grid.grid.step != config.sum_grid_step:
            raise ValueError(f"the SecAggGrid's grid step {grid.grid.step!r} is not the accountant's sum_grid_step "
                             f"{config.sum_grid_step!r}")
        if grid.min_contributors < min_replies:
            raise ValueError(f"the SecAggGrid's min_contributors {grid.min_contributors} is below min-replies "
                             f"{min_replies}: the budget is checked for sums of at least min-replies clients")
        grid.expected_dimension, grid.honest_minimum = config.sum_dimension, HONEST_MINIMUM
        grid.colluders = colluding_nodes(config.colluders, config.sum_clients_per_upload)  # nodes (MATH §20.6)
        grid.admit = admit


def fixed_denominator_sum(usable: list[Usable], reference: ArrayRecord, denominator: float) -> ArrayRecord:
    """w_t + sum over replies of (reply - M w_t) / ``denominator`` (q N_t) in float64, cast back to the
    broadcast dtypes; each reply is the sum of its M members' uploads (docs/MATH.md §19)."""
    out: dict[str, Array] = {}
    for key, ref in reference.items():
        w = array_values(ref).astype(np.float64)
        acc = np.zeros(ref.shape, dtype=np.float64)
        for u in usable:
            acc += array_values(u.arrays[key]).astype(np.float64) - len(u.members) * w
        total = w + acc / denominator
        dtype = array_values(ref).dtype
        if np.issubdtype(dtype, np.integer):
            total = np.rint(total)
        out[key] = Array(np.ascontiguousarray(total.astype(dtype)))
    return ArrayRecord(out)


class NodeSampling:
    """Sampling and refusal tracking of the noisy strategies (a mixin: needs ``federation``,
    ``accountant``, ``refusals``, ``min_available_nodes`` and ``_event``)."""

    federation: FederationSettings
    accountant: PrivacyAccountant
    refusals: dict[int, NodeRefusals]
    min_available_nodes: int
    reply_checks: ReplyChecks
    _population: int = 0  # N_t of the Poisson round in flight
    _drawn: int = 0  # clients that round's sample drew
    _last_capped: int = 0  # replies whose num-examples was capped in the last aggregated round

    def _weights(self, usable: list) -> tuple[float, ...]:
        return weights_for(usable, self.federation.weighting, self.reply_checks.examples_cap_ratio)

    def _aggregate(self, usable: list[Usable], weights: tuple[float, ...], reference: ArrayRecord) -> ArrayRecord:
        """The round's aggregate: the weighted average, or with Poisson sampling the fixed-denominator sum."""
        if not self.federation.poisson:
            return average_arrays(usable, weights, reference)
        return fixed_denominator_sum(usable, reference, self.federation.sampling_rate * self._population)

    def _sampling_fields(self, usable: Sequence[Usable] = ()) -> dict[str, int]:
        """RoundRecord fields of a Poisson round or a secret sample's round (population N_t, clients drawn k_t);
        {} otherwise. In cohort mode N_t leaves out the undrawn members of every asked node none of whose members
        entered the sum (``usable``: the round's contributors). Review R2: a node that drops out takes all its
        members with it, so given the published counts the others' chance of being in the round is
        n_t / (N_t - M_lost) (the M_lost members of the lost nodes, d_lost of them drawn; n_t = k_t - d_lost), which
        exceeds k_t / N_t when fewer than the average were drawn on the lost nodes; it is at most
        k_t / (N_t - (M_lost - d_lost)), which the weight p_t = k_t / (N_t - c) then is (docs/MATH.md §19.1, §22).
        Outside cohort mode a lost node's one member was drawn, and (k_t - 1) / (N_t - 1) <= k_t / N_t."""
        if not (self.federation.poisson or self.secret_sample):
            return {}
        pending: Any = getattr(self, "_round", None)
        slots = pending.slots if pending is not None else None
        entered = {u.node_id for u in usable}
        lost = sum(self.federation.clients_per_node - len(js) for n, js in (slots or {}).items() if n not in entered)
        return {"population": self._population - lost, "sampled": self._drawn}

    @property
    def secret_sample(self) -> bool:
        return self.federation.sample_secrecy == "secret"

    def _open_round(self, round_: int, members: list[int], **charged: Any) -> None:
        """The write-ahead ``round-open`` event, with ``charged`` (what a resume charges if the round is left
        open). A public sample: it names the members. A secret one (docs/MATH.md §22): it gives their count;
        the ids go out as a ``round-members`` event, which the ledger never writes
        (reporting.rounds.MembersSink keeps them in the owner-only members file)."""
        if not self.secret_sample:
            self._event("round-open", {"round": round_, "node_ids": members, **charged})
            return
        self._event("round-open", {"round": round_, "clients": len(members), **charged})
        self._event(MEMBERS_EVENT, {"round": round_, "drawn": members})

    def _published_ids(self, round_: int, ids: tuple[int, ...], *, quiet: bool) -> tuple[int, ...]:
        """The contributors' ids as the ledger's round record shows them: none with a secret sample (then
        sent to the members file, unless ``quiet``: a trial record)."""
        if not self.secret_sample:
            return ids
        if not quiet:
            self._event(MEMBERS_EVENT, {"round": round_, "entered": list(ids)})
        return ()

    def _published_stats(self, round_: int, stats: dict[str, Any]) -> dict[str, Any]:
        """The contributors' statistics (``num-examples``: the sum of their data sizes; with ``share-metrics`` their
        averaged train loss, ...; ``dp-capped`` and ``dp-echo-mismatch``: how many replies claimed a large data set
        or echoed other settings, e.g. min(B, n) of a node with fewer samples than the batch) as the round's
        published metrics show them: none with a secret sample, whose ledger a reader could match against the
        clients to learn who took part (docs/MATH.md §22; then sent to the members file)."""
        if not self.secret_sample or not stats:
            return stats
        self._event(MEMBERS_EVENT, {"round": round_, "metrics": stats})
        return {}

    def _routed(self, kind: str, data: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Where an event goes. A secret sample (docs/MATH.md §22): an event naming a node (``node-excluded``,
        ``node-capped``, ``partition-claimed``: NODE_ID_EVENTS) would tell a ledger reader, by its round or its
        place between round lines, that the node took part in that round; it becomes a ``round-members`` event
        ``{"event": kind, "data": data}`` (the members file; the ledger never writes it)."""
        if self.secret_sample and kind in NODE_ID_EVENTS:
            return MEMBERS_EVENT, {"event": kind, "data": data}
        return kind, data

    def _event(self, kind: str, data: dict[str, Any]) -> None:
        raise NotImplementedError

    @property
    def excluded_nodes(self) -> dict[int, str]:
        """Nodes no longer sampled, with their last refusal reason."""
        return {n: r.last_reason for n, r in self.refusals.items() if r.excluded_at_round is not None}

    @property
    def set_aside_nodes(self) -> dict[int, str]:
        """Claimants of a contested partition id (not sampled, not refusing), with the contest."""
        guard = getattr(self, "guard", None)  # NoisyStrategyMixin's ReplyGuard (none on a bare sampler)
        contested: dict[int, tuple[int, ...]] = guard.contested if guard is not None else {}
        return {n: f"{protocol.PARTITION_ID} = {p} claimed by nodes {', '.join(map(str, nodes))}"
                for p, nodes in contested.items() for n in nodes}

    def _screen_replies(self, replies: list[Message], pending: Any, dropped: list[tuple[int, str, bool]],
                        observed: list[Usable] | None = None) -> list[Usable]:
        """The round's reply checks, one pipeline for ``aggregate_train`` and the secure-aggregation admission:
        :func:`.replies.screen` (echoes, arrays), partition claims, then the accountant (``guard.accountable``,
        which may raise :class:`~.guard.UnaccountableSum`); the usable replies, the others appended to ``dropped``.
        ``observed`` (curious-server only): receives the dropped replies whose upload and echoes parsed and that the
        accountant can account (uploads the server holds although it does not aggregate them, docs/MATH.md §23.2)."""
        strategy: Any = self  # NoisyStrategyMixin: settings, guard, _screening_rules, _record, _weights
        observed = observed if strategy.accountant.config.threat_model == "curious-server" else None
        usable, found = screen(replies, asked={m.metadata.dst_node_id: m.metadata.message_id for m in pending.sent},
                               reference=pending.reference, arrays_key=strategy.arrayrecord_key,
                               fedprox=strategy.settings.algorithm == "fedprox", slots=pending.slots,
                               clients_per_node=self.federation.clients_per_node,
                               rules=strategy._screening_rules(pending.planned), rejected=observed)
        dropped.extend(found)
        screened = usable
        usable = strategy.guard.check_partitions(usable, dropped, pending.server_round)
        kept: list[Usable] = strategy.guard.accountable(usable, dropped, pending.planned, lambda us: strategy._record(
            pending.server_round, pending.planned, us, strategy._weights(us), applied=True, quiet=True))
        if observed is not None:  # the held uploads the accountant can account (guard.seen_uploads)
            observed[:] = strategy.guard.seen_uploads(pending.server_round, [*observed, *(
                u for u in screened if not any(u is k for k in kept))], pending.planned, lambda us: strategy._record(
                pending.server_round, pending.planned, [*kept, *us], strategy._weights([*kept, *us]), applied=True,
                quiet=True))
        return kept

    def _secure_admission(self, echoes: dict[int, dict[str, Any]]) -> list[tuple[int, str]]:
        """Secure aggregation, before a sum is unmasked: the contributors the round's screening would drop
        (echoes, partition ids, the accountant), as (node, reason). Their replies carry the echoes and the
        broadcast model (the arrays are not checked on secure sums)."""
        pending = self._round  # type: ignore[attr-defined]  # NoisyStrategyMixin's round state
        by_node = {m.metadata.dst_node_id: m for m in pending.sent}
        replies = [Message(RecordDict({"arrays": pending.reference, "metrics": MetricRecord(metrics)}),
                           reply_to=by_node[nid]) for nid, metrics in echoes.items()]
        dropped: list[tuple[int, str, bool]] = []
        with contextlib.suppress(UnaccountableSum):  # nothing is revealed yet: the sum is simply not unmasked
            self._screen_replies(replies, pending, dropped)
        self._track_refusals(pending.server_round, [], dropped)  # a node refused here is excluded like any other
        return [(node, why) for node, why, _ in dropped]

    def _sample(self, grid: Grid, t: int) -> tuple[dict[int, tuple[int, ...]], list[int]]:
        """``clients-per-round`` distinct clients of eligible nodes (Poisson: each eligible client with
        probability q), grouped by node: node -> its sampled member slots (``(0,)`` outside cohort
        mode). Waits until enough nodes are connected.

        Eligible: connected, not excluded for refusing, not set aside (a contested partition id). In cohort mode every eligible node
        offers ``clients-per-node`` slots and the clients are sampled uniformly among all slots.
        With ``seed`` >= 0 the sample is a function of (seed, t, exclusions) only, so a resumed
        run samples like an uninterrupted one; otherwise it uses OS entropy.
        """
        c = self.federation
        cpn = c.clients_per_node
        check_grid(grid, self.accountant.config, c.min_replies, self._secure_admission)
        warn_until_enough_nodes(grid, self.min_available_nodes, c)
        _, available = sample_nodes(grid, self.min_available_nodes, self.min_available_nodes)  # waits
        excluded = self.excluded_nodes
        aside = self.set_aside_nodes
        eligible = sorted(n for n in available if n not in excluded and n not in aside)
        if len(eligible) * cpn < c.min_replies:
            why = [f"{len(nodes)} node(s) {what} (" + "; ".join(f"node {n}: {r}" for n, r in sorted(nodes.items())) + ")"
                   for what, nodes in ((f"excluded after {c.max_node_refusals} consecutive refusals", excluded),
                                       ("set aside as claimants of a contested partition id", aside)) if nodes]
            left = f"only {len(eligible)} eligible node(s) left, fewer than min-replies = {c.min_replies}: "
            raise NotEnoughNodes(left + ", ".join(why), left + (
                f"{len(excluded)} node(s) excluded after {c.max_node_refusals} consecutive refusals, {len(aside)} set "
                "aside as claimants of a contested partition id (a secret sample: their ids are in the members file)"))
        population = [(n, j) for n in eligible for j in range(cpn)]
        rng = random.Random(f"{c.seed}:{t}") if c.seed >= 0 else random.SystemRandom()
        if c.poisson:  # each client independently with probability q (docs/MATH.md §19)
            chosen = [slot for slot in population if rng.random() < c.sampling_rate]
            self._population, self._drawn = len(population), len(chosen)
        else:
            k = min(c.clients_per_round, len(population))
            if k < c.clients_per_round:
                log.warning("round t=%d: only %d eligible clients (%d nodes excluded for refusing, %d set aside): "
                            "sampling all of them", t, len(population), len(excluded), len(aside))
            chosen = rng.sample(population, k)
            self._population, self._drawn = len(population), k
        slots: dict[int, list[int]] = {}
        for node, j in sorted(chosen):
            slots.setdefault(node, []).append(j)
        return {n: tuple(js) for n, js in slots.items()}, available

    def _track_caps(self, server_round: int, usable: list[Usable]) -> None:
        """``weighting = "examples"``: count capped claims per node; flag a node capped ``max-node-refusals``
        usable replies in a row (ERROR, ``node-capped`` ledger event), once per run."""
        self._last_capped = 0
        if self.federation.weighting != "examples" or not usable:
            return
        limit = self.federation.max_node_refusals
        counts = capped_examples([u.num_examples for u in usable], self.reply_checks.examples_cap_ratio)
        for u, weighted in zip(usable, counts):
            if weighted >= u.num_examples:
                if u.node_id in self.refusals:
                    self.refusals[u.node_id].capped = 0
                continue
            state = self.refusals.setdefault(u.node_id, NodeRefusals())
            self._last_capped += 1
            state.capped += 1
            state.capped_total += 1
            if state.flagged_at_round is None and state.capped >= limit:
                state.flagged_at_round = server_round
                log.error("round %d: node %d claimed num-examples = %d, above examples-cap-ratio = %g times the "
                          "round's median claim, %d rounds in a row: it is weighted as %d, and still steers a large "
                          "share of the model. It stays sampled (a site may hold that much data): check its claim",
                          server_round, u.node_id, u.num_examples, self.reply_checks.examples_cap_ratio, state.capped, weighted)
                self._event("node-capped", {"node_id": u.node_id, "round": server_round, "consecutive": state.capped,
                                            "claimed": u.num_examples, "weighted_as": weighted})

    def _track_refusals(self, server_round: int, usable: list, dropped: list[tuple[int, str, bool]]) -> None:
        """Count consecutive refusals per node; exclude a node after ``max-node-refusals``; the capped claims."""
        self._track_caps(server_round, usable)
        for u in usable:
            if u.node_id in self.refusals:
                self.refusals[u.node_id].consecutive = 0
        limit = self.federation.max_node_refusals
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

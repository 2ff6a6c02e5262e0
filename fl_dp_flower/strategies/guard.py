"""Round-level guards against one hostile or broken node (the per-reply checks are in :mod:`.screening`).

- **Duplicate partition ids**: each ClientApp echoes its node config's ``partition-id`` as
  ``dp.partition-id``. Two nodes given the same partition train on the same data, which breaks
  the one-sample-of-one-client unit of every bound (a sample would sit in two clients). Once a
  second node claims a partition id (in the same round or any later one), the id is *contested*
  for the rest of the run: the replies of **all** its claimants are dropped, none counts as a
  refusal, and the sampler sets the claimants aside (:mod:`.sampling`: none of their replies could
  be used). The server cannot tell a misconfigured node from one that lies (a hostile node can echo
  any id, docs/MATH.md §17), so it never takes the first claimant's word: under the old rule (the
  first node to echo an id owns it) a fast liar echoing an honest site's id evicted that site, was
  named as its owner, and kept its weight. Now a liar costs the run its victim's data and its own,
  and the ERROR names both without taking sides. Before the contest at most one node's replies for
  the id were accepted, after it none, so the partition's data reached the model through one client
  at most. A node that echoes a partition id other than its first is dropped as a refusal (a node's
  partition does not change within a run), so a liar can contest one id only. Claims are
  ``partition-claimed`` ledger events (a secret sample's: the members file); a resume keeps the contested
  ids (:meth:`ReplyGuard.restore`; single claims are not kept: node ids need not survive a restart).
- **Accountant errors per reply**: a reply whose echoes (accepted within ``echo-tolerance``)
  make the round's terms fail (ValueError, OverflowError, any ArithmeticError) is dropped as a
  refusal, so no reply can fail the run. Replies echoing exactly the plan are never the cause
  (the plan was checked when the run started); the least private combination of all accepted
  echoes is tried last, and if only it fails, every deviating reply is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

import numpy as np
from flwr.app import ArrayRecord

from fl_dp_flower import protocol
from fl_dp_flower.errors import FlDpError
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.records import AccountantConfig, RoundRecord
from fl_dp_flower.reporting.ledger.events import PARTITION_CLAIMED_EVENT

from .echo import Applied
from .ndarrays import array_values
from .replies import Usable, mismatches

Dropped = list[tuple[int, str, bool]]
Event = Callable[[str, dict[str, Any]], None]
ACCOUNTANT_ERRORS = (ValueError, ArithmeticError)  # OverflowError is an ArithmeticError


def all_finite(arrays: ArrayRecord) -> bool:
    """Whether every value of ``arrays`` is finite."""
    return all(bool(np.all(np.isfinite(array_values(a)))) for a in arrays.values())


def unreplied_charge(record: RoundRecord | None, config: AccountantConfig, missing: int, round_: int) -> RoundRecord:
    """``record`` as a curious server's round is charged when ``missing`` asked nodes sent no reply in time
    (docs/MATH.md §23.2): a late reply still reaches the SuperLink (the train messages live for Flower's default TTL,
    hours, not ``round-timeout``), so the server may hold uploads the strategy never saw. Their batch rates are
    unknown, so the round is charged without amplification (q = 1); a round that got nothing at all is charged as
    the planned round of the unreplied nodes, not applied (the budget check took it as spent at the broadcast).
    Other threat models, or no missing reply: ``record`` unchanged (``record``: None when nothing arrived, round
    ``round_``; the caller only asks then for a curious server's round with missing replies)."""
    if config.threat_model != "curious-server" or missing <= 0:
        if record is None:
            raise ValueError(f"round {round_}: no record to charge (nothing arrived and no reply is missing)")
        return record
    if record is None or not record.weights:
        planned = config.planned_round(round_, missing, applied=False)
        record = planned if record is None else replace(planned, node_ids=record.node_ids, population=record.population,
                                                        sampled=record.sampled, screening_drop=record.screening_drop)
    return replace(record, batch_rate=None)


class UnaccountableSum(FlDpError, RuntimeError):
    """Secure aggregation revealed a sum whose every reply was dropped: no bound describes the round."""


class ReplyGuard:
    """Run-long state of the round-level guards (partition claims)."""

    def __init__(self, accountant: PrivacyAccountant, log: logging.Logger, event: Event | None = None) -> None:
        self.accountant = accountant
        self.log = log
        self.event = event  # the strategy's ledger events (partition claims)
        self.node_partition: dict[int, int] = {}  # node -> the partition id it echoed first
        self.claimants: dict[int, set[int]] = {}  # partition id -> the nodes that claimed it

    @property
    def contested(self) -> dict[int, tuple[int, ...]]:
        """Partition ids claimed by more than one node, with their claimants."""
        return {p: tuple(sorted(nodes)) for p, nodes in self.claimants.items() if len(nodes) > 1}

    def _claim(self, node: int, partition: int, server_round: int) -> None:
        self.node_partition[node] = partition
        nodes = self.claimants.setdefault(partition, set())
        nodes.add(node)
        if self.event is not None:
            self.event(PARTITION_CLAIMED_EVENT, {"partition_id": partition, "node_id": node, "round": server_round})
        if len(nodes) > 1:
            self.log.error(
                "round %d: %s = %d is claimed by nodes %s: two nodes with one partition break the one-client unit of "
                "the bounds. The server cannot tell which node is misconfigured or lying, so every claimant's "
                "replies are dropped and no claimant is sampled again in this run; none counts as a refusal. "
                "Check the partition-id in the node config of each of these nodes; a node you do not operate "
                "that claims your partition may be lying (revoke its SuperNode key)", server_round,
                protocol.PARTITION_ID, partition, ", ".join(map(str, sorted(nodes))))

    def restore(self, events: Iterable[dict[str, Any]]) -> None:
        """A resume keeps the run's contested partition ids (``partition-claimed`` ledger events of two or more
        nodes for one id): they stay contested. A single claim is not kept: node ids need not survive a restart
        (Flower's simulation gives every run new ones), so the same site under a new id must not contest its
        own partition; a liar who claims it after the resume contests it as in any round."""
        claims: dict[int, set[int]] = {}
        for entry in events:
            if entry.get("event") == PARTITION_CLAIMED_EVENT:
                data = entry.get("data") or {}
                claims.setdefault(int(data["partition_id"]), set()).add(int(data["node_id"]))
        for partition, nodes in claims.items():
            if len(nodes) > 1:
                self.claimants.setdefault(partition, set()).update(nodes)
                for node in nodes:
                    self.node_partition.setdefault(node, partition)
        for partition, claimed in sorted(self.contested.items()):
            self.log.error("resume: %s = %d stays contested (claimed by nodes %s): they are not sampled",
                           protocol.PARTITION_ID, partition, ", ".join(map(str, claimed)))

    def check_partitions(self, usable: list[Usable], dropped: Dropped, server_round: int = 0) -> list[Usable]:
        """Drop (into ``dropped``) replies echoing a contested partition id (not refusals) or a partition id
        other than their node's first (refusals); record this round's new claims first."""
        changed = set()
        for u in usable:
            if u.partition_id is None:
                continue
            first = self.node_partition.get(u.node_id)
            if first is None:
                self._claim(u.node_id, u.partition_id, server_round)
            elif first != u.partition_id:
                changed.add(u.node_id)
        contested = self.contested
        kept = []
        for u in usable:
            if u.node_id in changed:
                why = (f"{protocol.PARTITION_ID} = {u.partition_id} differs from the {protocol.PARTITION_ID} = "
                       f"{self.node_partition[u.node_id]} it echoed first: a node's partition does not change within a run")
                dropped.append((u.node_id, why, True))
            elif u.partition_id in contested:
                why = (f"{protocol.PARTITION_ID} = {u.partition_id} is contested (claimed by nodes "
                       f"{', '.join(map(str, contested[u.partition_id]))}): every claimant's reply is dropped, "
                       "not counted as a refusal")
                dropped.append((u.node_id, why, False))
            else:
                kept.append(u)
        return kept

    def _fails(self, record_of: Callable[[list[Usable]], RoundRecord], usable: list[Usable]) -> str | None:
        try:
            report = self.accountant.peek(record_of(usable))
            report.to_dict()  # epsilon conversions included
        except ACCOUNTANT_ERRORS as err:
            return f"{type(err).__name__}: {err}"
        return None

    def accountable(self, usable: list[Usable], dropped: Dropped, planned: Applied,
                    record_of: Callable[[list[Usable]], RoundRecord]) -> list[Usable]:
        """The replies whose round the accountant can account; the others go to ``dropped``.

        ``record_of(replies)``: the round's least private record of those replies (with their weights).
        Secure aggregation: the server has seen the sum of every reply's upload, so a round whose replies
        were all dropped cannot be left unaccounted; it fails the run (:class:`UnaccountableSum`; more
        clients deviated than the c colluders the bound allows). Keeping only some is conservative: the
        kept clients' noise is in the sum, the dropped ones' only adds to it.
        """
        kept = self._accountable(usable, dropped, planned, record_of)
        if not kept and dropped and self.accountant.config.threat_model == "secure-aggregation":
            raise UnaccountableSum(f"a secure sum of {len(dropped)} upload(s) was revealed but every reply was "
                                   "dropped (" + "; ".join(f"node {n}: {why}" for n, why, _ in dropped) + "): the "
                                   "bound assumes at most c deviating clients; the run stops")
        return kept

    def seen_uploads(self, server_round: int, observed: list[Usable], planned: Applied,
                     record_of: Callable[[list[Usable]], RoundRecord]) -> list[Usable]:
        """The dropped replies whose uploads a curious server holds (``observed``: parsed, then dropped; docs/MATH.md
        §23.2) that the accountant can account (``record_of``: the round's record with them added). The round is
        charged at the largest batch rate any of them echoed too, and a round with no usable reply is charged as a
        round of them (not applied) rather than left unaccounted: the server saw them. An honest node's reply
        echoes the plan, which the accountant accounts; replies whose echoes make it fail are no honest node's."""
        kept = self._accountable(observed, [], planned, record_of) if observed else []
        if kept:
            self.log.warning("round %d: the server holds the dropped upload(s) of node(s) %s (a curious server sees "
                             "them): the round is charged for them too", server_round,
                             ", ".join(str(u.node_id) for u in kept))
        return kept

    def _accountable(self, usable: list[Usable], dropped: Dropped, planned: Applied,
                     record_of: Callable[[list[Usable]], RoundRecord]) -> list[Usable]:
        deviating = {id(u) for u in usable if mismatches(planned, u.applied)}
        if not deviating:
            return usable
        exact = [u for u in usable if id(u) not in deviating]
        failed: set[int] = set()
        for u in usable:
            if id(u) in deviating:
                why = self._fails(record_of, [*exact, u])
                if why is not None:
                    failed.add(id(u))
                    dropped.append((u.node_id, f"its echoed settings make the accountant fail ({why})", True))
        kept = [u for u in usable if id(u) not in failed]
        if len(kept) > len(exact) and self._fails(record_of, kept) is not None:
            for u in kept:
                if id(u) in deviating:
                    why = ("its echoed settings, combined least privately with the round's other deviating "
                           "echoes, make the accountant fail")
                    dropped.append((u.node_id, why, True))
            kept = exact
        return kept

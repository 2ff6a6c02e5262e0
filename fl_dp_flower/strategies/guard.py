"""Round-level guards against one hostile or broken node (the per-reply checks are in :mod:`.screening`).

- **Duplicate partition ids**: each ClientApp echoes its node config's ``partition-id`` as
  ``dp.partition-id``. Two nodes given the same partition train on the same data, which breaks
  the one-sample-of-one-client unit of every bound (a sample would sit in two clients). The
  first node to echo a partition id owns it for the run; a reply of another node echoing the
  same id is dropped as a refusal (so that node is excluded after ``max-node-refusals``). Only
  a misconfiguration is caught: a hostile node can echo any id (docs/MATH.md §17).
- **Accountant errors per reply**: a reply whose echoes (accepted within ``echo-tolerance``)
  make the round's terms fail (ValueError, OverflowError, any ArithmeticError) is dropped as a
  refusal, so no reply can fail the run. Replies echoing exactly the plan are never the cause
  (the plan was checked when the run started); the least private combination of all accepted
  echoes is tried last, and if only it fails, every deviating reply is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import numpy as np
from flwr.app import ArrayRecord

from fl_dp_flower import protocol
from fl_dp_flower.errors import FlDpError
from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.records import RoundRecord

from .echo import Applied
from .replies import Usable, mismatches

Dropped = list[tuple[int, str, bool]]
ACCOUNTANT_ERRORS = (ValueError, ArithmeticError)  # OverflowError is an ArithmeticError


def all_finite(arrays: ArrayRecord) -> bool:
    """Whether every value of ``arrays`` is finite."""
    return all(bool(np.all(np.isfinite(a.numpy()))) for a in arrays.values())


class UnaccountableSum(FlDpError, RuntimeError):
    """Secure aggregation revealed a sum whose every reply was dropped: no bound describes the round."""


class ReplyGuard:
    """Run-long state of the round-level guards (partition owners)."""

    def __init__(self, accountant: PrivacyAccountant, log: logging.Logger) -> None:
        self.accountant = accountant
        self.log = log
        self.partition_owner: dict[int, int] = {}  # partition id -> the node that echoed it first

    def check_partitions(self, usable: list[Usable], dropped: Dropped) -> list[Usable]:
        """Drop (into ``dropped``, as refusals) replies echoing another node's partition id."""
        kept = []
        for u in usable:
            if u.partition_id is not None:
                owner = self.partition_owner.setdefault(u.partition_id, u.node_id)
                if owner != u.node_id:
                    why = (f"{protocol.PARTITION_ID} = {u.partition_id} is already node {owner}'s: two nodes with one "
                           "partition break the one-client unit of the bounds (fix the node config's partition-id)")
                    dropped.append((u.node_id, why, True))
                    continue
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

"""What a stopped run leaves its operator to act on (used by the ServerApp, apps/server.py):

- :class:`RunFailed` and :func:`logged_failures`: every failure an operator can act on is in the
  ServerApp log at ERROR (`flwr log`), once;
- a full disk (ENOSPC, EDQUOT) anywhere in the run's writes becomes one message saying what
  happened, that nothing unaccounted was released, and how to resume;
- node exclusions (``node-excluded`` ledger events, ``max-node-refusals``) and partition claims
  (``partition-claimed``) are carried across a resume: a node excluded earlier in a run is not
  sampled again by its resume, and a contested partition id stays contested (a secret sample's are in
  the owner-only members file, ``reporting.rounds.member_events``: the ServerApp passes them in).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fl_dp_flower import FlDpError
from fl_dp_flower.reporting.ledger import LEDGER_FILE, NODE_EXCLUDED_EVENT, RESUME_EVENT
from fl_dp_flower.reporting.ledger.events import PARTITION_CLAIMED_EVENT
from fl_dp_flower.strategies.noisy import NodeRefusals, NoisyStrategyMixin

log = logging.getLogger("flwr").getChild(__name__)  # Flower's handlers: shows in `flwr log`


class RunFailed(FlDpError, RuntimeError):
    """The run did nothing it was asked to (no round accounted) or cannot safely continue.

    ``logged``: its message is already in the ServerApp log at ERROR (otherwise
    :func:`logged_failures` logs it: `flwr log` must say why a run failed, not only its exit code)."""

    def __init__(self, message: str, *, logged: bool = False) -> None:
        super().__init__(message)
        self.logged = logged


@contextmanager
def logged_failures(run_dir: Path) -> Iterator[None]:
    """Log every failure an operator can act on at ERROR, once (the log `flwr log` shows, which
    otherwise says only "Exit Code: 201"): a :class:`RunFailed` not logged yet, an existing ledger
    (``FileExistsError``), and a full disk, re-raised as :class:`RunFailed` saying how to resume."""
    try:
        yield
    except RunFailed as err:
        if not err.logged:
            log.error("%s", err)
        raise
    except FileExistsError as err:  # an existing ledger without resume = true (the library's words, then the app's)
        log.error("%s (this app: choose another 'run-name', or set 'resume=true' to continue it)", err)
        raise
    except Exception as err:
        full = disk_full_cause(err)
        if full is None:
            raise
        message = disk_full_message(full, run_dir)
        log.error("%s", message)
        raise RunFailed(message, logged=True) from err

#: errno values of a full file system (no space; quota exceeded)
DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full_cause(exc: BaseException) -> OSError | None:
    """The ENOSPC/EDQUOT OSError behind ``exc`` (itself, or in its cause/context chain), if any."""
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, OSError) and current.errno in DISK_FULL:
            return current
        current = current.__cause__ or current.__context__
    return None


def disk_full_message(err: OSError, run_dir: Path) -> str:
    what = f" while writing {err.filename}" if err.filename else ""
    ledger = run_dir / LEDGER_FILE
    if not ledger.exists() or ledger.stat().st_size == 0:  # the ledger's creation is whole or nothing
        return (f"disk full ({errno.errorcode.get(err.errno or 0, err.errno)}: {err.strerror}){what}: the run "
                f"stopped before its privacy ledger {ledger} was created, so no round was opened and nothing was "
                f"spent. Free space on the file system of {run_dir}, then submit the same run config again "
                "(resume = false, or resume = true if the run was a resume: an empty ledger is replaced).")
    return (f"disk full ({errno.errorcode.get(err.errno or 0, err.errno)}: {err.strerror}){what}: the run stopped. "
            "Nothing unaccounted was released: every round is written to the ledger (fsynced) before its model "
            "is broadcast or saved, so the ledger holds every round that may have been spent. Free space on the "
            f"file system of {run_dir}, then submit the same run config with resume=true (if the resume names "
            "a round that was broadcast but has no round line, add resume-unfinished-round='account'). Do not "
            "edit or delete the ledger.")


def restore_exclusions(strategy: NoisyStrategyMixin, events: list[dict[str, Any]]) -> None:
    """Nodes excluded (``node-excluded`` ledger events) before a resume stay excluded: a node that
    refused ``max-node-refusals`` rounds in a row of this run is not sampled again by its resume; the
    partition claims of the run are restored too (``strategy.guard.restore``), those of the partition ids
    contested within one of its segments (:func:`contested_claims`)."""
    strategy.guard.restore(contested_claims(events))
    for event in events:
        if event.get("event") != NODE_EXCLUDED_EVENT:
            continue
        data = event.get("data") or {}
        node, reason = int(data["node_id"]), str(data.get("reason", ""))
        refusals = int(data.get("consecutive_refusals", 0))
        strategy.refusals[node] = NodeRefusals(consecutive=refusals, total=refusals, last_reason=reason,
                                               excluded_at_round=int(data["round"]))
    if strategy.excluded_nodes:
        log.error("resume: nodes excluded earlier in this run stay excluded (not sampled): %s",
                  "; ".join(f"node {n} ({why})" for n, why in sorted(strategy.excluded_nodes.items())))


def contested_claims(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``events`` without the ``partition-claimed`` events of partition ids that no segment of the run
    contests. A segment is what one ServerApp ran: the ledger's ``resume`` events separate them. Every
    segment claims each partition again (single claims are not carried over: node ids need not survive a
    restart), so merged over the whole ledger, one site under its per-segment ids (Flower's simulation gives
    every run new ones; a replaced SuperNode key gives a new id) would contest its own partition from the
    second resume on and every reply would be dropped (measured: the quick preset, Ctrl-C, two resumes).
    A secret sample's claims come from its members file, whose ``resume`` marks (``MembersSink.mark_resume``)
    separate its segments the same way."""
    segments: list[list[dict[str, Any]]] = [[]]
    for event in events:
        if event.get("event") == RESUME_EVENT:
            segments.append([])
        segments[-1].append(event)
    out = []
    for segment in segments:
        nodes: dict[Any, set[Any]] = {}
        for event in segment:
            if event.get("event") == PARTITION_CLAIMED_EVENT:
                data = event.get("data") or {}
                nodes.setdefault(data.get("partition_id"), set()).add(data.get("node_id"))
        out += [e for e in segment if e.get("event") != PARTITION_CLAIMED_EVENT
                or len(nodes[(e.get("data") or {}).get("partition_id")]) > 1]
    return out

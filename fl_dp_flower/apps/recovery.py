"""What a stopped run leaves its operator to act on (used by the ServerApp, apps/server.py):

- :class:`RunFailed` and :func:`logged_failures`: every failure an operator can act on is in the
  ServerApp log at ERROR (`flwr log`), once;
- a full disk (ENOSPC, EDQUOT) anywhere in the run's writes becomes one message saying what
  happened, that nothing unaccounted was released, and how to resume;
- an unfinished round (broadcast, no durable round line) is refused or charged by policy;
- node exclusions (``node-excluded`` ledger events, ``max-node-refusals``) are carried across a
  resume: a node excluded earlier in a run is not sampled again by its resume.
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from fl_dp_flower import FlDpError
from fl_dp_flower.config import AppConfig
from fl_dp_flower.privacy.records import AccountantConfig
from fl_dp_flower.reporting.ledger import NODE_EXCLUDED_EVENT, LedgerContents
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
    except FileExistsError as err:  # an existing ledger without resume = true
        log.error("%s", err)
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
    return (f"disk full ({errno.errorcode.get(err.errno or 0, err.errno)}: {err.strerror}){what}: the run stopped. "
            "Nothing unaccounted was released: every round is written to the ledger (fsynced) before its model "
            "is broadcast or saved, so the ledger holds every round that may have been spent. Free space on the "
            f"file system of {run_dir}, then submit the same run config with resume=true (if the resume names "
            "a round that was broadcast but has no round line, add resume-unfinished-round='account'). Do not "
            "edit or delete the ledger.")


def restore_exclusions(strategy: NoisyStrategyMixin, events: list[dict[str, Any]]) -> None:
    """Nodes excluded (``node-excluded`` ledger events) before a resume stay excluded: a node that
    refused ``max-node-refusals`` rounds in a row of this run is not sampled again by its resume."""
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


def unfinished_round(config: AppConfig, path: Path, contents: LedgerContents, ckpt_round: int) -> int | None:
    """The open round to account (policy ``account``), None if there is none; raise RunFailed
    naming the real cause (policy ``refuse``, or an inconsistency). Reads only."""
    last = contents.last_round
    open_round = contents.open_round
    if open_round is None:
        if ckpt_round > last:
            raise RunFailed(f"cannot resume {path}: checkpoint round {ckpt_round} is ahead of the ledger's "
                            f"last round {last}, and no round is open in the ledger; the ledger is not the "
                            "one this model was trained under")
        if ckpt_round < last:
            log.warning("checkpoint is from round %d, ledger has round %d: continuing from the older model "
                        "(the later rounds stay accounted, as not applied)", ckpt_round, last)
        return None
    how = (f"its round line is torn (line {contents.line_count} was cut mid-write)"
           if contents.torn_tail and contents.torn_round == open_round
           else f"has no round line (opened at line {contents.open_round_line}; the server stopped before "
                "recording it)")
    where = (f"; the saved model is from round {ckpt_round}" if ckpt_round else "")
    if config.resume_unfinished_round == "refuse":
        message = (
            f"cannot resume {path}: round {open_round} was broadcast but {how}{where}. Its uploads may have "
            "reached the server, so its privacy may be spent. Nothing was written. To continue, resume "
            "with resume-unfinished-round = 'account' (the round is charged as planned and marked not "
            "applied: its aggregate was never saved or broadcast); do not edit the ledger or the checkpoint."
        )
        log.error("%s", message)
        raise RunFailed(message, logged=True)
    log.warning("round %d was broadcast but %s%s", open_round, how, where)
    if ckpt_round >= open_round:  # the model holds the round's aggregate: not applied would under-count
        raise RunFailed(f"cannot resume {path}: the checkpoint is from round {ckpt_round}, so it holds open round "
                        f"{open_round}'s aggregate, which the ledger never recorded; it cannot be charged as not "
                        "applied (docs/MATH.md §14.3a). Nothing was written.")
    return open_round


def unfinished_contributors(config: AccountantConfig, contents: LedgerContents) -> int | None:
    """How many contributors the open round is charged as a sum of: None (the planned m) outside secure
    aggregation; under it the smallest sum SecAggGrid could have unmasked in that round, the floor recorded
    in its ``round-open`` event (``min_replies``), never the resumed run's (issue 28 item 1: a resume may
    raise min-replies for later rounds, not for a round already broadcast). A ``round-open`` event written
    before the floor was recorded is charged at the smallest floor any version of the ServerApp accepted,
    ``colluding-clients`` + 4 (docs/MATH.md §20.5)."""
    if config.threat_model != "secure-aggregation":
        return None
    data = contents.open_round_event or {}
    floor = data.get("min_replies")
    if isinstance(floor, bool) or not isinstance(floor, int) or floor < 1:
        floor = config.colluders + LEGACY_SECURE_FLOOR
        log.warning("round %s's round-open event records no contributor floor (a ledger written before it was "
                    "recorded): charged as a sum of %d contributors, the smallest any version allowed",
                    contents.open_round, floor)
    return min(config.clients, floor)


def unfinished_screening_drop(config: AppConfig, contents: LedgerContents) -> float:
    """The open round's screening charge (docs/MATH.md §17.1: its replies may have been screened and a drop
    logged before the crash), as recorded in its ``round-open`` event; a ledger written before it was recorded
    gets the resumed run's levels (none under secure aggregation, whose per-upload checks do not run)."""
    recorded = (contents.open_round_event or {}).get("screening_drop")
    if isinstance(recorded, (int, float)) and not isinstance(recorded, bool) and 0.0 <= recorded <= 1.0:
        return float(recorded)
    return 0.0 if config.threat_model == "secure-aggregation" else config.noise_check_alpha + config.update_bound_alpha


#: min-replies - colluding-clients >= 4 under secure aggregation since its run path existed (config_secagg.py)
LEGACY_SECURE_FLOOR = 4

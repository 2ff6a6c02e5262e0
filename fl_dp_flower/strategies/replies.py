"""Screening, reconciliation and aggregation of train replies (no accounting here).

A reply is *usable* when it carries no error, comes from a node that was asked, has the
broadcast model's array keys/shapes, one metrics record with a positive integer
``num-examples`` and valid echoes of the settings as applied (``dp.sigma``,
``dp.clip-norm``, ``dp.local-steps``, ``dp.lr``, ``dp.round-index``; ``dp.batch-size`` and
``dp.prox-alpha`` when present). Anything else is dropped with a logged reason.

Echoes that differ from the server's plan are an error (logged by the caller), and the
round is accounted with the *least private* combination of planned and echoed values
(:func:`reconcile`): smallest sigma, largest clip norm, element-wise largest step sizes,
smallest per-sample batch size, smallest FedProx alpha. Every term of docs/MATH.md §4/§13/§14 is
monotone in these directions, so the accounted round dominates what actually ran.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from itertools import zip_longest

import numpy as np
from flwr.app import Array, ArrayRecord, Message, MetricRecord
from flwr.common.constant import ErrorCode

from fl_dp_flower.privacy.schedules import step_sizes
from fl_dp_flower import protocol
from fl_dp_flower.vocabulary import Schedule

from .echo import Applied, metric_number, parse_applied
from .ndarrays import array_values
from .screening import Rejected, ScreeningRules, check_batch, check_echo, check_reply, reference_norm

log = logging.getLogger("flwr").getChild(__name__)  # Flower's handlers: shows in `flwr log`

SUPERLINK_NODE_ID = 1  # src_node_id of error replies the SuperLink makes (timeouts, dead nodes)
#: codes of the error replies the SuperLink makes for a node (message expired, node gone): the node did not answer
SUPERLINK_ERROR_CODES = (ErrorCode.MESSAGE_UNAVAILABLE, ErrorCode.REPLY_MESSAGE_UNAVAILABLE, ErrorCode.NODE_UNAVAILABLE)

@dataclass(frozen=True)
class Usable:
    """A reply that passed screening. ``arrays`` is the sum of the uploads of ``members`` (one
    member, the node itself, outside cohort mode; ``member_id`` ids in cohort mode)."""

    node_id: int
    arrays: ArrayRecord
    metrics: MetricRecord
    applied: Applied
    num_examples: int
    members: tuple[int, ...] = ()
    residual_energy: float | None = None  # ||reply - M w_t||^2 / (d M sigma^2) (screening rules)
    partition_id: int | None = None  # the echoed dp.partition-id (None: not echoed)


MAX_NUM_EXAMPLES = 2**53  # larger counts are not exact in float64: malformed


def member_id(node_id: int, slot: int, clients_per_node: int) -> int:
    """The id of virtual client ``slot`` of a cohort node (the ledger's ``node_ids`` in cohort mode)."""
    return node_id * clients_per_node + slot


def _members(metrics: MetricRecord, node: int, slots: Sequence[int] | None, clients_per_node: int) -> tuple[int, ...]:
    if slots is None:
        return (node,)
    got = metrics.get(protocol.MEMBERS)
    if not isinstance(got, list) or [int(v) for v in got] != list(slots):
        raise ValueError(f"{protocol.MEMBERS} = {got!r} differs from the cohort slots asked for {list(slots)}")
    return tuple(member_id(node, j, clients_per_node) for j in slots)


def batch_rate(usable: Sequence[Usable]) -> float:
    """The round's Poisson batch rate for the accountant (docs/MATH.md §23): the largest any contributing
    node echoed, and 1 (no amplification) as soon as one of them did not echo Poisson sampling."""
    return max((1.0 if u.applied.batch_rate is None else u.applied.batch_rate for u in usable), default=1.0)


def charged_echoes(usable: Sequence[Usable], seen: Sequence[Usable], rules: ScreeningRules) -> list[Applied]:
    """The echoes a round's settings are charged at (the least private of them and the plan): every kept reply's,
    and those of the dropped uploads a curious server holds (``seen``, docs/MATH.md §23.2) that lie within the
    plan's echo bounds, as a kept reply's deviation within ``echo-tolerance`` is charged (review R2: before, only
    their batch rates counted). An echo outside the bounds is no honest node's: charging it would let one node raise
    the run's epsilon at will, and it risks only that node's own data (each upload carries its own noise)."""
    held = []
    for u in seen:
        try:
            check_echo(u.applied, rules)
        except Rejected:
            continue
        held.append(u.applied)
    return [*(u.applied for u in usable), *held]


def _signature(arrays: ArrayRecord) -> dict[str, tuple[tuple[int, ...], str]]:
    return {k: (tuple(a.shape), str(a.dtype)) for k, a in arrays.items()}


def addressee(msg: Message, by_message_id: Mapping[str, int]) -> int:
    """The node a reply answers for: the addressee of the instruction it replies to.

    Error replies made by the SuperLink (node gone, message expired) carry the SuperLink's
    own id as source, so the source alone would name the wrong node.
    """
    node = by_message_id.get(msg.metadata.reply_to_message_id)
    return int(msg.metadata.src_node_id) if node is None else node


def screen(
    replies: list[Message], *, asked: Mapping[int, str], reference: ArrayRecord, arrays_key: str, fedprox: bool,
    slots: Mapping[int, Sequence[int]] | None = None, clients_per_node: int = 1,
    rules: ScreeningRules | None = None, rejected: list[Usable] | None = None,
) -> tuple[list[Usable], list[tuple[int, str, bool]]]:
    """Split replies into usable ones and ``(node_id, reason, is_refusal)`` of dropped ones.

    ``asked`` maps each node asked this round to the id of its instruction message (the Grid
    sets it when pushing; empty for in-process grids, where the reply's source is used).
    ``slots`` (cohort mode): node -> the member slots it was asked to train; its reply must echo
    exactly those in ``dp.members``, and carries their summed uploads.
    ``rules``: the echo bounds, update-magnitude and residual-noise checks of :mod:`.screening`;
    a reply they reject is dropped as a refusal of its node.

    ``is_refusal`` (counts towards ``max-node-refusals``) is true for every reply a node sent in answer to
    its own instruction: a refusal, an error reply of its ClientApp, a malformed reply (records, keys,
    values, ``num-examples``), a rejected one; false for what the node did not send (the SuperLink's
    error replies for a node that is gone or too late, a reply sent by another node) and for a duplicate.
    ``rejected``: when given, every dropped reply the node sent itself whose upload and echoes parsed is appended
    to it (an upload the server holds although it is not used: a curious server saw it, docs/MATH.md §23.2).
    """
    usable: list[Usable] = []
    dropped: list[tuple[int, str, bool]] = []
    seen: set[int] = set()
    ref_sig = _signature(reference)
    w_norm = reference_norm(reference) if rules is not None else 0.0
    by_message_id = {mid: node for node, mid in asked.items() if mid}
    for msg in replies:
        node = addressee(msg, by_message_id)
        own = node in asked and int(msg.metadata.src_node_id) == node  # the node's answer to its instruction
        counts = False  # whether a drop counts towards the node's exclusion
        parsed: Usable | None = None  # the reply as parsed, once its upload and echoes are (``rejected``)
        try:
            if msg.has_error():
                counts = own and msg.error.code not in SUPERLINK_ERROR_CODES
                raise ValueError(f"error reply (code {msg.error.code}): {msg.error.reason}")
            if node not in asked:
                raise ValueError("reply from a node that was not asked this round")
            if not own:
                raise ValueError(f"reply sent by node {msg.metadata.src_node_id} for the instruction of node {node}")
            if node in seen:
                raise ValueError("duplicate reply")
            counts = True  # from here on: a malformed answer of the node itself
            content = msg.content
            if arrays_key not in content.array_records or len(content.array_records) != 1:
                raise ValueError(f"expected exactly one ArrayRecord {arrays_key!r}")
            if len(content.metric_records) != 1:
                raise ValueError("expected exactly one MetricRecord")
            arrays = content.array_records[arrays_key]
            if _signature(arrays) != ref_sig:
                raise ValueError("array keys/shapes/dtypes differ from the broadcast model")
            if not all(np.all(np.isfinite(array_values(a))) for a in arrays.values()):
                raise ValueError("arrays contain non-finite values")
            metrics = next(iter(content.metric_records.values()))
            n = metric_number(metrics, "num-examples", integer=True, minimum=1, strict=False)
            if n > MAX_NUM_EXAMPLES:
                raise ValueError(f"num-examples = {n!r} exceeds 2**53 (not a plausible count)")
            applied = parse_applied(metrics, fedprox=fedprox)
            parsed = Usable(node, arrays, metrics, applied, int(n), (node,))
            members = _members(metrics, node, None if slots is None else slots.get(node, ()), clients_per_node)
            parsed = replace(parsed, members=members)
            partition = None
            if protocol.PARTITION_ID in metrics:
                partition = int(metric_number(metrics, protocol.PARTITION_ID, integer=True, minimum=0, strict=False))
            energy = None
            if rules is not None:
                check_batch(applied, int(n), rules)
                energy = check_reply(arrays, reference, len(members), applied, rules, w_norm)
        except Rejected as err:
            dropped.append((node, str(err), True))  # a screening rule: counts towards exclusion
            if parsed is not None and rejected is not None:
                rejected.append(parsed)
            continue
        except ValueError as err:
            dropped.append((node, str(err), counts))
            if parsed is not None and rejected is not None:
                rejected.append(parsed)
            continue
        seen.add(node)
        usable.append(Usable(node, arrays, metrics, applied, int(n), members, energy, partition))
    return usable, dropped


def _close(a: float | int | None, b: float | int | None) -> bool:
    if a is None or b is None:
        return True  # not echoed: nothing to compare
    return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)


def mismatches(planned: Applied, echoed: Applied) -> list[str]:
    """Human-readable differences between the plan and one echo."""
    out = []
    for name in ("sigma", "clip_norm", "local_steps", "lr", "round_index", "batch_size", "prox_alpha"):
        p, e = getattr(planned, name), getattr(echoed, name)
        if not _close(p, e):
            out.append(f"{name}: planned {p!r}, applied {e!r}")
    return out


def reconcile(planned: Applied, echoed: list[Applied], schedule: Schedule, per_sample: bool) -> tuple[Applied, tuple[float, ...]]:
    """Least private combination of plan and echoes, and its (element-wise max) step sizes."""
    everyone = [planned, *echoed]
    etas = [step_sizes(schedule, a.lr, a.round_index, a.local_steps) for a in everyone]
    worst_etas = tuple(max(x for x in col if x is not None) for col in zip_longest(*etas))
    batch = planned.batch_size
    sizes = [a.batch_size for a in everyone if a.batch_size is not None]
    if per_sample:
        batch = min(sizes)
    elif sizes:  # per-batch: B enters only the add/remove-one sensitivity (B = 1 halves it): the largest
        batch = max(sizes)
    alphas = [a.prox_alpha for a in everyone if a.prox_alpha is not None]
    worst = replace(
        planned,
        sigma=min(a.sigma for a in everyone),
        clip_norm=max(a.clip_norm for a in everyone),
        local_steps=len(worst_etas),
        batch_size=batch,
        prox_alpha=min(alphas) if alphas else None,
    )
    return worst, worst_etas


def capped_examples(counts: Sequence[int], ratio: float) -> list[int]:
    """The counts weighting 'examples' uses: each claimed num-examples capped at ``ratio`` times
    the round's lower median claim (``examples-cap-ratio``), so no single node can claim the
    whole weight; a capped count is logged at WARNING."""
    ordered = sorted(counts)
    cap = max(1, math.floor(ratio * ordered[(len(ordered) - 1) // 2]))
    return [min(n, cap) for n in counts]


def weights_for(usable: list[Usable], weighting: str, examples_cap_ratio: float = math.inf) -> tuple[float, ...]:
    """Aggregation weights p_i, one per member in reply order: uniform 1/m over all members (the
    paper's model) or proportional to num-examples (single-client replies only), each count
    capped by :func:`capped_examples`."""
    members = [len(u.members) for u in usable]
    if weighting == "uniform":
        total = sum(members)
        return tuple(1.0 / total for _ in range(total))
    if weighting == "examples":
        if any(k != 1 for k in members):
            raise ValueError("weighting 'examples' needs one client per reply (no cohorts)")
        claimed = [u.num_examples for u in usable]
        counts = claimed if math.isinf(examples_cap_ratio) else capped_examples(claimed, examples_cap_ratio)
        for u, n in zip(usable, counts):
            if n < u.num_examples:
                log.warning("node %d claims num-examples = %d, more than examples-cap-ratio = %g times the "
                            "round's median claim: weighted as %d", u.node_id, u.num_examples,
                            examples_cap_ratio, n)
        mass = math.fsum(counts)
        return tuple(n / mass for n in counts)
    raise ValueError(f"weighting must be 'uniform' or 'examples', got {weighting!r}")


def reply_coefficients(usable: list[Usable], weights: tuple[float, ...]) -> list[float]:
    """The coefficient of each reply's summed upload: its members' (equal) weight."""
    out, offset = [], 0
    for u in usable:
        own = weights[offset:offset + len(u.members)]
        if max(own) - min(own) > 1e-15:
            raise ValueError("the members of one reply must share one weight (their uploads arrive summed)")
        out.append(own[0])
        offset += len(u.members)
    if offset != len(weights):
        raise ValueError(f"{len(weights)} weights for {offset} members")
    return out


def average_arrays(usable: list[Usable], weights: tuple[float, ...], reference: ArrayRecord) -> ArrayRecord:
    """sum over members of p_i * upload_i in float64 (each reply's arrays are its members' summed
    uploads), cast back to the broadcast dtypes (key order kept)."""
    coefficients = reply_coefficients(usable, weights)
    out: dict[str, Array] = {}
    for key, ref in reference.items():
        acc = np.zeros(ref.shape, dtype=np.float64)
        for u, p in zip(usable, coefficients, strict=True):
            acc += p * array_values(u.arrays[key]).astype(np.float64)
        dtype = array_values(ref).dtype
        if np.issubdtype(dtype, np.integer):
            acc = np.rint(acc)
        out[key] = Array(np.ascontiguousarray(acc.astype(dtype)))
    return ArrayRecord(out)


def average_metrics(usable: list[Usable], weights: tuple[float, ...]) -> dict[str, float | int]:
    """p-weighted mean of the scalar metrics all replies share (echoes excluded), plus totals."""
    weights = tuple(c * len(u.members) for c, u in zip(reply_coefficients(usable, weights), usable))
    shared = set.intersection(*(set(u.metrics.keys()) for u in usable))
    keys = sorted(k for k in shared if not k.startswith(protocol.PREFIX) and k != "num-examples")
    out: dict[str, float | int] = {}
    for key in keys:
        values = [u.metrics[key] for u in usable]
        numbers = [v for v in values if isinstance(v, (int, float)) and not isinstance(v, bool)]
        if len(numbers) == len(values):
            out[key] = math.fsum(p * float(v) for p, v in zip(weights, numbers))
    out["num-examples"] = int(sum(u.num_examples for u in usable))
    return out

"""A resume restores only the partition ids that some segment of the run contested (app/recovery.py).

Measured before the fix: the quick preset stopped with Ctrl-C and resumed twice. Flower's simulation gives
every run new node ids, so each partition had one claim per segment; merged over the ledger, the second
resume found every partition "claimed" by three nodes, dropped every reply and failed with "the run
accounted no round". The same happens in a deployment to a site whose SuperNode key was replaced."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from fl_dp_flower.app.recovery import contested_claims, restore_exclusions
from fl_dp_flower.strategies.guard import ReplyGuard


def claim(partition: int, node: int) -> dict:
    return {"kind": "event", "event": "partition-claimed", "data": {"partition_id": partition, "node_id": node, "round": 1}}


RESUME = {"kind": "event", "event": "resume", "data": {"rounds_accounted": 4}}


def restored(events: list[dict]) -> dict[int, tuple[int, ...]]:
    strategy = SimpleNamespace(guard=ReplyGuard(None, logging.getLogger("test")), refusals={}, excluded_nodes={})
    restore_exclusions(strategy, events)  # type: ignore[arg-type]
    return strategy.guard.contested


def test_one_site_under_new_ids_in_each_segment_is_not_contested():
    events = [claim(0, 11), claim(1, 12), RESUME, claim(0, 21), claim(1, 22), RESUME, claim(0, 31), claim(1, 32)]
    assert restored(events) == {}
    assert restored(events[:2] + events[3:5] + events[6:]) == {0: (11, 21, 31), 1: (12, 22, 32)}  # the old merge


def test_a_partition_contested_within_a_segment_stays_contested():
    events = [claim(0, 11), claim(0, 99), claim(1, 12), RESUME, claim(0, 21), claim(1, 22), claim(1, 98)]
    assert restored(events) == {0: (11, 99), 1: (22, 98)}
    kept = [e["data"]["node_id"] for e in contested_claims(events) if e["event"] == "partition-claimed"]
    assert kept == [11, 99, 22, 98]


def test_a_secret_samples_members_file_is_segmented_by_its_resume_marks(tmp_path):
    """A secret sample's claims live in members.jsonl, which had no segment marks: merged, the second resume of a
    one-site-per-partition run found every partition contested (review D1). The ServerApp marks each resume there."""
    from fl_dp_flower.reporting.ledger.events import MEMBERS_EVENT
    from fl_dp_flower.reporting.rounds import MembersSink, member_events

    sink = MembersSink(tmp_path / "members.jsonl")
    for segment, ids in enumerate(((11, 12), (21, 22), (31, 32))):
        if segment:
            sink.mark_resume(4 * segment)
        for partition, node in enumerate(ids):
            sink.on_event(MEMBERS_EVENT, {"event": "partition-claimed",
                                          "data": {"partition_id": partition, "node_id": node, "round": 1}})
    events = member_events(tmp_path / "members.jsonl")
    assert [e["event"] for e in events].count("resume") == 2
    assert restored(events) == {}
    assert restored([e for e in events if e["event"] != "resume"]) == {0: (11, 21, 31), 1: (12, 22, 32)}


def test_a_torn_members_line_does_not_block_the_next_resume(tmp_path):
    """Review V1: a crash mid-write left a fragment; the resume mark was glued onto it and the next resume's
    member_events raised 'line 2 is not JSON'. The next append ends the fragment and marks it."""
    from fl_dp_flower.reporting.ledger.events import MEMBERS_EVENT
    from fl_dp_flower.reporting.rounds import MembersSink, member_events

    path = tmp_path / "members.jsonl"
    claim = {"event": "partition-claimed", "data": {"partition_id": 0, "node_id": 11, "round": 1}}
    path.write_text(json.dumps(claim) + "\n" + '{"event": "partition-cla')  # the crash
    sink = MembersSink(path)
    sink.mark_resume(1)
    sink.on_event(MEMBERS_EVENT, claim)
    assert [e["event"] for e in member_events(path)] == ["partition-claimed", "resume", "partition-claimed"]
    path.write_text('{"torn\n' + json.dumps(claim) + "\n")  # a fragment nobody marked is still an error
    with pytest.raises(ValueError, match="line 1 is not JSON"):
        member_events(path)

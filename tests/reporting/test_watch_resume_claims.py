"""``fl-dp-flower watch`` compares partition claims within one segment of a run, as the resumed server
does (app/recovery.py): a site claiming its partition under a new node id after a resume (Flower's
simulation gives every run new ids) is not shown as contesting it; a contest stays shown and kept."""

from __future__ import annotations

from fl_dp_flower.reporting.watch import RunView


def add_claim(view: RunView, partition: int, node: int) -> None:
    view.add({"kind": "event", "event": "partition-claimed", "time": "2026-01-01T10:00:00",
              "data": {"partition_id": partition, "node_id": node, "round": 1}})


def test_claims_under_new_ids_after_a_resume_are_no_contest():
    view = RunView()
    add_claim(view, 0, 11)
    add_claim(view, 1, 12)
    add_claim(view, 1, 99)  # a real contest in the first segment
    view.add({"kind": "event", "event": "resume", "time": "2026-01-01T10:01:00", "data": {"rounds_accounted": 3}})
    add_claim(view, 0, 21)  # the same site, a new id: no contest
    add_claim(view, 1, 22)  # partition 1 stays contested: shown with the new claimant
    contested = [text for _, text in view.events if "contested" in text]
    assert contested == [
        "partition-id 1 contested by nodes 12, 99: their replies are dropped, none is sampled again",
        "partition-id 1 contested by nodes 12, 22, 99: their replies are dropped, none is sampled again"]

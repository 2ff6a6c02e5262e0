"""``watch`` shows the plan in force after a resume that changed it (issue 21.5): the header keeps
the first run's config, the resume event records the resumed plan."""

from __future__ import annotations

from pathlib import Path

from fl_dp_flower.app.testing import run_local, tiny_config
from rich.console import Console

from fl_dp_flower.app.serverapp import LEDGER
from fl_dp_flower.privacy.planning import planned_run
from fl_dp_flower.reporting.watch import LedgerFollower, RunView, render


def _view(ledger: Path) -> tuple[RunView, str]:
    view = RunView()
    for entry in LedgerFollower(ledger).poll():
        view.add(entry)
    console = Console(record=True, width=200)
    console.print(render(view, ledger, now=0.0))
    return view, console.export_text()


def test_watch_shows_the_shorter_plan_of_a_resume(tmp_path):
    base = tiny_config(tmp_path, **{"num-server-rounds": 5})
    eps = planned_run(base.accountant_config(), 3).certified_epsilons()
    target = (eps[1] + eps[2]) / 2  # the budget stops the first run after round 2 of 5
    run_local(tiny_config(tmp_path, **{"num-server-rounds": 5, "target-epsilon": target}))
    ledger = tmp_path / "run" / LEDGER
    view, text = _view(ledger)
    assert view.app["num-server-rounds"] == 5 and "2 / 5 planned" in text
    # resumed with a shorter plan (3 rounds) and no budget: one more round
    run_local(tiny_config(tmp_path, **{"num-server-rounds": 3, "resume": True}))
    view, text = _view(ledger)
    assert view.app["num-server-rounds"] == 3 and view.app["target-epsilon"] == 0.0
    assert "3 / 3 planned" in text and "budget" not in text.split("recent rounds")[0]
    assert view.next_round_epsilon() is None  # done: no stale "next round" of the old plan


def test_watch_shows_a_contested_partition_and_a_flagged_node_once():
    """Issue 28.7 / 28.10: a partition claim is shown only when it contests an id (one claim per node is
    written), and a flagged node in words."""
    view = RunView()
    for node, partition in [(1, 1), (2, 1), (3, 2)]:
        view.add({"kind": "event", "event": "partition-claimed", "time": "2026-01-01T10:00:00",
                  "data": {"partition_id": partition, "node_id": node, "round": 1}})
    view.add({"kind": "event", "event": "node-capped", "time": "2026-01-01T10:00:01",
              "data": {"node_id": 2, "round": 2, "consecutive": 2, "claimed": 10**15, "weighted_as": 5000}})
    assert [text for _, text in view.events] == [
        "partition-id 1 contested by nodes 1, 2: their replies are dropped, none is sampled again",
        "node 2 flagged: num-examples 1000000000000000 capped 2 rounds in a row (weighted as 5000)"]

"""A node that dies before its key shares reached the others (SecAgg+ setup or share-keys stage) is not
tolerated by Flower 1.41's SecAgg+: the unmask stage asks every survivor for a share of the dead node's key,
which none holds (``secaggplus_mod._unmask`` raises KeyError; on a real SuperNode that is an error reply),
so no sum is unmasked. What must hold for us: nothing is revealed, nothing aggregated or accounted, and
the run goes on (found by tests/integration/test_deployment_secagg.py's design: it kills a node only at the
masked-vector stage, which SecAgg+ does tolerate). Should a Flower release tolerate early dropouts, this
test fails and the round is then expected to be accounted with the survivors."""

from __future__ import annotations

import pytest
import test_secagg_bridge as bridge
from flwr.app import Error, Message
from flwr.common.constant import ErrorCode

from fl_dp_flower.reporting.ledger import read_ledger


class _ErrorReplyingGrid(bridge._DyingGrid):
    """The bridge tests' dying grid, with a ClientApp exception turned into an error reply, as a SuperNode's
    runtime does (the in-process LocalGrid lets it propagate)."""

    raised: list[str] = []

    def __init__(self, app, *args, **kw):
        def as_runtime(msg, ctx):
            try:
                return app(msg, ctx)
            except Exception as err:  # noqa: BLE001 - what Flower's ClientApp runtime catches
                _ErrorReplyingGrid.raised.append(f"node {ctx.node_id}: {err!r}")
                return Message(Error(code=ErrorCode.CLIENT_APP_RAISED_EXCEPTION, reason=repr(err)), reply_to=msg)
        super().__init__(as_runtime, *args, **kw)


@pytest.mark.parametrize("stage", ["setup", "share_keys"])
def test_a_node_dead_before_sharing_its_keys_voids_the_round_and_nothing_is_revealed(tmp_path, monkeypatch, stage):
    monkeypatch.setattr(bridge, "_DyingGrid", _ErrorReplyingGrid)
    monkeypatch.setattr(_ErrorReplyingGrid, "raised", [])
    accountant, grid, seen, uploads, _, _ = bridge._run(tmp_path, 6, {6: stage}, colluders=0, min_contributors=4)
    assert sorted(uploads) == [1, 2, 3, 4, 5]  # the survivors trained and sent their masked vectors
    assert not grid.rounds[0].completed and grid.rounds[0].contributors == []  # never unmasked
    # every survivor's unmask step failed on the share of node 6 it never received
    assert _ErrorReplyingGrid.raised == [f"node {n}: KeyError(6)" for n in range(1, 6)]
    assert seen == [] and accountant.num_releases == 0 and not accountant.records
    voids = [e["data"] for e in read_ledger(tmp_path / "ledger.jsonl").events if e["event"] == "round-void"]
    assert voids == [{"round": 1, "reason": "no usable reply"}]

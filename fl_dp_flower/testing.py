"""An in-process Flower Grid for tests, benchmarks and your own checks: runs the real ClientApp directly (no Ray, no SuperLink).

``LocalGrid(client_app, num_nodes, run_config)`` gives node ids 1..N, each with a persistent
Context whose node config is ``{"partition-id": i, "num-partitions": N}`` (like the
simulation engine). Fault injection:

- ``failing``: node ids that answer every instruction with an ``Error`` reply;
- ``unavailable``: node ids for which the *SuperLink* answers (as for a node that went away):
  an ``Error`` whose source is the SuperLink (node 1), as Flower's linkstate makes it;
- ``silent``: node ids that never answer (as if the round timed out);
- ``node_config``: extra node-config entries per node id (e.g. ``{"min-sigma": 1.0}``);
- ``copy_content``: every node gets its own copy of an instruction's content, as after a real
  Grid's serialization (Flower's SecAgg+ client mod pops keys from the content it receives, and
  its workflow sends one content object to every node).

Like Flower's simulation engine run by ``scripts/main-job.sh`` with ``FL_DP_ALLOW_FIXED_SEED=1``,
every node accepts fixed noise seeds (``allow-fixed-seed=true``) unless ``node_config`` says
otherwise. Messages get their id when sent, as Flower's Grids do.

``sent`` records every instruction message (for assertions on the ConfigRecord).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import ConfigRecord, Context, Error, Message, Metadata, RecordDict
from flwr.clientapp import ClientApp
from flwr.common.constant import ErrorCode
from flwr.app.message.message import make_message
from flwr.supercore.run import Run
from flwr.serverapp import Grid

SUPERLINK_NODE_ID = 1


class LocalGrid(Grid):
    """Synchronous Grid calling ``client_app(msg, context)`` per instruction."""

    #: its nodes are simulated, as in Flower's simulation engine (no node operator to collude; apps/threat.py)
    simulated = True

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        run_config: Mapping[str, Any] | None = None,
        *,
        failing: Iterable[int] = (),
        silent: Iterable[int] = (),
        unavailable: Iterable[int] = (),
        first_node_id: int = 1,
        node_config: Mapping[int, Mapping[str, Any]] | None = None,
        copy_content: bool = False,
    ) -> None:
        self.copy_content = copy_content
        self._app = client_app
        self._node_ids = list(range(first_node_id, first_node_id + num_nodes))
        self.failing = set(failing)
        self.silent = set(silent)
        self.unavailable = set(unavailable)
        self.sent: list[Message] = []
        self.timeouts: list[float | None] = []
        extra = node_config or {}
        self._contexts = {
            nid: Context(
                run_id=0,
                node_id=nid,
                node_config={"partition-id": i, "num-partitions": num_nodes, "allow-fixed-seed": True,
                             **extra.get(nid, {})},
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for i, nid in enumerate(self._node_ids)
        }
        self._run: Run | None = None

    def set_run(self, run: Run) -> None:
        self._run = run

    @property
    def run(self) -> Run:
        if self._run is None:
            raise RuntimeError("LocalGrid.run: set_run was not called")
        return self._run

    def create_message(self, content, message_type, dst_node_id, group_id, ttl=None):
        return Message(content, dst_node_id, message_type, group_id=group_id, ttl=ttl)

    def get_node_ids(self) -> Iterable[int]:
        return list(self._node_ids)

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        raise NotImplementedError("LocalGrid only supports send_and_receive")

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        raise NotImplementedError("LocalGrid only supports send_and_receive")

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterable[Message]:
        self.timeouts.append(timeout)
        replies = []
        for msg in messages:
            self.sent.append(msg)
            msg.metadata.__dict__["_message_id"] = msg.object_id  # as Flower's Grids do on push
            nid = msg.metadata.dst_node_id
            if nid in self.silent:
                continue
            if nid in self.unavailable:
                reply = superlink_error(msg)
            elif nid in self.failing:
                reply = Message(Error(code=1, reason=f"node {nid} failed (injected)"), reply_to=msg)
            else:
                delivered = msg
                if self.copy_content:
                    delivered = Message(_copied(msg.content), nid, msg.metadata.message_type,
                                        group_id=msg.metadata.group_id, ttl=msg.metadata.ttl)
                    delivered.metadata.__dict__["_message_id"] = msg.metadata.message_id
                reply = self._app(delivered, self._contexts[nid])
            replies.append(reply)
        return replies


def _copied(content: RecordDict) -> RecordDict:
    """A copy whose config records are new objects (array and metric records are shared, read-only)."""
    return RecordDict({key: ConfigRecord(dict(rec)) if isinstance(rec, ConfigRecord) else rec
                       for key, rec in content.items()})


TINY_NODES = 3


@contextlib.contextmanager
def task_identity():
    """Flower >= 1.4x reads TaskIdentity.run_id/node_id/task_id to build instruction Messages;
    outside a Flower runtime they are unset (RuntimeError). Set them, restore them after."""
    from flwr.supercore.task_identity import TaskIdentity  # internal API, no public alternative

    names = ("_run_id", "_node_id", "_task_id")
    saved = {k: getattr(TaskIdentity, k) for k in names}
    TaskIdentity.run_id, TaskIdentity.node_id, TaskIdentity.task_id = 0, 1, 1
    try:
        yield
    finally:
        for k, v in saved.items():
            setattr(TaskIdentity, k, v)


def superlink_error(ins: Message) -> Message:
    """The reply Flower's SuperLink makes for an instruction whose node is gone: source and
    destination are the SuperLink itself, only ``reply_to_message_id`` names the instruction."""
    meta = ins.metadata
    metadata = Metadata(
        run_id=meta.run_id, message_id="", src_node_id=SUPERLINK_NODE_ID, dst_node_id=SUPERLINK_NODE_ID,
        reply_to_message_id=meta.message_id, group_id=meta.group_id, message_type=meta.message_type,
        created_at=meta.created_at, ttl=meta.ttl,
    )
    return make_message(metadata=metadata, error=Error(code=ErrorCode.NODE_UNAVAILABLE,
                                                       reason="Error: Node Unavailable"))

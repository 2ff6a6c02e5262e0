"""An in-process Flower Grid for tests: runs the real ClientApp directly (no Ray, no SuperLink).

``LocalGrid(client_app, num_nodes, run_config)`` gives node ids 1..N, each with a persistent
Context whose node config is ``{"partition-id": i, "num-partitions": N}`` (like the
simulation engine). Fault injection:

- ``failing``: node ids that answer every instruction with an ``Error`` reply;
- ``silent``: node ids that never answer (as if the round timed out);
- ``node_config``: extra node-config entries per node id (e.g. ``{"min-sigma": 1.0}``).

``sent`` records every instruction message (for assertions on the ConfigRecord).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from flwr.app import Context, Error, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import Grid


class LocalGrid(Grid):
    """Synchronous Grid calling ``client_app(msg, context)`` per instruction."""

    def __init__(
        self,
        client_app: ClientApp,
        num_nodes: int,
        run_config: Mapping[str, Any] | None = None,
        *,
        failing: Iterable[int] = (),
        silent: Iterable[int] = (),
        node_config: Mapping[int, Mapping[str, Any]] | None = None,
    ) -> None:
        self._app = client_app
        self._node_ids = list(range(1, num_nodes + 1))
        self.failing = set(failing)
        self.silent = set(silent)
        self.sent: list[Message] = []
        self.timeouts: list[float | None] = []
        extra = node_config or {}
        self._contexts = {
            nid: Context(
                run_id=0,
                node_id=nid,
                node_config={"partition-id": i, "num-partitions": num_nodes, **extra.get(nid, {})},
                state=RecordDict(),
                run_config=dict(run_config or {}),
            )
            for i, nid in enumerate(self._node_ids)
        }
        self._run = None

    def set_run(self, run_id: int) -> None:
        self._run = run_id

    @property
    def run(self):
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
            nid = msg.metadata.dst_node_id
            if nid in self.silent:
                continue
            if nid in self.failing:
                reply = Message(Error(code=1, reason=f"node {nid} failed (injected)"), reply_to=msg)
            else:
                reply = self._app(msg, self._contexts[nid])
            replies.append(reply)
        return replies

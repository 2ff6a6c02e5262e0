"""The wire contract between the ServerApp and the ClientApp that both sides must agree on.

A node that will not run a train instruction (its guardrails or its policy forbid it) answers
with an ``Error`` whose code is :data:`REFUSAL_CODE` and whose reason starts with
:data:`REFUSAL_PREFIX`; the server counts such replies as *refusals* (``max-node-refusals``),
unlike failures (a dead node, a timeout, a crash), which it only logs.
"""

from __future__ import annotations

from flwr.common.constant import ErrorCode

REFUSAL_CODE = ErrorCode.MOD_FAILED_PRECONDITION
REFUSAL_PREFIX = "refused by node: "

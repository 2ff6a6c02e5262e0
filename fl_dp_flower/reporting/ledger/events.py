"""The ledger's format constants and event names, defined once (the writer writes them, the reader
and every consumer (verify, watch, replay, resume, plot, Prometheus) read them through
:mod:`fl_dp_flower.reporting.ledger.reader`)."""

from __future__ import annotations

LEDGER_FILE = "ledger.jsonl"  # a run folder's ledger
SCHEMA = 2  # written by this version: hash-chained lines
SCHEMAS = (1, 2)  # read: 1 = before the chain
TORN_TAIL_EVENT = "torn-tail"
ROUND_OPEN_EVENT = "round-open"
ROUND_VOID_EVENT = "round-void"
NOT_APPLIED_EVENT = "rounds-not-applied"
FILE_MODE = 0o600  # ledger and run outputs: owner-only
RESUME_EVENT = "resume"
END_EVENT = "end"  # the run's last line when it finished
FAILED_EVENT = "failed"  # the run's last line when the ServerApp raised
CLOSING_EVENTS = (END_EVENT, FAILED_EVENT)
BUDGET_STOP_EVENT = "budget-stop"
NODE_EXCLUDED_EVENT = "node-excluded"
NODE_CAPPED_EVENT = "node-capped"  # weighting "examples": a node capped max-node-refusals rounds in a row
PARTITION_CLAIMED_EVENT = "partition-claimed"  # a node's first echoed dp.partition-id (one per node and run)
#: a secret sample's member ids (sample-secrecy "secret"): never written to the ledger, only to MEMBERS_FILE
MEMBERS_EVENT = "round-members"
MEMBERS_FILE = "members.jsonl"  # beside the ledger, owner-only (FILE_MODE); the server's owner alone reads it
#: events that name a node: under a secret sample they would tell a ledger reader that the node took part in
#: their round, so they go to MEMBERS_FILE only, as ``{"event": kind, "data": data}`` lines (strategies/sampling.py)
NODE_ID_EVENTS = (NODE_EXCLUDED_EVENT, NODE_CAPPED_EVENT, PARTITION_CLAIMED_EVENT)
UNFINISHED_ROUND_EVENT = "unfinished-round-accounted"

"""A secret sample's ledger must hold counts only (docs/MATH.md §22): the accountant refuses a round record that
names its members, and ``verify`` fails a secret ledger that names a node (issue 31 review P31A)."""

from __future__ import annotations

import pytest

from fl_dp_flower.privacy.accountant import PrivacyAccountant
from fl_dp_flower.privacy.records import AccountantConfig, RoundRecord
from fl_dp_flower.reporting import PrivacyLedger
from fl_dp_flower.reporting.verify import verify_ledger

SECRET = AccountantConfig(clients=2, population=8, sample_secrecy="secret", colluders=0, lr=0.1, local_steps=1)


def _record(round_: int, node_ids: tuple[int, ...] = ()) -> RoundRecord:
    return RoundRecord(round=round_, algorithm="fedavg", step_sizes=(0.1,), clip_norm=1.0, sigma=1.0,
                       weights=(0.5, 0.5), population=8, sampled=2, node_ids=node_ids)


def _secret_ledger(path, metrics: list[dict], closing: tuple[str, dict] | None = None):
    """A secret ledger of ``len(metrics)`` counts-only rounds (round t's line with ``metrics[t - 1]``), closed by
    ``closing`` (default: the end event); verified."""
    ledger = PrivacyLedger.create(path, accountant_config=SECRET.to_dict(), app_config={})
    accountant = PrivacyAccountant(SECRET)
    for t, round_metrics in enumerate(metrics, start=1):
        ledger.append_event("round-open", {"round": t, "clients": 2})
        record = _record(t)
        ledger.append_round(round=t, record=record.to_dict(), report=accountant.step(record).to_dict(),
                            metrics=round_metrics)
    ledger.append_event(*(closing or ("end", {"rounds_accounted": len(metrics)})))
    ledger.close()
    return verify_ledger(path)


def test_the_accountant_refuses_a_secret_round_that_names_its_members():
    """Before: certified ``sampled_secret`` (p = 2/8) for a record whose node_ids publish who took part."""
    accountant = PrivacyAccountant(SECRET)
    for call in (accountant.step, accountant.peek):
        with pytest.raises(ValueError, match="node_ids must be empty with sample_secrecy 'secret'"):
            call(_record(1, (3, 5)))
    assert accountant.num_releases == 0
    assert accountant.step(_record(1)).certified_bound == "sampled_secret"
    public = PrivacyAccountant(AccountantConfig(clients=2, colluders=0, lr=0.1, local_steps=1))
    public.step(RoundRecord(round=1, algorithm="fedavg", step_sizes=(0.1,), clip_norm=1.0, sigma=1.0,
                            weights=(0.5, 0.5), node_ids=(3, 5)))  # a public sample names them


@pytest.mark.parametrize("event, data", [("round-open", {"round": 1, "node_ids": [3, 5]}),
                                         ("node-excluded", {"node_id": 3, "round": 1}),
                                         ("round-members", {"round": 1, "drawn": [3, 5]})])
def test_verify_fails_a_secret_ledger_that_names_a_node(tmp_path, event, data):
    """Before: verified (ok), its ``sampled_secret`` epsilon recomputed, although the ledger itself told its reader
    the sample that bound takes to be secret."""
    path = tmp_path / "ledger.jsonl"
    ledger = PrivacyLedger.create(path, accountant_config=SECRET.to_dict(), app_config={})
    accountant = PrivacyAccountant(SECRET)
    ledger.append_event(event, data)
    if event != "round-open":
        ledger.append_event("round-open", {"round": 1, "clients": 2})
    record = _record(1)
    ledger.append_round(round=1, record=record.to_dict(), report=accountant.step(record).to_dict(), metrics={})
    ledger.append_event("end", {"rounds_accounted": 1})
    ledger.close()
    v = verify_ledger(path)
    assert not v.ok and v.failure is not None and "secret" in v.failure, v


def test_verify_accepts_a_counts_only_secret_ledger(tmp_path):
    v = _secret_ledger(tmp_path / "ledger.jsonl", [{}, {}])
    assert v.ok and v.rounds_verified == 2, v.failure


def test_verify_notes_a_secret_ledger_whose_rounds_publish_num_examples(tmp_path):
    """A secret ledger written before its round lines kept counts only (review P31A finding 1) published the
    contributors' num-examples: its numbers recompute, but a reader who knows the clients' sizes may learn who
    took part; verify says so (once), instead of passing it silently."""
    v = _secret_ledger(tmp_path / "ledger.jsonl", [{"num-examples": 1000 + t, "accuracy": 0.5} for t in (1, 2)])
    assert v.ok and v.rounds_verified == 2, v.failure
    flagged = [n for n in v.notes if "num-examples" in n]
    assert len(flagged) == 1 and "round 1" in flagged[0] and "sampled_secret" in flagged[0], v.notes


@pytest.mark.parametrize("metrics", [{"dp-echo-mismatch": 1, "accuracy": 0.5}, {"dp-capped": 0}])
def test_verify_notes_the_other_contributor_statistics_of_an_old_secret_ledger(tmp_path, metrics):
    """Before this session's review, a secret ledger's round lines also held dp-echo-mismatch and dp-capped (an honest
    small node's echo flagged its rounds): verify notes them like num-examples; a counts-only ledger gets no note."""
    v = _secret_ledger(tmp_path / "ledger.jsonl", [metrics])
    assert v.ok, v.failure
    flagged = [n for n in v.notes if "members.jsonl" in n]
    assert len(flagged) == 1 and sorted(set(metrics) - {"accuracy"})[0] in flagged[0], v.notes


def test_verify_notes_an_old_secret_ledgers_failed_event_that_names_a_node(tmp_path):
    """A run out of eligible nodes used to write a failure reason naming every excluded node ('node 7: refused'),
    which tells a reader of a secret ledger that node 7 was drawn; the reason is in counts now, and verify notes
    an old one."""
    v = _secret_ledger(tmp_path / "ledger.jsonl", [{}], ("failed", {
        "error": "only 0 eligible node(s) left, fewer than min-replies = 2: 1 node(s) excluded after 3 consecutive "
                 "refusals (node 7: refused)"}))
    assert v.ok, v.failure
    assert any("failed event names a node" in n for n in v.notes), v.notes
    counts = tmp_path / "counts.jsonl"
    ledger = PrivacyLedger.create(counts, accountant_config=SECRET.to_dict(), app_config={})
    ledger.append_event("failed", {"error": "only 0 eligible node(s) left, fewer than min-replies = 2: 1 node(s) "
                                            "excluded after 3 consecutive refusals"})
    ledger.close()
    assert not any("names a node" in n for n in verify_ledger(counts).notes)

"""One ledger reader (issue 17): every consumer (resume/replay via read_ledger, verify, watch)
reads ledger lines through fl_dp_flower.reporting.ledger.reader, so they agree on what a line is."""

from __future__ import annotations

import ast
from pathlib import Path

import fl_dp_flower
from fl_dp_flower.privacy.records import AccountantConfig
from fl_dp_flower.reporting.ledger import LedgerFollower, PrivacyLedger, parse_line, read_ledger
from fl_dp_flower.reporting.verify import verify_ledger

PACKAGE = Path(fl_dp_flower.__file__).parent
ACCT = AccountantConfig(clients=3).to_dict()


def _ledger(tmp_path: Path) -> Path:
    path = tmp_path / "ledger.jsonl"
    with PrivacyLedger.create(path, accountant_config=ACCT, app_config={"note": "x"}) as ledger:
        ledger.append_event("budget-stop", {"reason": "test", "limit": float("inf")})
    return path


def test_a_line_with_an_absurd_integer_is_no_entry_for_any_reader(tmp_path):
    path = _ledger(tmp_path)
    absurd = b'{"kind":"event","schema":2,"event":"x","data":{"n":' + b"9" * 40 + b"}}"
    assert parse_line(absurd) is None
    path.write_bytes(path.read_bytes() + absurd + b"\n")
    follower = LedgerFollower(path)
    assert [e["kind"] for e in follower.poll()] == ["header", "event"]  # watch skips it
    try:
        read_ledger(path)
    except ValueError as err:
        assert "line 3" in str(err)
    else:
        raise AssertionError("read_ledger accepted a corrupt line")
    v = verify_ledger(path)
    assert not v.ok and v.failure_line == 3


def test_the_follower_decodes_like_read_ledger_and_waits_for_a_torn_line(tmp_path):
    path = _ledger(tmp_path)
    follower = LedgerFollower(path)
    polled = follower.poll()
    assert polled == [read_ledger(path).header, *read_ledger(path).events]
    assert polled[1]["data"]["limit"] == float("inf")
    with open(path, "ab") as f:
        f.write(b'{"kind":"event","sch')
    assert follower.poll() == [] and follower.pending_bytes == len(b'{"kind":"event","sch')


def test_new_fields_are_kept_by_the_reader(tmp_path):
    path = _ledger(tmp_path)
    line = b'{"kind":"event","schema":2,"event":"y","data":{},"a_future_field":[1,2]}'
    path.write_bytes(path.read_bytes() + line + b"\n")
    assert read_ledger(path).events[-1]["a_future_field"] == [1, 2]


def test_no_consumer_parses_ledger_lines_itself():
    """Only the reader turns ledger bytes into entries (json.loads / load_json_line)."""
    consumers = ["reporting/verify.py", "reporting/watch.py", "reporting/replay.py", "reporting/plot.py",
                 "reporting/prometheus.py", "app/recovery.py", "app/serverapp.py", "app/cli.py"]
    for rel in consumers:
        tree = ast.parse((PACKAGE / rel).read_text(encoding="utf-8"))
        names = {node.attr if isinstance(node, ast.Attribute) else node.id for node in ast.walk(tree)
                 if isinstance(node, (ast.Attribute, ast.Name))}
        assert "load_json_line" not in names and "_decode" not in names, rel
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "loads":
                src = ast.unparse(node)
                assert "ledger" not in src and "raw" not in src, f"{rel}: {src}"

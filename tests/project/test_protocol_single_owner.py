"""fl_dp_flower/protocol.py is the one owner of the ``dp.*`` wire keys (issue 17): no other module
of the package writes a ``dp.`` key in a string literal; they use protocol's constants."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import fl_dp_flower
from fl_dp_flower import protocol

PACKAGE = Path(fl_dp_flower.__file__).parent
KEY = re.compile(r"(?<![\w.])dp\.[a-z]")


def _docstrings(tree: ast.AST) -> set[int]:
    """ids of the docstring nodes (prose about the keys is documentation, not a second owner)."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def dp_literals(source: str) -> list[tuple[int, str]]:
    """(line, text) of every non-docstring string literal (f-string parts included) naming a dp. key."""
    tree = ast.parse(source)
    skip = _docstrings(tree)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in skip
            and KEY.search(node.value)]


def test_the_scanner_finds_keys_in_plain_and_f_strings_but_not_in_docstrings():
    src = '"""Docs name dp.sigma."""\nA = "dp.sigma"\nB = f"dp.batch-size={1}"\nC = "gdp.mu"\nD = "x (dp.lr)"\n'
    assert sorted(line for line, _ in dp_literals(src)) == [2, 3, 5]


def test_no_module_outside_protocol_writes_a_dp_key():
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if path == Path(protocol.__file__):
            continue
        offenders += [f"{path.relative_to(PACKAGE)}:{line}: {text!r}"
                      for line, text in dp_literals(path.read_text(encoding="utf-8"))]
    assert not offenders, "dp.* keys belong to fl_dp_flower/protocol.py:\n" + "\n".join(offenders)


def test_protocol_keys_share_the_prefix():
    keys = {key for key, _ in protocol.INSTRUCTION_KEYS.values()} | set(protocol.ECHO_KEYS.values())
    keys |= {protocol.MEMBERS, protocol.PARTITION_ID}
    assert keys and all(key.startswith(protocol.PREFIX) for key in keys)

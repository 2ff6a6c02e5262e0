"""The run configs the README and docs/ tell a user to run, extracted from their code blocks.

Used by tests/project/test_docs.py (every documented config validates and trains every round it asks
for) and tests/integration/test_deployment.py (the README's deployment run config drives a real run).
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
_RUN_CONFIG = re.compile(r'--run-config\s+"([^"]*)"')
_MAIN_JOB = re.compile(r'scripts/main-job\.sh\b([^\n`]*)')


@dataclass(frozen=True)
class DocRunConfig:
    source: str  # "README.md:228"
    text: str  # the override string as written
    command: str  # "flwr run" or "main-job"
    preset: str = "main"  # main-job: the launcher's --preset the command names (default main)


def _joined_blocks(text: str) -> list[tuple[int, str]]:
    """(first line number, text) of every fenced code block, backslash-newline continuations joined."""
    out, block, start = [], None, 0
    for n, line in enumerate(text.splitlines(), start=1):
        if line.lstrip().startswith("```"):
            if block is None:
                block, start = [], n + 1
            else:
                out.append((start, re.sub(r"\\\n\s*", " ", "\n".join(block))))
                block = None
        elif block is not None:
            block.append(line)
    return out


def documented_run_configs() -> list[DocRunConfig]:
    """Every ``--run-config "..."`` in a code block, and every main-job override string anywhere."""
    found: list[DocRunConfig] = []
    for path in DOCS:
        text = path.read_text()
        for line, block in _joined_blocks(text):
            for m in _RUN_CONFIG.finditer(block):
                found.append(DocRunConfig(f"{path.name}:{line}", m.group(1), "flwr run"))
        for m in _MAIN_JOB.finditer(text):
            preset = re.search(r"--preset\s+(\w+)", m.group(1))
            for arg in re.findall(r'"([^"]*)"', m.group(1)):
                line = text.count("\n", 0, m.start()) + 1
                found.append(DocRunConfig(f"{path.name}:{line}", arg, "main-job", preset.group(1) if preset else "main"))
    return found


def parse_overrides(text: str) -> dict:
    """A ``--run-config`` string as Flower parses it: space-separated TOML ``key=value`` pairs."""
    pairs = re.findall(r"""([\w.-]+)=('[^']*'|"[^"]*"|\S+)""", text)
    return tomllib.loads("\n".join(f"{k} = {v}" for k, v in pairs)) if pairs else {}


def pyproject_defaults() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["flwr"]["app"]["config"]


def documented_cli_commands() -> list[tuple[str, list[str]]]:
    """(source, argv) of every ``fl-dp-flower <command> ...`` line in a code block of README/docs."""
    import shlex

    found = []
    for path in DOCS:
        for line, block in _joined_blocks(path.read_text()):
            for n, text in enumerate(block.splitlines()):
                m = re.match(r"\s*(?:\.venv/bin/)?fl-dp-flower\s+(.*)", text)
                if m:
                    argv = shlex.split(m.group(1).split(" #")[0])
                    found.append((f"{path.name}:{line + n}", argv))
    return found

#!/usr/bin/env bash
# Create .venv (Python 3.11, pip + venv: they use this machine's local torch wheels) and
# install the package with its test extras. Idempotent: re-running only re-checks.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
.venv/bin/python -m pip install --quiet --upgrade pip >/dev/null 2>&1 || true
.venv/bin/python -m pip install --quiet -e ".[test]"

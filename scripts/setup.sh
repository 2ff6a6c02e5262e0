#!/usr/bin/env bash
# Create .venv (Python 3.11, pip + venv: they use this machine's local torch wheels) and install the
# package with its test extras. Re-runs skip pip when nothing that affects the install changed
# (pyproject.toml, this script, the interpreter): the stamp .venv/.fl-dp-flower-installed holds a hash.
# pip's output goes to .venv/setup.log and is shown only when the install fails.
# TORCH_INDEX_URL (optional): a package index for torch, e.g. https://download.pytorch.org/whl/cpu for
# the CPU-only build (about 0.2 GB instead of the 6.3 GB CUDA build that PyPI serves on Linux x86-64).
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
STAMP=.venv/.fl-dp-flower-installed
want="$(cat pyproject.toml scripts/setup.sh scripts/constraints.txt | sha256sum | cut -d' ' -f1)-$("$PY" -c 'import sys; print(sys.version.split()[0])')"
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
   && .venv/bin/python -c "import fl_dp_flower" 2>/dev/null; then
  exit 0
fi
started=$(date +%s)
echo "setup: installing fl-dp-flower and its dependencies into .venv (first time: a few minutes) ..." >&2
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
{
  .venv/bin/python -m pip install --upgrade pip || true
  if [ -n "${TORCH_INDEX_URL:-}" ]; then
    .venv/bin/python -m pip install --index-url "$TORCH_INDEX_URL" "torch==2.14.1" "torchvision==0.29.1"
  fi
  PYTHONWARNINGS=ignore .venv/bin/python -m pip install -c scripts/constraints.txt -e ".[test]"
} > .venv/setup.log 2>&1 || { tail -40 .venv/setup.log >&2; echo "setup: pip failed (full log: .venv/setup.log)" >&2; exit 1; }
echo "$want" > "$STAMP"
echo "setup: done in $(( $(date +%s) - started )) s (log: .venv/setup.log)" >&2

#!/usr/bin/env bash
# Create .venv (Python 3.11, pip + venv: they use this machine's local wheels) and install the
# package with its test extras. Re-runs skip pip when nothing that affects the install changed
# (pyproject.toml, this script, the interpreter, the torch choice): the stamp
# .venv/.fl-dp-flower-installed holds a hash. pip's output goes to .venv/setup.log and is shown only
# when the install fails.
#
# torch: PyPI's torch for Linux x86-64 is the CUDA build (about 6.3 GB with its NVIDIA libraries).
# - TORCH_INDEX_URL=<index>: torch and torchvision come from that index, e.g.
#   https://download.pytorch.org/whl/cpu for the CPU-only build (about 1 GB installed).
# - TORCH_INDEX_URL unset, and no NVIDIA GPU here (no /proc/driver/nvidia, no working nvidia-smi):
#   the CPU-only index above when it answers within 5 s; where it does not (a machine that reaches
#   PyPI only), PyPI's build, with a note saying how to get the CPU one.
# - TORCH_INDEX_URL= (set, empty): PyPI's build, no question asked.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3.11}"
command -v "$PY" >/dev/null 2>&1 || PY=python3
CPU_INDEX=https://download.pytorch.org/whl/cpu
STAMP=.venv/.fl-dp-flower-installed
want="$(cat pyproject.toml scripts/setup.sh scripts/constraints.txt | sha256sum | cut -d' ' -f1)-$("$PY" -c 'import sys; print(sys.version.split()[0])')-${TORCH_INDEX_URL-auto}"
if [ -x .venv/bin/python ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$want" ] \
   && .venv/bin/python -c "import fl_dp_flower" 2>/dev/null; then
  exit 0
fi

has_gpu() {
  [ -e /proc/driver/nvidia/version ] || { command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; }
}
index_answers() {  # $1: a package index URL; true when its torch page answers within 5 s
  "$PY" - "$1" <<'EOF' >/dev/null 2>&1
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=5).close()
EOF
}
if [ -z "${TORCH_INDEX_URL+set}" ]; then
  if has_gpu; then
    TORCH_INDEX_URL=""
  elif index_answers "$CPU_INDEX"; then
    TORCH_INDEX_URL="$CPU_INDEX"
    echo "setup: no NVIDIA GPU here: installing the CPU-only torch from $CPU_INDEX" >&2
  else
    TORCH_INDEX_URL=""
    echo "setup: no NVIDIA GPU here, but $CPU_INDEX does not answer, so torch comes from your pip's" \
         "sources (on Linux x86-64 PyPI's CUDA build: about 6.3 GB, several minutes). Where that index can" \
         "be reached, TORCH_INDEX_URL=$CPU_INDEX bash scripts/setup.sh installs the CPU-only build" >&2
  fi
fi

started=$(date +%s)
echo "setup: installing fl-dp-flower and its dependencies into .venv (first time: a few minutes) ..." >&2
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
{
  .venv/bin/python -m pip install --upgrade pip || true
  if [ -n "$TORCH_INDEX_URL" ]; then
    .venv/bin/python -m pip install --index-url "$TORCH_INDEX_URL" "torch==2.14.1" "torchvision==0.29.1"
  fi
  PYTHONWARNINGS=ignore .venv/bin/python -m pip install -c scripts/constraints.txt -e ".[test]"
} > .venv/setup.log 2>&1 || { tail -40 .venv/setup.log >&2; echo "setup: pip failed (full log: .venv/setup.log)" >&2; exit 1; }
echo "$want" > "$STAMP"
echo "setup: done in $(( $(date +%s) - started )) s, torch $(.venv/bin/python -c 'import torch; print(torch.__version__)' 2>/dev/null)," \
     ".venv $(du -sh .venv 2>/dev/null | cut -f1) (log: .venv/setup.log)" >&2

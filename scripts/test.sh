#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Exits non-zero when a test fails
# and also when no test ran (pytest exit code 5).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export PATH="$PWD/.venv/bin:$PATH"
.venv/bin/python -m pytest -p no:cacheprovider "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "no tests were collected: failing" >&2
  exit 1
fi
exit "$status"

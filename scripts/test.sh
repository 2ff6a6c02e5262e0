#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Exits non-zero when a test fails
# and also when no test ran (pytest exit code 5).
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
# Prometheus's promtool and server for tests/test_prometheus.py (Debian's package; best effort: the
# tests say why they skip when it cannot be installed)
if ! command -v promtool >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "test.sh: installing Debian's prometheus package (promtool) ..."
  { DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q --no-install-recommends prometheus \
    || { timeout 300 apt-get update -q && DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q \
         --no-install-recommends prometheus; }; } > /tmp/fl-dp-flower-apt.log 2>&1 \
    || echo "test.sh: could not install prometheus (log: /tmp/fl-dp-flower-apt.log); its tests will skip"
fi
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export PATH="$PWD/.venv/bin:$PATH"
.venv/bin/python -m pytest -p no:cacheprovider "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "no tests were collected: failing" >&2
  exit 1
fi
exit "$status"

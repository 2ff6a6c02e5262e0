#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite. Exits non-zero when a test fails
# and also when no test ran (pytest exit code 5).
#
# System packages are never installed unless asked: FL_DP_INSTALL_SYSTEM_PACKAGES=1 (as root, with
# apt-get) installs Debian's prometheus package for tests/integration/test_prometheus.py (promtool and a real
# Prometheus; without it those tests skip and say why). Its service is not started: a policy-rc.d
# denies service starts during the install. .ci/run opts in.
set -uo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh || exit 1
if ! command -v promtool >/dev/null 2>&1; then
  if [ "${FL_DP_INSTALL_SYSTEM_PACKAGES:-0}" = 1 ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    echo "test.sh: installing Debian's prometheus package (promtool; FL_DP_INSTALL_SYSTEM_PACKAGES=1) ..."
    policy=/usr/sbin/policy-rc.d
    made_policy=0
    if [ ! -e "$policy" ]; then
      printf '#!/bin/sh\nexit 101\n' > "$policy" && chmod 755 "$policy" && made_policy=1
    fi
    { DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q --no-install-recommends prometheus \
      || { timeout 300 apt-get update -q && DEBIAN_FRONTEND=noninteractive timeout 600 apt-get install -y -q \
           --no-install-recommends prometheus; }; } > /tmp/fl-dp-flower-apt.log 2>&1 \
      || echo "test.sh: could not install prometheus (log: /tmp/fl-dp-flower-apt.log); its tests will skip"
    [ "$made_policy" = 1 ] && rm -f "$policy"
  else
    echo "test.sh: promtool not found: tests/integration/test_prometheus.py's Prometheus checks will skip." \
         "FL_DP_INSTALL_SYSTEM_PACKAGES=1 bash scripts/test.sh installs Debian's prometheus package (root)."
  fi
fi
export FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION=1
export PATH="$PWD/.venv/bin:$PATH"
# pytest-xdist workers: most of the suite's time is real Flower processes waiting on each other, so 4 workers
# share 2 cores well; each is handed two tests at a time (the longest real-process runs first: tests/conftest.py),
# so no worker is left with a queue of long runs. FL_DP_TEST_WORKERS=0 runs everything in this process.
.venv/bin/python -m pytest -p no:cacheprovider -n "${FL_DP_TEST_WORKERS:-4}" --maxschedchunk 2 "$@"
status=$?
if [ "$status" -eq 5 ]; then
  echo "no tests were collected: failing" >&2
  exit 1
fi
exit "$status"

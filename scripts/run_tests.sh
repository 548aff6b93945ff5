#!/usr/bin/env bash
# The whole test suite on a fresh machine: set-up (idempotent), quality gates, unit and integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
echo "== ruff"; .venv/bin/ruff check .
echo "== mypy"; .venv/bin/mypy libra planner scripts benchmarks
echo "== import contracts"; .venv/bin/lint-imports
PYTEST=(.venv/bin/pytest -q -ra --timeout=900 --durations=20 --durations-min=15 -p no:cacheprovider)
# Stage 1: unit tests and the integration tests of components; stage 2: whole jobs (marker slow_job). Both
# always run, stage 2 also after a failure in stage 1, and the script fails when either did;
# `./scripts/run_tests.sh PATH` runs PATH only.
if [ $# -gt 0 ]; then
  echo "== pytest $*"; "${PYTEST[@]}" "$@"; exit
fi
status=0
echo "== pytest, stage 1: unit and component integration tests"
"${PYTEST[@]}" -m "not slow_job" tests || status=$?
echo "== pytest, stage 2: whole-job tests (slow_job)"
"${PYTEST[@]}" -m slow_job tests || status=$?
exit "$status"

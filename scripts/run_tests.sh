#!/usr/bin/env bash
# The whole test suite on a fresh machine: set-up (idempotent), quality gates, unit and integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
PYTEST=(.venv/bin/pytest -q -ra --timeout=900 --durations=20 --durations-min=15 -p no:cacheprovider)
# `./scripts/run_tests.sh PATH` runs PATH only.
if [ $# -gt 0 ]; then
  echo "== pytest $*"; "${PYTEST[@]}" "$@"; exit
fi
echo "== ruff"; .venv/bin/ruff check .
echo "== import contracts"; .venv/bin/lint-imports
# Stage 1: unit tests, then the integration tests of components; stage 2: whole jobs (marker slow_job). Every
# stage runs, also after a failure in an earlier one, and the script fails when any did. mypy (a minute on a
# fresh clone, one core) runs beside the unit tests (one core); its report follows theirs.
status=0
mypy_log="$(mktemp)"
trap 'rm -f "$mypy_log"' EXIT
.venv/bin/mypy libra planner scripts benchmarks >"$mypy_log" 2>&1 &
mypy_pid=$!
echo "== pytest, stage 1: unit tests (mypy runs beside them)"
"${PYTEST[@]}" tests/unit || status=$?
echo "== mypy"
wait "$mypy_pid" || status=$?
cat "$mypy_log"
echo "== pytest, stage 1: component integration tests"
"${PYTEST[@]}" -m "not slow_job" tests/integration || status=$?
echo "== pytest, stage 2: whole-job tests (slow_job)"
"${PYTEST[@]}" -m slow_job tests || status=$?
exit "$status"

#!/usr/bin/env bash
# The whole test suite on a fresh machine: set-up (idempotent), quality gates, unit and integration tests.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup_env.sh
export RAY_AUTH_MODE=disabled PYTHONUNBUFFERED=1
echo "== ruff"; .venv/bin/ruff check .
echo "== mypy"; .venv/bin/mypy libra planner scripts benchmarks
echo "== import contracts"; .venv/bin/lint-imports
echo "== pytest"
.venv/bin/pytest -q -ra --timeout=900 -p no:cacheprovider tests "$@"

#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh), lint with ruff, then run the test suite on the CPU, 2 workers.
# Extra arguments go to pytest, e.g. scripts/test.sh tests/test_cache.py -x
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check .
# A test whose worker process dies of a signal in native code (XLA:CPU) runs once more on a
# fresh worker and the summary counts it as a rerun; a failing test never reruns (--rerun-except .).
exec .venv/bin/python -m pytest -n 2 --dist worksteal --reruns 1 --rerun-except . -q "$@"

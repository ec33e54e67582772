#!/usr/bin/env bash
# Set up .venv (scripts/setup.sh) and run the demo on the CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python scripts/demo.py "$@"

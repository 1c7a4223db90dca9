#!/usr/bin/env bash
# The test command: builds (or reuses) .venv, then runs the whole suite on CPU.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m pytest -q tests "$@"

#!/usr/bin/env bash
# Quickstart: build (or reuse) .venv, then run the main job on built-in data
# (every kind of fast-weight model through fairseq; 4.5 minutes on 2 cores, README).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python examples/quickstart/quickstart.py "$@"

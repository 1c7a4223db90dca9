#!/usr/bin/env bash
# Quickstart: build (or reuse) .venv, then run the main job on built-in data
# (capacity, cost per token and the fairseq pipeline, two jobs at a time; its time: README).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python examples/quickstart/quickstart.py "$@"

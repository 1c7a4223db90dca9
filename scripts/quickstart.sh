#!/usr/bin/env bash
# Quickstart: build (or reuse) .venv, then run the main job on built-in data.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python -m fairseq_fwp.ops.benchmark --quick

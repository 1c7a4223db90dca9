#!/usr/bin/env bash
# Mutation testing of the code that holds the math and the state (tests/mutation/run.py; the score and how to
# read it: docs/DEVELOPERS.md, "Test strength"). Each mutant of tests/mutation/mutants.py is applied to a copy
# of the repository; the property harness runs against it, and the fast lane where the harness misses it. Only a
# test that fails on an assertion (in the mutant's selection) catches it; a crash is reported apart, and makes the
# exit status 1 (tests/mutation/catches.py). Not in CI: it takes minutes by design (one process, one thread:
# nice it where other work runs).
#   bash scripts/mutants.sh [--only NAME ...] [--harness-only] [--list] [--keep] [--json PATH]
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
exec .venv/bin/python tests/mutation/run.py "$@"

#!/usr/bin/env bash
# The test command: builds (or reuses) .venv, then runs the whole suite on the CPU, one pytest worker per
# core (CI runs exactly this). --fast leaves out the tests that start new processes (the fairseq
# command-line tools end to end, fresh interpreters, nvcc, the tests' own C++ build: the tests marked slow)
# but one, which runs fairseq-train and fairseq-generate as installed (tests/test_preloaded.py); other
# arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup_env.sh
select=()
if [[ ${1:-} == --fast ]]; then
  select=(-m "not slow")
  shift
fi
exec .venv/bin/python -m pytest -q -rs -n "$(nproc)" --dist worksteal "${select[@]}" tests "$@"

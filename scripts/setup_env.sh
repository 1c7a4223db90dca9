#!/usr/bin/env bash
# Creates .venv in the repo root with every dependency, pinned. A second run
# reuses it and returns at once unless requirements.txt or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
FAIRSEQ=fairseq-fixed==0.12.3.1  # upstream fairseq 0.12.2 does not build on Python 3.11

stamp=.venv/.fairseq-fwp-env
want=$(cat requirements.txt scripts/setup_env.sh setup.py | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
  exit 0
fi
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check)
"${pip[@]}" -r requirements.txt
# fairseq's build needs torch/numpy/cython from the venv (no build isolation);
# --no-deps keeps it from pulling torchaudio and with it a second torch.
"${pip[@]}" --no-build-isolation --no-deps "$FAIRSEQ"
"${pip[@]}" --no-build-isolation --no-deps -e .
echo "$want" > "$stamp"

#!/usr/bin/env bash
# Here, with the package registry: the wheels the GPU check needs on a machine
# without one (its image has torch, triton, numpy, cython, pytest, sacrebleu and
# scikit-learn, but not fla or fairseq), into .whl/ (ignored by git).
# PYTHON_VERSION is the GPU machine's Python (3.12); 3.11 makes wheels for this
# machine, for a dry run of scripts/gpu_check.sh here.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON_VERSION=${PYTHON_VERSION:-3.12}
bash scripts/setup_env.sh  # its pip can read fairseq-fixed's metadata, which imports torch
pip=(.venv/bin/python -m pip --disable-pip-version-check)
rm -rf .whl && mkdir .whl
platforms=()
for p in manylinux_2_28_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64; do platforms+=(--platform "$p"); done
# What the image lacks, at the versions of requirements.txt.
"${pip[@]}" download -q --no-deps --only-binary=:all: --python-version "$PYTHON_VERSION" --implementation cp \
    "${platforms[@]}" -d .whl fla-core==0.6.0 hydra-core==1.3.2 omegaconf==2.3.0 bitarray==3.0.0 sacremoses==0.1.1
# Source-only on the registry: omegaconf's parser runtime (pure Python, built into a wheel here) and
# fairseq-fixed, whose Cython modules the check builds on the GPU machine.
"${pip[@]}" wheel -q --no-deps -w .whl antlr4-python3-runtime==4.9.3
"${pip[@]}" download -q --no-deps --no-binary=:all: --no-build-isolation -d .whl fairseq-fixed==0.12.3.1
ls .whl
du -sh .whl

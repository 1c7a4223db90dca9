#!/usr/bin/env bash
# Creates .venv in the repo root with every dependency, pinned. A second run
# reuses it and returns at once unless requirements.txt or this script changed.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3.11}
FAIRSEQ=fairseq-fixed==0.12.3.1  # upstream fairseq 0.12.2 does not build on Python 3.11
FASTBPE=0.1.0

stamp=.venv/.fairseq-fwp-env
want=$(cat requirements.txt scripts/setup_env.sh setup.py csrc/* | sha256sum | cut -d' ' -f1)
if [[ -f $stamp && $(cat "$stamp") == "$want" ]]; then
  exit 0
fi
[[ -x .venv/bin/python ]] || "$PYTHON" -m venv .venv
pip=(.venv/bin/python -m pip install --disable-pip-version-check)
# What the csrc extension builds with, first; the rest installs while it compiles.
mapfile -t build_deps < <(grep -E '^(torch|numpy|setuptools|wheel|packaging|ninja)==' requirements.txt | cut -d' ' -f1)
"${pip[@]}" "${build_deps[@]}"
# The csrc extension's CPU part, in place (fairseq_fwp/_C*.so, about 35 s of one core), built beside the
# other packages' and fairseq's installs: decoding's fused step needs it from the first step on (pip's
# editable install would build it without this venv's torch).
ext_log=$(mktemp)
FAIRSEQ_FWP_BUILD_EXT=1 .venv/bin/python setup.py -q build_ext --inplace > "$ext_log" 2>&1 &
ext_build=$!
"${pip[@]}" -r requirements.txt
# fairseq's build needs torch/numpy/cython from the venv (no build isolation);
# --no-deps keeps it from pulling torchaudio and with it a second torch.
# Its six C++ extensions build side by side, one per core (164 s -> 113 s on 2 cores). torch's ninja
# backend would write every extension's build file into one shared folder, which parallel builds race
# on, so this build finds no ninja: torch compiles each file directly (each extension has one or two).
build=$(mktemp -d)
printf '[build_ext]\nparallel = %s\n' "$(nproc)" > "$build/setup.cfg"
mkdir "$build/bin" && printf '#!/bin/sh\nexit 1\n' > "$build/bin/ninja" && chmod +x "$build/bin/ninja"
PATH="$build/bin:$PATH" DIST_EXTRA_CONFIG="$build/setup.cfg" "${pip[@]}" --no-build-isolation --no-deps "$FAIRSEQ"
rm -rf "$build"
wait "$ext_build" || { cat "$ext_log"; echo "setup_env: the csrc extension did not build" >&2; exit 1; }
rm -f "$ext_log"
FAIRSEQ_FWP_BUILD_EXT=0 "${pip[@]}" --no-build-isolation --no-deps -e .  # the extension is built above
# fastBPE (--bpe-tool fastbpe, fairseq's --bpe fastbpe): its Python module applies codes; its
# command-line program, which learns them, is built from the same registry sources.
"${pip[@]}" --no-build-isolation --no-deps "fastBPE==$FASTBPE"
src=$(mktemp -d)
.venv/bin/python -m pip download -q --disable-pip-version-check --no-deps --no-binary=:all: --no-build-isolation \
    -d "$src" "fastBPE==$FASTBPE"
tar xzf "$src"/fastBPE-*.tar.gz -C "$src"
g++ -std=c++11 -pthread -O3 "$src"/fastBPE-*/fastBPE/main.cc -I"$src"/fastBPE-"$FASTBPE"/fastBPE -o .venv/bin/fastbpe
rm -rf "$src"
echo "$want" > "$stamp"

#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py), on a machine with a CUDA GPU and no
# package registry: installs the wheels that scripts/gpu_wheels.sh put in .whl/,
# builds fairseq's Cython modules from its carried source, then runs every GPU
# test, half-precision fairseq-train and the GPU benchmark, and writes
# docs/gpu_check_<date>.md (and a copy into $OUT). About 6-8 minutes on an H100.
# Through the session's device tool: run(command="bash scripts/gpu_check.sh", carry=[".whl"]).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=$(realpath -s "$(command -v "${PYTHON:-python3}")")  # absolute: used from other folders below
ls .whl/*.whl .whl/fairseq_fixed-*.tar.gz > /dev/null || { echo "no wheels in .whl/: run scripts/gpu_wheels.sh first" >&2; exit 2; }
work=${GPU_CHECK_WORK:-/tmp/fairseq_fwp_gpu_check}
rm -rf "$work" && mkdir -p "$work/site"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" .whl/*.whl
tar xzf .whl/fairseq_fixed-*.tar.gz -C "$work"
fairseq_src=$(echo "$work"/fairseq_fixed-*)
# fairseq-train needs only the two Cython modules of fairseq's data pipeline;
# its C++ extensions (BLEU without sacrebleu, NAT, BASE layers) are not used here.
(cd "$fairseq_src" && PYTHONPATH="$work/site" "$PYTHON" - <<'PY'
import numpy
from Cython.Build import cythonize
from setuptools import Extension, setup
modules = [Extension(f"fairseq.data.{name}", [f"fairseq/data/{name}.pyx"], include_dirs=[numpy.get_include()],
                     language="c++", extra_compile_args=["-std=c++11", "-O3"])
           for name in ("data_utils_fast", "token_block_utils_fast")]
setup(name="fairseq-cython-modules", script_args=["-q", "build_ext", "--inplace"],
      ext_modules=cythonize(modules, language_level=3, quiet=True))
PY
)
export PYTHONPATH="$fairseq_src:$work/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
exec "$PYTHON" scripts/gpu_check.py "$@"

#!/usr/bin/env bash
# The GPU check (scripts/gpu_check.py says what it runs), on a machine with a CUDA GPU and no
# package registry, in device calls of at most 10 minutes, install included (docs/gpu_check.md: the plan):
#   here, once per session:     bash scripts/gpu_wheels.sh
#   then the device tool:       run(command="bash scripts/gpu_check.sh [--parts P,...]", carry=[".whl"])
# Installs the wheels that gpu_wheels.sh put in .whl/ (what the image lacks: fla, hydra, ...) into a
# folder of its own, builds fairseq's two Cython modules from its carried source (fairseq-train needs
# no other compiled part of fairseq) and writes fairseq's console scripts, so that fairseq runs both
# ways users launch it (fairseq-train, and python -m fairseq_cli.train). The csrc extension builds
# meanwhile, beside the install. Then every part runs under its own time limit, inside
# GPU_CHECK_BUDGET seconds (default 560) from this script's start, with one Triton cache folder for
# all of them, and the report (docs/gpu_check_report.md, and a copy into $OUT with the GPU's autotune
# winners) is rewritten as each part goes. A later call on the same machine finds the install, the
# extension's build and Triton's cache in place (GPU_CHECK_FRESH=1 starts them afresh).
# GPU_CHECK_PLAN=1 first prints the plan (scripts/gpu_check_plan.py, on the CPU: what each part
# compiles, and its time on a GPU machine) and writes scripts/gpu_check_calls.json.
# scripts/gpu_rehearsal.sh runs this on a CPU machine with the GPU image's software (a dry run).
set -euo pipefail
started=$(date +%s)
deadline=$(( started + ${GPU_CHECK_BUDGET:-560} ))  # the plan: 8 minutes; a device call may take 10
cd "$(dirname "$0")/.."
PYTHON=$(realpath -s "$(command -v "${PYTHON:-python3}")")  # absolute: used from other folders below
ls .whl/*.whl .whl/fairseq_fixed-*.tar.gz > /dev/null || { echo "no wheels in .whl/: run scripts/gpu_wheels.sh first" >&2; exit 2; }
work=${GPU_CHECK_WORK:-/tmp/fairseq_fwp_gpu_check}
[[ ${GPU_CHECK_FRESH:-0} == 1 ]] && rm -rf "$work"
mkdir -p "$work/triton-cache" "$work/torch-extensions"
export TRITON_CACHE_DIR="$work/triton-cache"  # one folder for every part: a part finds what an earlier one compiled
export TORCH_EXTENSIONS_DIR="$work/torch-extensions"
export FLA_CACHE_RESULTS=1  # fla's default, said: each autotuning writes its timings into Triton's cache (recorded)
# The csrc extension's JIT build (nvcc, about a minute), beside the install; the GPU tests wait for it
# (torch's build lock) or, if it failed, build it again and report why.
if "$PYTHON" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2> /dev/null; then
  PYTHONPATH="$PWD" "$PYTHON" -c "from fairseq_fwp.ops import cuda; cuda.load_extension()" \
      > "$work/extension-build.log" 2>&1 &
fi
wheels=$(cd .whl && sha256sum ./*.whl ./*.tar.gz | sha256sum)  # what is installed: a later call with them skips it
if [[ $(cat "$work/installed" 2> /dev/null) != "$wheels" ]]; then
echo "[gpu check] installing the carried wheels and building fairseq's Cython modules"
rm -rf "$work/site" "$work/bin" "$work"/fairseq_fixed-* && mkdir -p "$work/site" "$work/bin"
"$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$work/site" .whl/*.whl
tar xzf .whl/fairseq_fixed-*.tar.gz -C "$work"
fairseq_src=$(echo "$work"/fairseq_fixed-*)
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
# The console scripts pip would write for fairseq (its setup.py's entry points).
for tool in preprocess train generate eval_lm; do
  printf '#!%s\nimport sys\nfrom fairseq_cli.%s import cli_main\nsys.exit(cli_main())\n' "$PYTHON" "$tool" \
      > "$work/bin/fairseq-${tool//_/-}"
  chmod +x "$work/bin/fairseq-${tool//_/-}"
done
echo "$wheels" > "$work/installed"
fi
fairseq_src=$(echo "$work"/fairseq_fixed-*)
export FAIRSEQ_BIN="$work/bin"  # where examples.recipes.commands looks for the console scripts
export PYTHONPATH="$fairseq_src:$work/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1
if [[ ${GPU_CHECK_PLAN:-0} == 1 ]]; then  # not the check's time: its start and deadline move past it
  planning=$(date +%s)
  "$PYTHON" scripts/gpu_check_plan.py --calls scripts/gpu_check_calls.json
  started=$(( started + $(date +%s) - planning )) && deadline=$(( deadline + $(date +%s) - planning ))
fi
exec "$PYTHON" scripts/gpu_check.py --started "$started" --deadline "$deadline" "$@"

#!/usr/bin/env bash
# A rehearsal of the GPU check on this CPU machine, with the GPU image's software: Python 3.12,
# torch 2.11, triton 3.6 and numpy 2.x (the device tool's KINDS.md lists the image's packages),
# installed into .rehearsal/ from the package registry, and the wheels of scripts/gpu_wheels.sh for
# what the image lacks. Then scripts/gpu_check.sh runs as it will on the GPU machine: first the plan
# (GPU_CHECK_PLAN=1: scripts/gpu_check_plan.py prints, per part, the Triton kernels it will compile on a
# cold GPU machine and its expected time there, and rewrites scripts/gpu_check_calls.json, which the
# check's compile part replays: commit it), then the check itself; without CUDA, its parts that need a
# GPU skip (a dry run), and each part gets --time-scale 4 times its time on a GPU machine (2 cores
# instead of 16 and a GPU). Before that, the extension's CUDA build is compiled, linked and loaded
# here. The first run downloads torch 2.11's CUDA build (about 5 GB in .rehearsal/, installed once).
set -euo pipefail
cd "$(dirname "$0")/.."
if [[ -z ${PYTHON:-} ]]; then
  for candidate in python3.12 "$HOME"/.pyenv/versions/3.12*/bin/python3.12; do
    if "$candidate" -c "" 2> /dev/null; then PYTHON=$candidate; break; fi
  done
fi
[[ -n ${PYTHON:-} ]] || { echo "gpu_rehearsal.sh needs Python 3.12 (set PYTHON=...)" >&2; exit 2; }
# The image's versions of what the check uses; what the image lacks comes from .whl/ as on the GPU machine.
IMAGE_PACKAGES=(torch==2.11.0 triton==3.6.0 numpy==2.5.2 cython pytest pytest-xdist sacrebleu scikit-learn scipy
                regex tqdm pyyaml packaging einops matplotlib)
[[ -x .rehearsal/bin/python ]] || "$PYTHON" -m venv .rehearsal
.rehearsal/bin/python -m pip install -q --disable-pip-version-check "${IMAGE_PACKAGES[@]}"
[[ -f .whl/.python-3.12 ]] || { PYTHON_VERSION=3.12 bash scripts/gpu_wheels.sh && touch .whl/.python-3.12; }
# The csrc extension with its CUDA kernels (for sm_90), as setup.py builds it, against the image's torch: the
# kernels and the glue compile and link, and the extension loads (no GPU needed for that). About 45 s.
ext=$(mktemp -d)
if ! TORCH_CUDA_ARCH_LIST=9.0 FAIRSEQ_FWP_BUILD_EXT=1 .rehearsal/bin/python setup.py -q build_ext \
    --build-lib "$ext/lib" --build-temp "$ext/tmp" > "$ext/log" 2>&1; then
  tail -30 "$ext/log"; echo "gpu_rehearsal: the CUDA build of the extension failed" >&2; exit 1
fi
.rehearsal/bin/python - "$ext"/lib/fairseq_fwp/_C*.so <<'PY'
import importlib.util, sys
import torch  # noqa: F401  (the extension's libraries)
spec = importlib.util.spec_from_file_location("_C", sys.argv[1])
extension = importlib.util.module_from_spec(spec)
spec.loader.exec_module(extension)
assert extension.has_cuda_kernels(), "the CUDA build has no CUDA kernels"
print("[gpu rehearsal] the extension's CUDA build compiles, links and loads")
PY
rm -rf "$ext"
PYTHON=.rehearsal/bin/python GPU_CHECK_WORK=/tmp/fairseq_fwp_gpu_rehearsal GPU_CHECK_BUDGET=1440 GPU_CHECK_PLAN=1 \
    exec bash scripts/gpu_check.sh --time-scale 4 --report-name "gpu_check_$(date +%F)_rehearsal.md" "$@"

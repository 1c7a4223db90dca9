"""Where the csrc/ sources are, and a digest of them: what names a build of the extension (ops/cuda.py's JIT
build, setup.py's prebuilt one), so that a build of other sources is never loaded for these. Plain Python:
setup.py reads it before anything is installed."""
import hashlib
import os

CSRC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc")
CUDA_SOURCES = ("fast_weight_cuda.cu", "fast_weight_step_cuda.cu")  # the kernels; beside the torch glue


def source_files(with_cuda, folder=CSRC_DIR):
    """What a build compiles: the torch glue (with the CPU twin and the fused step), and the CUDA kernels."""
    return [os.path.join(folder, name) for name in ("fast_weight.cpp", *(CUDA_SOURCES if with_cuda else ()))]


def sources_digest():
    """A digest of every file in csrc/ (torch's JIT build notices changed sources, not changed headers); None
    where the package is installed without its sources (its prebuilt extension is then the only build)."""
    if not os.path.isdir(CSRC_DIR):
        return None
    digest = hashlib.sha1()
    for name in sorted(os.listdir(CSRC_DIR)):
        with open(os.path.join(CSRC_DIR, name), "rb") as f:
            digest.update(name.encode() + f.read())
    return digest.hexdigest()[:10]

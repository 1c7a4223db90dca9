"""Where the csrc/ sources are, and a digest of them: what names a build of the extension (ops/cuda.py's JIT
build, setup.py's prebuilt one), so that a build of other sources is never loaded for these; and where nvcc's
CUDA toolkit is, for either build. Plain Python: setup.py reads it before anything is installed."""
import hashlib
import os
import re
import subprocess

CSRC_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "csrc")
CUDA_SOURCES = ("fast_weight_cuda.cu", "fast_weight_step_cuda.cu")  # the kernels; beside the torch glue


def source_files(with_cuda, folder=CSRC_DIR):
    """What a build compiles: the torch glue (with the CPU twin and the fused step), and the CUDA kernels."""
    return [os.path.join(folder, name) for name in ("fast_weight.cpp", *(CUDA_SOURCES if with_cuda else ()))]


SOURCE_SUFFIXES = (".cpp", ".cu", ".h", ".cuh")  # what a build compiles or includes


def sources_digest():
    """A digest of csrc/'s sources and headers (torch's JIT build notices changed sources, not changed
    headers); other entries (a build folder, an editor's backup) are not part of a build. None where the
    package is installed without its sources, or where they cannot be read: its prebuilt extension is then
    the only build."""
    if not os.path.isdir(CSRC_DIR):
        return None
    digest = hashlib.sha1()
    try:
        for name in sorted(os.listdir(CSRC_DIR)):
            if name.endswith(SOURCE_SUFFIXES):
                with open(os.path.join(CSRC_DIR, name), "rb") as f:
                    digest.update(name.encode() + f.read())
    except OSError:
        return None
    return digest.hexdigest()[:10]


def toolkit_of(nvcc):
    """The CUDA toolkit folder of the nvcc at path `nvcc`, as nvcc itself reports it, or None.

    nvcc on PATH may be a wrapper script (``exec /usr/local/cuda-13.0/bin/nvcc "$@"`` in
    /usr/local/bin), from which torch would take /usr/local for the toolkit and miss its headers.
    """
    try:
        proc = subprocess.run([nvcc, "--dryrun", "-E", "-x", "cu", os.devnull], capture_output=True, text=True,
                              timeout=60)
    except (OSError, subprocess.SubprocessError):
        return None
    match = re.search(r"^#\$ _HERE_=(.+)$", proc.stdout + proc.stderr, re.MULTILINE)
    if not match:
        return None
    root = os.path.dirname(match.group(1).strip())
    return root if os.path.isfile(os.path.join(root, "include", "cuda_runtime.h")) else None

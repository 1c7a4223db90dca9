"""fairseq-fwp: fast-weight programmers (linear Transformers, Performers, DPFP, DeltaNet) for fairseq.

The csrc/ extension (CUDA kernels and their CPU twin) is built here when a
CUDA toolchain and a CUDA build of torch are present. FAIRSEQ_FWP_BUILD_EXT
overrides that: "1" builds it (the CPU twin alone without CUDA), "0" skips it.
Without a prebuilt extension the ops JIT-build it on first use of
backend="cuda" (fairseq_fwp/ops/cuda.py).
"""
import importlib.util
import os
import shutil

from setuptools import find_packages, setup


def _csrc_sources():
    """fairseq_fwp/ops/csrc_sources.py, read without importing the package (nothing is installed yet)."""
    spec = importlib.util.spec_from_file_location("csrc_sources", os.path.join("fairseq_fwp", "ops", "csrc_sources.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def extension_modules():
    switch = os.environ.get("FAIRSEQ_FWP_BUILD_EXT", "auto")
    if switch not in ("auto", "0", "1"):
        raise SystemExit(f"FAIRSEQ_FWP_BUILD_EXT must be auto, 0 or 1; got {switch!r}")
    if switch == "0":
        return [], {}
    try:
        import torch
        from torch.utils import cpp_extension
    except ImportError:
        if switch == "1":
            raise SystemExit("FAIRSEQ_FWP_BUILD_EXT=1 needs torch installed first (pip install torch)")
        return [], {}
    csrc_sources = _csrc_sources()
    # nvcc on PATH may be a wrapper script, from whose folder torch guesses a toolkit without its headers:
    # take the toolkit nvcc itself reports, where the user has not named one.
    nvcc = shutil.which("nvcc")
    if torch.version.cuda is not None and nvcc and not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")):
        root = csrc_sources.toolkit_of(nvcc)
        if root is not None:
            os.environ["CUDA_HOME"] = cpp_extension.CUDA_HOME = root
    # CUDA kernels need a target: the GPUs in sight, or TORCH_CUDA_ARCH_LIST on a build machine without one.
    with_cuda = (torch.version.cuda is not None and cpp_extension.CUDA_HOME is not None
                 and (torch.cuda.is_available() or bool(os.environ.get("TORCH_CUDA_ARCH_LIST"))))
    if switch == "auto" and not with_cuda:
        return [], {}
    sources = csrc_sources.source_files(with_cuda, "csrc")
    digest = csrc_sources.sources_digest()  # the extension says which sources it was built from
    flags = {"cxx": ["-O3", "-std=c++17", f'-DFWP_SOURCES_DIGEST="{digest}"']}
    if with_cuda:
        flags["cxx"].append("-DFWP_WITH_CUDA")
        flags["nvcc"] = ["-O3", "-std=c++17"]
        module = cpp_extension.CUDAExtension("fairseq_fwp._C", sources, extra_compile_args=flags)
    else:
        module = cpp_extension.CppExtension("fairseq_fwp._C", sources, extra_compile_args=flags)
    return [module], {"build_ext": cpp_extension.BuildExtension}


ext_modules, cmdclass = extension_modules()

setup(
    name="fairseq-fwp",
    version="0.1.0",
    description="Fast-weight attention (sum and delta rules; linear, FAVOR+ and DPFP feature maps) for fairseq",
    long_description=open("README.md").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["fairseq_fwp", "fairseq_fwp.*"]),
    package_data={"fairseq_fwp.ops": ["README.md"], "fairseq_fwp.ops.fla_configs": ["README.md", "*/*.json"]},
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    install_requires=[
        "torch>=2.4",  # torch.get_autocast_dtype
        "numpy",
        "requests",  # uptrain --pretrained: fairseq's downloader of published models
    ],
    extras_require={
        # The `fairseq` package. Upstream 0.12.2 does not build on Python >= 3.11,
        # where fairseq-fixed provides it. Not a hard requirement: fairseq-fixed
        # asks for torchaudio, which pins its own torch; scripts/setup_env.sh
        # installs it with --no-deps instead.
        "fairseq": [
            "fairseq==0.12.2; python_version < '3.11'",
            "fairseq-fixed==0.12.3.1; python_version >= '3.11'",
        ],
        # backend="fla": flash-linear-attention's Triton kernels, for GPUs.
        "gpu": ["fla-core>=0.6", "triton>=3.3"],
        # examples/: the recipes (data preparation, BLEU), the synthetic benchmarks and their plots.
        "recipes": ["sacrebleu>=2.0", "sacremoses", "subword-nmt", "fastBPE", "matplotlib"],
        "test": ["pytest"],
    },
)

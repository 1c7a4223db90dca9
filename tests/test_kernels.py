"""The csrc/ kernels against the reference: their CPU twin always, the CUDA kernels on a GPU.

The twin (csrc/fast_weight_twin.h) runs the kernels' algorithm (row tiles,
checkpoints every CHUNK steps, the backward's replay of W_{t-1}, per-tile
partial gradients) through the same extension and autograd Function as the
GPU path; the GPU tests (test_gpu_*) run the CUDA kernels themselves, and
without CUDA their own code runs on the CPU's stand-in of CUDA with the twin
computing (tests/cuda_stand_in.py).
"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

from fairseq_fwp.ops import fast_weight_delta, fast_weight_sum
from fairseq_fwp.ops import cuda as kernels
from helpers import assert_all_close, make_inputs, outputs_and_grads, relative_errors, run_op

RULES = ["sum", "delta"]
C = kernels.CHUNK
# (B, H, T, D, Dv): T = 1, T < CHUNK, T = CHUNK, T not a multiple of CHUNK,
# several tiles of rows with a ragged last one (Dv = 13 > 8 rows), D not a
# multiple of 32, D = 512 (the kernels' maximum), B*H = 1.
SHAPES = [
    (2, 3, 1, 4, 4),
    (1, 1, 7, 5, 3),
    (2, 2, C, 8, 8),
    (1, 2, 3 * C + 5, 40, 13),
    (2, 1, 2 * C - 1, 130, 6),
    (1, 1, C + 3, 512, 9),
]


@pytest.fixture(scope="module", autouse=True)
def extension():
    """Build (or load) the extension once; its JIT build takes about 30 s of one core."""
    return kernels.load_extension()


def kernel_outputs_and_grads(rule, inputs, chunk=None):
    """As outputs_and_grads, through the kernels' autograd Function (the twin on CPU)."""
    def op(q, k, v, beta, W0):
        if rule == "sum":
            return kernels.fast_weight_sum_kernel(q, k, v, W0, chunk=chunk)
        return kernels.fast_weight_delta_kernel(q, k, v, beta, W0, chunk=chunk)
    return outputs_and_grads(rule, inputs, op)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("with_state", [False, True])
def test_twin_matches_reference_float64(rule, shape, with_state):
    inputs = make_inputs(*shape, with_state=with_state)
    if not with_state:  # the op layer fills in zeros; the kernels always take a state
        inputs[4] = torch.zeros(shape[0], shape[1], shape[4], shape[3], dtype=torch.float64, requires_grad=True)
    want = outputs_and_grads(rule, inputs, "reference")
    got = kernel_outputs_and_grads(rule, inputs)
    assert_all_close(got, want, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("rule", RULES)
def test_twin_matches_reference_float32(rule):
    inputs = make_inputs(2, 2, 2 * C + 3, 48, 20, dtype=torch.float32)
    assert_all_close(kernel_outputs_and_grads(rule, inputs), outputs_and_grads(rule, inputs, "reference"),
                     rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("chunk", [1, 4, 64])
def test_twin_gradcheck_across_checkpoints(rule, chunk):
    q, k, v, beta, W0 = make_inputs(1, 2, 11, 3, 5)

    def fn(q, k, v, beta, W0):
        if rule == "sum":
            return kernels.fast_weight_sum_kernel(q, k, v, W0, chunk=chunk)
        return kernels.fast_weight_delta_kernel(q, k, v, beta, W0, chunk=chunk)

    assert torch.autograd.gradcheck(fn, (q, k, v, beta, W0))


def half_type_errors(rule, dtype, run, device="cpu"):
    """relative_errors of run (inputs -> outputs_and_grads) on half-type q, k, v, beta and a float32 state
    against exact arithmetic on the same rounded inputs, with the loss weights rounded as that run sees them:
    what is left is the kernels' own rounding (the half-type outputs and gradients, at most half a unit in
    the last place of each: a 1% error fails), not the rounding of what they were given. Elementwise
    tolerances cannot judge that: a gradient element near 0 beside others near 100 carries the absolute error
    of its neighbours.
    Both runs take the inputs on `device`, where the errors are computed."""
    half = [x.detach().to(device, dtype) for x in make_inputs(2, 4, 4 * C + 7, 64, 64, dtype=torch.float32)]
    half[4] = half[4].float()
    got = run([x.clone().requires_grad_() for x in half])
    assert got["out"].dtype == dtype and got["state"].dtype == torch.float32
    exact = outputs_and_grads(rule, [x.double().requires_grad_() for x in half], "reference",
                              rounded_as=(dtype, torch.float32))
    # half types: the unit roundoff (eps / 2), the error of each output rounded once from float32's sums
    return relative_errors(got, exact), {name: torch.finfo(x.dtype).eps / 2 if x.dtype != torch.float32 else 1e-5
                                         for name, x in got.items()}


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_twin_reads_half_inputs_and_accumulates_in_float32(rule, dtype):
    errors, tolerances = half_type_errors(rule, dtype, lambda inputs: kernel_outputs_and_grads(rule, inputs))
    assert all(errors[name] < tolerances[name] for name in errors), (errors, tolerances)


@pytest.mark.parametrize("rule", RULES)
def test_twin_is_deterministic(rule):
    inputs = make_inputs(2, 2, 3 * C + 1, 24, 17, dtype=torch.float32)
    first = kernel_outputs_and_grads(rule, inputs)
    second = kernel_outputs_and_grads(rule, inputs)
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_twin_without_grad_saves_nothing_and_matches():
    q, k, v, beta, W0 = (x.detach() if x is not None else None for x in make_inputs(1, 1, 9, 4, 4))
    with torch.no_grad():
        out, W = kernels.fast_weight_delta_kernel(q, k, v, beta, W0)
    want_out, want_W = fast_weight_delta(q, k, v, beta, W0, backend="reference")
    torch.testing.assert_close(out, want_out)
    torch.testing.assert_close(W, want_W)


def test_cuda_backend_refuses_cpu_tensors_with_a_clear_message():
    from fairseq_fwp.ops import BackendUnavailableError

    q, k, v, beta, _ = make_inputs(1, 1, 3, 2, 2)
    with pytest.raises(BackendUnavailableError, match="CUDA tensors.*auto"):
        fast_weight_sum(q, k, v, backend="cuda")


def test_shared_memory_a_launch_needs(extension):
    """At D in (256, 512] (16 features per lane, 4 rows per tile) the backward needs
    80.3 KiB of shared memory for float32 and half types, 160.5 KiB for float64."""
    assert extension.shared_memory_bytes(512, C, 4, 4) == [65536, 82192]
    assert extension.shared_memory_bytes(512, C, 4, 8) == [131072, 164384]
    assert extension.shared_memory_bytes(64, C, 8, 4) == [8192, 12832]


def test_launches_above_the_device_limits_do_not_fit(extension):
    assert kernels.launch_fits(extension, 512, 64, torch.float32, limit=227 * 1024)  # H100
    assert kernels.launch_fits(extension, 512, 64, torch.float64, limit=227 * 1024)
    assert not kernels.launch_fits(extension, 512, 64, torch.float64, limit=99 * 1024)  # e.g. sm_86
    assert not kernels.launch_fits(extension, 512, 64, torch.float32, limit=64 * 1024)  # e.g. sm_75
    assert kernels.launch_fits(extension, 256, 64, torch.float32, limit=64 * 1024)
    assert not kernels.launch_fits(extension, extension.max_features + 1, 64, torch.float32, limit=1 << 30)


NVCC = shutil.which("nvcc")
CU_FILES = sorted((Path(kernels.CSRC_DIR)).glob("*.cu"))


@pytest.mark.slow  # nvcc takes 7-12 s per file
@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("source", CU_FILES, ids=lambda p: p.name)
def test_cuda_sources_compile(tmp_path, source):
    """Every .cu compiles with CUDA headers only (no torch): a GPU-less compile check. For the oldest
    architecture the kernels support (sm_80): the sources hold no per-architecture code, and the GPU check
    builds them for its device (sm_90 on an H100)."""
    cmd = [NVCC, "-std=c++17", "-O3", "-c", str(source), "-o", str(tmp_path / "out.o"),
           "-gencode", "arch=compute_80,code=sm_80", "-Werror", "all-warnings"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.slow  # about 10 s of the C++ compiler
@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_the_glue_compiles_with_its_cuda_branch(tmp_path):
    """fast_weight.cpp as a CUDA build of torch compiles it (FWP_WITH_CUDA: the launchers' calls, torch's CUDA
    guards and streams), against this torch's headers and nvcc's toolkit. A CPU build of torch lacks one
    header that CUDA builds generate; this writes it as they do (shared libraries)."""
    import sysconfig

    from torch.utils import cpp_extension

    macros = tmp_path / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    macros.parent.mkdir(parents=True)
    macros.write_text("#define C10_CUDA_BUILD_SHARED_LIBS\n")
    includes = [str(tmp_path), *cpp_extension.include_paths(), os.path.join(kernels.toolkit_of(NVCC), "include"),
                sysconfig.get_paths()["include"]]
    cmd = [shutil.which("c++") or "g++", "-std=c++17", "-fsyntax-only", "-DFWP_WITH_CUDA", "-DTORCH_EXTENSION_NAME=_C",
           *[f"-I{path}" for path in includes], os.path.join(kernels.CSRC_DIR, "fast_weight.cpp")]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-4000:]


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_the_toolkit_is_where_nvcc_runs_from_not_where_a_wrapper_lies(tmp_path):
    """A wrapper script on PATH (as some images install nvcc) still leads to the real toolkit."""
    root = kernels.toolkit_of(NVCC)
    assert root is not None and os.path.isfile(os.path.join(root, "include", "cuda_runtime.h"))
    wrapper = tmp_path / "bin" / "nvcc"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\nexec {NVCC} "$@"\n')
    wrapper.chmod(0o755)
    assert kernels.toolkit_of(str(wrapper)) == root
    assert kernels.toolkit_of(str(tmp_path / "missing")) is None


# -- on a GPU: the CUDA kernels themselves (on the stand-in: the twin) ------------


def to_cuda(inputs, dtype=None):
    return [None if x is None else x.detach().to("cuda", dtype or x.dtype).requires_grad_() for x in inputs]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("shape", SHAPES)
def test_gpu_kernels_match_reference_float32(rule, shape, gpu):
    inputs = to_cuda(make_inputs(*shape, dtype=torch.float32))
    want = outputs_and_grads(rule, inputs, "reference")
    got = outputs_and_grads(rule, inputs, "cuda")
    assert_all_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("rule", RULES)
def test_gpu_kernels_match_reference_float64(rule, gpu):
    inputs = to_cuda(make_inputs(2, 2, 3 * C + 5, 40, 13))
    assert_all_close(outputs_and_grads(rule, inputs, "cuda"), outputs_and_grads(rule, inputs, "reference"),
                     rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_gpu_kernels_half_types(rule, dtype, gpu):
    errors, tolerances = half_type_errors(rule, dtype, lambda inputs: outputs_and_grads(rule, inputs, "cuda"), "cuda")
    assert all(errors[name] < tolerances[name] for name in errors), (errors, tolerances)


@pytest.mark.parametrize("rule", RULES)
def test_gpu_kernels_are_deterministic(rule, gpu):
    inputs = to_cuda(make_inputs(2, 2, 5 * C + 3, 512, 33, dtype=torch.float32))
    first = outputs_and_grads(rule, inputs, "cuda")
    second = outputs_and_grads(rule, inputs, "cuda")
    assert all(torch.equal(first[name], second[name]) for name in first)


def test_gpu_auto_does_not_choose_the_kernels_before_their_gpu_check(gpu):
    from fairseq_fwp.ops.backends import resolved_name

    for D in (64, 512):
        assert resolved_name("auto", torch.rand(1, 1, 4, D, device="cuda"), 64) != "cuda"


@pytest.mark.parametrize("rule", RULES)
def test_gpu_a_launch_above_the_shared_memory_limit_is_refused(rule, gpu, monkeypatch):
    from fairseq_fwp.ops import BackendUnavailableError

    monkeypatch.setattr(kernels, "device_shared_memory_limit", lambda device: 64 * 1024)
    inputs = to_cuda(make_inputs(1, 2, C + 3, 512, 8, dtype=torch.float32))
    with pytest.raises(BackendUnavailableError, match="backend 'cuda' cannot run this call: a launch for D = 512"):
        outputs_and_grads(rule, inputs, "cuda")


def test_a_prebuilt_extension_of_other_sources_is_not_loaded(monkeypatch):
    """setup.py's build says which sources it was built from (ops/csrc_sources.py); one of other sources (csrc/
    edited since) gives way to a build of these."""
    built = object()
    monkeypatch.setattr(kernels, "_extension", None)
    monkeypatch.setattr(kernels, "_jit_build", lambda: built)
    monkeypatch.setattr(kernels, "sources_digest", lambda: "not these")
    assert kernels.load_extension() is built


def test_an_installation_without_sources_loads_its_prebuilt_extension(monkeypatch, tmp_path):
    """A package installed without csrc/ (a wheel; a copy of fairseq_fwp/ alone) has nothing to compare its
    prebuilt extension with: that build is the one it has."""
    from fairseq_fwp.ops import csrc_sources

    prebuilt = pytest.importorskip("fairseq_fwp._C", reason="setup_env.sh builds the extension in place")

    monkeypatch.setattr(kernels, "_extension", None)
    monkeypatch.setattr(csrc_sources, "CSRC_DIR", str(tmp_path / "absent"))
    monkeypatch.setattr(kernels, "_jit_build", lambda: pytest.fail("a prebuilt extension was there"))
    assert kernels.load_extension() is prebuilt


def test_stray_entries_in_csrc_leave_the_digest_and_the_prebuilt_extension_alone(monkeypatch, tmp_path):
    """A build folder, an editor's backup and notes beside the sources: the digest is of the compiled sources
    and headers only, so the prebuilt extension still loads (no rebuild, no crash)."""
    from fairseq_fwp.ops import csrc_sources

    prebuilt = pytest.importorskip("fairseq_fwp._C", reason="setup_env.sh builds the extension in place")
    copy = tmp_path / "csrc"
    shutil.copytree(csrc_sources.CSRC_DIR, copy)
    (copy / "build").mkdir()
    (copy / "fast_weight.h~").write_text("an editor's backup")
    (copy / "NOTES.txt").write_text("notes")
    monkeypatch.setattr(kernels, "_extension", None)
    monkeypatch.setattr(csrc_sources, "CSRC_DIR", str(copy))
    monkeypatch.setattr(kernels, "_jit_build", lambda: pytest.fail("rebuilt for stray entries"))
    assert kernels.load_extension() is prebuilt


def test_an_unreadable_source_falls_back_to_the_prebuilt_extension(monkeypatch, tmp_path):
    from fairseq_fwp.ops import csrc_sources

    prebuilt = pytest.importorskip("fairseq_fwp._C", reason="setup_env.sh builds the extension in place")
    copy = tmp_path / "csrc"
    shutil.copytree(csrc_sources.CSRC_DIR, copy)
    (copy / "extra.h").symlink_to(tmp_path / "gone.h")  # a header that cannot be read
    monkeypatch.setattr(kernels, "_extension", None)
    monkeypatch.setattr(csrc_sources, "CSRC_DIR", str(copy))
    monkeypatch.setattr(kernels, "_jit_build", lambda: pytest.fail("rebuilt from unreadable sources"))
    assert csrc_sources.sources_digest() is None
    assert kernels.load_extension() is prebuilt

"""backend="cuda": the csrc/ kernels, how they are loaded, and their autograd.

The extension is the prebuilt ``fairseq_fwp._C`` (setup.py builds it where a
CUDA toolchain and a CUDA build of torch are present), or else a JIT build of
``csrc/`` with ``torch.utils.cpp_extension.load`` on first use. When neither
works, ``load_extension`` raises ``BackendUnavailableError`` saying what is
missing.

The same extension carries the kernels' CPU twin (``csrc/fast_weight_twin.h``):
``fast_weight_sum_kernel`` / ``fast_weight_delta_kernel`` on CPU tensors run
it, which is how the kernels' algorithm is tested on machines without a GPU.
The public ops only send CUDA tensors here.

Activation memory kept for backward (per batch row and head): the inputs, one
``Dv x D`` state per ``CHUNK`` steps (``ceil(T / CHUNK)`` of them) and, for
the delta rule, the pseudo-values ``u_t = beta_t (v_t - vbar_t)`` (the size
of v). No per-step fast weight: the backward rebuilds ``W_{t-1}`` from the
chunk's checkpoint.
"""
import logging
import os
import shutil

import torch

from .csrc_sources import CSRC_DIR, source_files, sources_digest, toolkit_of
from .errors import BackendUnavailableError, refuse_a_second_derivative
from .protocol import Backend, Kernel

logger = logging.getLogger(__name__)
CHUNK = 16  # steps between checkpoints: the backward replays up to CHUNK - 1 writes per step

_extension = None


def _rows_per_tile(D, Dv):
    """Rows of W per thread block (one warp each): fewer for large D, whose
    backward keeps two D-sized row buffers per warp in shared memory."""
    return max(1, min(Dv, 8 if D <= 128 else 4))


def _ensure_ninja_on_path():
    """cpp_extension runs `ninja` from PATH; a venv's ninja is not there unless activated."""
    try:
        import ninja
    except ImportError:
        return
    if ninja.BIN_DIR not in os.environ.get("PATH", "").split(os.pathsep):
        os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


def _locate_cuda_toolkit(cpp_extension):
    """Set CUDA_HOME (from nvcc's own report) and TORCH_CUDA_ARCH_LIST (this device's compute capability)
    where the user has not, so that the JIT build finds the toolkit and targets this GPU."""
    if not torch.cuda.is_available():
        return
    if not (os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")) and shutil.which("nvcc"):
        root = toolkit_of(shutil.which("nvcc"))
        if root is not None and root != cpp_extension.CUDA_HOME:
            logger.info("CUDA toolkit: %s (where nvcc on PATH runs from)", root)
            os.environ["CUDA_HOME"] = cpp_extension.CUDA_HOME = root  # torch read CUDA_HOME at import
    if not os.environ.get("TORCH_CUDA_ARCH_LIST"):
        os.environ["TORCH_CUDA_ARCH_LIST"] = "{}.{}".format(*torch.cuda.get_device_capability())


def _jit_build():
    from torch.utils import cpp_extension

    _locate_cuda_toolkit(cpp_extension)
    if not os.path.isfile(os.path.join(CSRC_DIR, "fast_weight.cpp")):
        raise BackendUnavailableError(
            f"the fast-weight extension is not prebuilt and its sources are not at {CSRC_DIR}: "
            "install fairseq-fwp from a source checkout (pip install -e .)")
    # The CUDA kernels are built for the GPUs in sight; without one (a CUDA build of torch on a CPU
    # machine) only the CPU twin is built.
    with_cuda = torch.cuda.is_available() and cpp_extension.CUDA_HOME is not None
    flags = ["-O3", "-std=c++17"] + (["-DFWP_WITH_CUDA"] if with_cuda else [])
    _ensure_ninja_on_path()
    logger.info("building the fast-weight extension from %s (%s; once per machine, about a minute)",
                CSRC_DIR, "CUDA kernels and CPU twin" if with_cuda else "CPU twin only")
    return cpp_extension.load(
        name=f"fairseq_fwp_kernels_{'cuda' if with_cuda else 'cpu'}_{sources_digest()}",
        sources=source_files(with_cuda), extra_cflags=flags, extra_cuda_cflags=["-O3", "-std=c++17"],
        with_cuda=with_cuda, verbose=False)


def load_extension():
    """The compiled extension (prebuilt, else JIT-built once per process)."""
    global _extension
    if _extension is None:
        try:
            from .. import _C as extension  # built by setup.py (FAIRSEQ_FWP_BUILD_EXT=1: scripts/setup_env.sh)
            digest = sources_digest()
            if digest is not None and getattr(extension, "sources_digest", None) != digest:  # of other sources
                raise ImportError("the prebuilt extension is of other sources than csrc/'s")
        except ImportError:
            try:
                extension = _jit_build()
            except BackendUnavailableError:
                raise
            except Exception as err:  # compiler, ninja or CUDA toolchain missing or failing
                lines = str(err).strip().splitlines()
                raise BackendUnavailableError(
                    "the fast-weight extension is not prebuilt and its JIT build failed "
                    f"({type(err).__name__}: {lines[-1] if lines else ''}); it needs a C++ compiler and ninja "
                    "(pip install ninja), and for GPUs nvcc and a CUDA build of torch") from err
        _extension = extension
    return _extension


def device_shared_memory_limit(device):
    """Largest dynamic shared memory one thread block may opt in to, in bytes (48 KiB if unknown)."""
    return getattr(torch.cuda.get_device_properties(device), "shared_memory_per_block_optin", 48 * 1024)


def launch_fits(extension, D, Dv, dtype, limit):
    """Whether a forward and a backward launch for feature size D fit `limit` bytes of shared memory.

    The backward needs the most: at D in (256, 512], 80.3 KiB for float32
    (and half types) and 160.5 KiB for float64 (csrc/fast_weight.h).
    """
    acc_size = 8 if dtype == torch.float64 else 4
    return D <= extension.max_features and max(extension.shared_memory_bytes(D, CHUNK, _rows_per_tile(D, Dv), acc_size)) <= limit


def unfit_reason(call):
    """Why the csrc kernels cannot run `call` (a backends.Call); None if they can."""
    if call.device.type != "cuda":
        return f"the csrc kernels run on CUDA tensors, but the inputs are on {call.device}"
    try:
        extension = load_extension()
    except BackendUnavailableError as err:
        return str(err)
    if not extension.has_cuda_kernels():
        return "the fast-weight extension was built without CUDA kernels"
    limit = device_shared_memory_limit(call.device)
    if not launch_fits(extension, call.D, call.Dv, call.dtype, limit):
        return (f"a launch for D = {call.D} in {call.dtype} does not fit this device (D <= "
                f"{extension.max_features} and {limit} bytes of shared memory per block)")
    return None


class _FastWeightKernel(torch.autograd.Function):
    """Both rules; beta is None for the sum rule."""

    @staticmethod
    def forward(ctx, q, k, v, beta, state, chunk, rows):
        extension = load_extension()
        save = any(ctx.needs_input_grad[:5])
        out, W, checkpoints, u = extension.forward(q, k, v, beta, state, chunk, rows, save)
        if save:
            ctx.save_for_backward(q, k, v, beta, checkpoints, u)
        ctx.chunk, ctx.rows = chunk, rows
        return out, W

    @staticmethod
    def backward(ctx, d_out, dW):
        refuse_a_second_derivative("cuda")
        q, k, v, beta, checkpoints, u = ctx.saved_tensors  # unused outputs get zero gradients
        dq, dk, dv, dbeta, dstate = load_extension().backward(
            q, k, v, beta, d_out.contiguous(), dW.contiguous(), checkpoints, u, ctx.chunk, ctx.rows)
        return dq, dk, dv, dbeta, dstate, None, None


def _apply(q, k, v, beta, state, chunk):
    D, Dv = q.shape[-1], v.shape[-1]
    tensors = [x.contiguous() for x in (q, k, v)]
    beta = None if beta is None else beta.contiguous()
    if state is None:
        state = q.new_zeros(*q.shape[:2], Dv, D, dtype=torch.float64 if q.dtype == torch.float64 else torch.float32)
    return _FastWeightKernel.apply(*tensors, beta, state.contiguous(), chunk or CHUNK, _rows_per_tile(D, Dv))


def fast_weight_sum_kernel(q, k, v, state, chunk=None):
    """Sum rule through the kernels (CUDA tensors) or their CPU twin (CPU tensors).

    q, k, v keep their dtype (float32/64, float16, bfloat16); ``state`` is in
    the accumulation dtype, or None for zeros. Returns (out in the input
    dtype, final state).
    """
    return _apply(q, k, v, None, state, chunk)


def fast_weight_delta_kernel(q, k, v, beta, state, chunk=None):
    """Delta rule through the kernels or their CPU twin; see fast_weight_sum_kernel."""
    return _apply(q, k, v, beta, state, chunk)


# -- the kernels of the built-in rules (rules/sum.py, rules/delta.py); no gated rules ------------------

BACKEND = Backend("cuda", reads_half_types=True, unfit_reason=unfit_reason)  # accumulates in float32


@torch.no_grad()
def _step_(call, memory, q, k, v, beta, log_decay):
    """One step of the kernels (T = 1), its new state copied into the memory's W."""
    W = memory.fast_weight_for(q, v, call.accumulation_dtype)
    one = lambda x: None if x is None else x.unsqueeze(2)  # noqa: E731  one step of a sequence
    out, new = _apply(one(q), one(k), one(v), one(beta), W, None)
    W.copy_(new)
    return out[:, :, 0]


# One kernel launch for both rules: beta None is the sum rule.
SUM = DELTA = Kernel(lambda call, q, k, v, beta, state, log_decay: _apply(q, k, v, beta, state, None),
                     lambda call, k, v, beta, state, log_decay: _apply(k, k, v, beta, state, None)[1], _step_)

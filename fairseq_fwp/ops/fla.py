"""backend="fla": flash-linear-attention's Triton kernels (optional: ``pip install fla-core triton``).

Which kernel runs:
- float16/bfloat16 with T > 1: the chunkwise kernels, ``chunk_simple_gla``
  (the sum rule: without a gate; with g = log a, the gated sum rule),
  ``chunk_delta_rule`` and ``chunk_gated_delta_rule``; they take only half
  types;
- float32, and every single decoding step (T = 1): the recurrent kernels,
  ``fused_recurrent_simple_gla``, ``fused_recurrent_delta_rule`` and
  ``fused_recurrent_gated_delta_rule`` (which has no backward pass: where the
  gated delta rule needs gradients there, ``auto`` runs ``chunked``).
All of them accumulate in float32 and return the state in float32. Where fla
itself refuses a kernel on the device and versions at hand (fla_guards.py:
the gated chunk kernels' backward on Hopper GPUs with some Triton versions),
the call is refused here before any work, in fla's words, and ``auto`` runs
``chunked``.

Glue, the same for every kernel: fla's layout is ``[B, T, H, D]`` (ours
``[B, H, T, D]``), its state is ``W^T`` (``[B, H, D, Dv]``), and it scales
queries by ``scale``, which is 1 here (our ops apply no scaling). Gradients
reach q, k, v, beta and the initial state.

fla runs on CUDA tensors. On the CPU it runs only through Triton's
interpreter (``TRITON_INTERPRET=1`` before triton is imported, inside
``fairseq_fwp.testing.triton_interpreter()``), which is how every kernel
form above is tested on machines without a GPU (tests/test_fla_interpreted.py);
the interpreter computes bfloat16 chunks wrongly, so those are refused there.
"""
import functools
import importlib
import os

import torch

from . import fla_configs, fla_guards
from .errors import BackendUnavailableError
from .protocol import Backend, Kernel, fits

MAX_FEATURES = 256  # chunk_delta_rule's largest head size
# fla's g for a full forget (log a = -inf): exp of it is exactly 0 in float32 (below 2^-149), and no
# difference of two -infs is ever formed inside the kernels.
LOG_FULL_FORGET = -110.0
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_HALF_DTYPES = (torch.float16, torch.bfloat16)


@functools.lru_cache(maxsize=None)
def kernels():
    """fla's four entry points by (rule, form); raises BackendUnavailableError if fla is missing."""
    try:
        simple_gla = importlib.import_module("fla.ops.simple_gla")
        delta_rule = importlib.import_module("fla.ops.delta_rule")
        gated_delta_rule = importlib.import_module("fla.ops.gated_delta_rule")
    except ImportError as err:
        raise BackendUnavailableError(
            f"fla needs flash-linear-attention ({err}): pip install fla-core triton (or pip install -e .[gpu])") from err
    fla_configs.preload()  # fla's autotuners start with the winners recorded for this GPU (fla_configs/)
    return {
        ("sum", "chunk"): simple_gla.chunk_simple_gla,
        ("sum", "recurrent"): simple_gla.fused_recurrent_simple_gla,
        ("delta", "chunk"): delta_rule.chunk_delta_rule,
        ("delta", "recurrent"): delta_rule.fused_recurrent_delta_rule,
        ("gated-sum", "chunk"): simple_gla.chunk_simple_gla,
        ("gated-sum", "recurrent"): simple_gla.fused_recurrent_simple_gla,
        ("gated-delta", "chunk"): gated_delta_rule.chunk_gated_delta_rule,
        ("gated-delta", "recurrent"): gated_delta_rule.fused_recurrent_gated_delta_rule,
    }


def interpreting():
    """Whether Triton runs kernels through its CPU interpreter in this process (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


INTERPRETER_OPEN = []  # one entry per fairseq_fwp.testing.triton_interpreter() open now


def unfit_reason(call):
    """Why fla cannot run `call` (a backends.Call); None if it can."""
    form = kernel_form(call.dtype, call.T)
    if not (call.device.type == "cuda" or INTERPRETER_OPEN):
        return (f"fla runs on CUDA tensors, but the inputs are on {call.device} (on the CPU only inside "
                "fairseq_fwp.testing.triton_interpreter(), with TRITON_INTERPRET=1 set before triton is imported)")
    if call.dtype not in KERNEL_DTYPES:
        return f"fla takes float32, float16 or bfloat16, got {call.dtype}"
    if call.device.type != "cuda" and call.dtype == torch.bfloat16 and form == "chunk":
        return "Triton's interpreter computes fla's bfloat16 chunk kernels wrongly (silently): use float16 or float32"
    if call.D > MAX_FEATURES:
        return f"fla takes feature sizes D <= {MAX_FEATURES}, got D = {call.D}"
    try:
        kernels()
    except BackendUnavailableError as err:
        return str(err)
    return None


def kernel_form(dtype, T):
    """'chunk' for half types over several steps; 'recurrent' for float32 and for one decoding step."""
    return "chunk" if dtype in _HALF_DTYPES and T > 1 else "recurrent"


def _initial_state(state, inputs):
    """Our W [B, H, Dv, D] as fla's contiguous W^T.

    fla copies a non-contiguous state inside its autograd Function, where the
    copy loses requires_grad, and its recurrent backward writes a gradient
    for every initial state it is given: a state without requires_grad
    (carried and detached) beside inputs with it would crash that backward.
    So the state is made contiguous here, and given requires_grad on a
    detached alias when the inputs need gradients; that gradient is dropped.
    """
    if state is None:
        return None
    initial = state.transpose(-1, -2).contiguous()
    if not initial.requires_grad and torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
        initial = initial.detach().requires_grad_()
    return initial


@functools.lru_cache(maxsize=None)
def channel_kernels():
    """fla's kernels of the rules with a decay per key channel, by (rule, form); raises BackendUnavailableError
    if this fla has none."""
    try:
        gla, kda, gdn2 = (importlib.import_module(f"fla.ops.{name}") for name in ("gla", "kda", "gdn2"))
    except ImportError as err:
        raise BackendUnavailableError(f"fla has no kernels of GLA, KDA and GDN-2 here ({err}): "
                                      "pip install fla-core>=0.6") from err
    fla_configs.preload()
    return {("gla", "chunk"): gla.chunk_gla, ("gla", "recurrent"): gla.fused_recurrent_gla,
            ("kda", "chunk"): kda.chunk_kda, ("kda", "recurrent"): kda.fused_recurrent_kda,
            ("gdn2", "chunk"): gdn2.chunk_gdn2, ("gdn2", "recurrent"): gdn2.fused_recurrent_gdn2}


def _channel_arguments(rule, form, q, k, v, beta, g):
    """The per-channel kernels' arguments after q, k, v, and their keywords: g is the log-decay per key channel;
    GDN-2's beta holds its erase gate (D) then its write gate (Dv)."""
    if rule == "gla":
        return (), {"g" if form == "chunk" else "gk": g}
    if rule == "kda":
        extra = (g, beta)
    else:
        extra = (g, beta[..., :k.shape[-1]], beta[..., k.shape[-1]:])
    return extra, ({"inplace_final_state": False} if form == "recurrent" else {})


def _run(rule, q, k, v, beta, state, log_decay):
    """fla's kernel for `rule` (sum, delta, gated-sum, gated-delta, gla, kda or gdn2) and the inputs' dtype and
    length."""
    to_fla = lambda x: x.transpose(1, 2)  # noqa: E731  [B, H, T, ...] <-> [B, T, H, ...]
    form = kernel_form(q.dtype, q.shape[2])
    g = None if log_decay is None else to_fla(log_decay.clamp_min(LOG_FULL_FORGET))  # fla's g is log a
    if rule in CHANNEL_RULES:
        kernel = channel_kernels()[rule, form]
        arguments, options = _channel_arguments(rule, form, q, k, v, None if beta is None else to_fla(beta), g)
    else:
        kernel, arguments = kernels()[rule, form], ()
        options = {} if beta is None else {"beta": to_fla(beta)}
        if g is not None:
            options["g"] = g
    initial = _initial_state(state, [x for x in (q, k, v, beta, log_decay) if x is not None])
    out, final = kernel(to_fla(q), to_fla(k), to_fla(v), *arguments, scale=1.0, initial_state=initial,
                        output_final_state=True, **options)
    return to_fla(out), final.transpose(-1, -2)


# -- the kernels of the built-in rules (rules/sum.py, rules/delta.py) ------------------------------

BACKEND = Backend("fla", reads_half_types=True, unfit_reason=unfit_reason)  # accumulates in float32


def _gated_chunk_backward_refused(call):
    """fla's own refusal of its gated chunk kernels' backward on this device and these versions (fla_guards)."""
    if call.needs_grad and kernel_form(call.dtype, call.T) == "chunk":
        return fla_guards.refusal("the gated chunk kernels' backward")
    return None


def _gated_delta_unfit(call):
    if call.needs_grad and kernel_form(call.dtype, call.T) == "recurrent":
        return "fla's recurrent gated delta rule (float32, or one step) has no backward pass"
    return _gated_chunk_backward_refused(call)


def _kernel(rule, unfit=fits):
    """fla's kernels for a built-in rule; the final state alone runs the full kernels with the keys as
    queries, the outputs dropped (fla has no state-only kernels); a decoding step runs the recurrent kernel
    (T = 1) and copies its new state into the memory's W."""
    @torch.no_grad()
    def step_(call, memory, q, k, v, beta, log_decay):
        W = memory.fast_weight_for(q, v, call.accumulation_dtype)
        one = lambda x: None if x is None else x.unsqueeze(2)  # noqa: E731  one step of a sequence
        out, new = _run(rule, one(q), one(k), one(v), one(beta), W, one(log_decay))
        W.copy_(new)
        return out[:, :, 0]

    return Kernel(lambda call, q, k, v, beta, state, log_decay: _run(rule, q, k, v, beta, state, log_decay),
                  lambda call, k, v, beta, state, log_decay: _run(rule, k, k, v, beta, state, log_decay)[1],
                  step_, unfit)


SUM, DELTA = _kernel("sum"), _kernel("delta")
GATED_SUM = _kernel("gated-sum", _gated_chunk_backward_refused)
GATED_DELTA = _kernel("gated-delta", _gated_delta_unfit)

# -- the rules with a decay per key channel (rules/channels.py) --------------------------------------

CHANNEL_RULES = ("gla", "kda", "gdn2")


def _channel_unfit(name, forward_only_recurrent):
    """Why fla cannot run a call of rule `name`: this fla lacks its kernels, or (KDA, GDN-2) its recurrent
    kernel, forward only, would have to give gradients."""
    def unfit(call):
        try:
            channel_kernels()
        except BackendUnavailableError as err:
            return str(err)
        if forward_only_recurrent and call.needs_grad and kernel_form(call.dtype, call.T) == "recurrent":
            return f"fla's recurrent {name} (float32, or one step) has no backward pass"
        return None
    return unfit


GLA = _kernel("gla", _channel_unfit("GLA", False))
KDA = _kernel("kda", _channel_unfit("KDA", True))
GDN2 = _kernel("gdn2", _channel_unfit("GDN-2", True))


def _no_recurrent_product(call):
    if kernel_form(call.dtype, call.T) == "recurrent":
        return "fla has DeltaProduct's chunkwise kernel only (float16/bfloat16 over several steps)"
    return None


def _run_product(q, k, v, beta, state, log_decay):
    """fla's chunk_gated_delta_product: k, v, beta with N writes per token ``[B, H, T, N, ...]``, interleaved
    along fla's time axis; the decay (None: none) once per token."""
    B, H, T, N, _ = k.shape
    kernel = product_kernel()
    to_fla = lambda x: x.transpose(1, 2)  # noqa: E731
    interleaved = lambda x: to_fla(x.flatten(2, 3))  # noqa: E731  [B, H, T, N, ...] -> [B, T * N, H, ...]
    g = None if log_decay is None else to_fla(log_decay.clamp_min(LOG_FULL_FORGET))
    initial = _initial_state(state, [x for x in (q, k, v, beta, log_decay) if x is not None])
    out, final = kernel(to_fla(q), interleaved(k), interleaved(v), g, interleaved(beta), num_householder=N, scale=1.0,
                        initial_state=initial, output_final_state=True)
    return to_fla(out), final.transpose(-1, -2)


@functools.lru_cache(maxsize=None)
def product_kernel():
    try:
        kernel = importlib.import_module("fla.ops.gated_delta_product").chunk_gated_delta_product
    except ImportError as err:
        raise BackendUnavailableError(f"fla has no DeltaProduct kernel here ({err}): pip install fla-core>=0.6") from err
    fla_configs.preload()
    return kernel


def _product_unfit(call):
    reason = _no_recurrent_product(call)
    if reason is None:
        try:
            product_kernel()
        except BackendUnavailableError as err:
            return str(err)
    return reason


def _gated_product_unfit(call):
    return _product_unfit(call) or _gated_chunk_backward_refused(call)


def _product_kernel(unfit):
    """The recurrent forms (float32, decoding steps) fall to chunked: the rule's own step decodes."""
    return Kernel(
        lambda call, q, k, v, beta, state, log_decay: _run_product(q, k, v, beta, state, log_decay),
        lambda call, k, v, beta, state, log_decay: _run_product(k[:, :, :, 0], k, v, beta, state, log_decay)[1],
        unfit_reason=unfit)


DELTA_PRODUCT, GATED_DELTA_PRODUCT = _product_kernel(_product_unfit), _product_kernel(_gated_product_unfit)

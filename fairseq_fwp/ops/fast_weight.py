"""The two public fast-weight ops and the choice of backend.

Both ops take already feature-mapped queries and keys and apply no
normalisation: see SPEC.md and the paper's Eqs. 17/11 (sum) and 20/24/25
(delta). Half-precision inputs are computed in float32 (the cuda and fla
kernels read them as they are and accumulate in float32) and the output is
returned in the input dtype; the returned state stays in the accumulation
dtype (float32, or float64 for float64 inputs) so that carried state does
not lose precision from one segment to the next. Inputs of mixed floating
dtypes (float32 features beside float16 values, as autocast makes them) are
computed as if all had the widest of them, and under autocast as if all had
the autocast dtype; that is also the output's dtype (_compute_dtype).
"""
import torch

from . import chunked, cuda, fla, reference
from .decay import run_with_decay
from .errors import BackendUnavailableError
from .validation import check_inputs

BACKENDS = ("auto", "reference", "chunked", "cuda", "fla")

# (sum rule, delta rule) of each backend. reference and chunked compute in
# the accumulation dtype; cuda and fla read half types themselves.
_IMPLEMENTATIONS = {
    "reference": (reference.fast_weight_sum_reference, reference.fast_weight_delta_reference),
    "chunked": (chunked.fast_weight_sum_chunked, chunked.fast_weight_delta_chunked),
    "cuda": (cuda.fast_weight_sum_kernel, cuda.fast_weight_delta_kernel),
    "fla": (fla.fast_weight_sum_fla, fla.fast_weight_delta_fla),
}

# Final state only: (sum rule, delta rule) of each backend.
_STATE_IMPLEMENTATIONS = {
    "reference": (reference.fast_weight_sum_state_reference, reference.fast_weight_delta_state_reference),
    "chunked": (chunked.fast_weight_sum_state_chunked, chunked.fast_weight_delta_state_chunked),
    "cuda": (cuda.fast_weight_sum_state_kernel, cuda.fast_weight_delta_state_kernel),
    "fla": (fla.fast_weight_sum_state_fla, fla.fast_weight_delta_state_fla),
}
_READS_HALF_TYPES = ("cuda", "fla")


def resolve_backend(backend, q, Dv, gated=None):
    """Map a backend name (possibly "auto") to the one that runs on q (values of size Dv).

    gated: None for the paper's rules, else fla.GatedUse (the gated rules' needs).
    """
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend == "auto":
        # Only what has been run and verified on q's kind of device: fla's
        # kernels on GPUs (where they fit), the pure-torch chunked form
        # everywhere. The csrc kernels join once the GPU check
        # (scripts/gpu_check.sh) has passed on a GPU.
        return "fla" if fla.kernels_usable(q, gated) else "chunked"
    if backend == "cuda" and gated is not None:
        raise BackendUnavailableError("backend 'cuda' has no gated rules (decay); use 'chunked', 'fla' or 'auto'")
    if backend == "cuda":
        if not q.is_cuda:
            raise BackendUnavailableError(
                f"backend 'cuda' runs on CUDA tensors, but q is on {q.device}; "
                "use backend='chunked' (or 'auto') on the CPU")
        cuda.load_extension()  # raises, saying what is missing
        return "cuda" if cuda.kernels_usable(q, Dv) else "chunked"  # kernels_usable warns
    if backend == "fla":
        fla.check_usable(q, gated)  # raises, saying why
    return backend


def accumulation_dtype(dtype):
    """float64 stays float64; everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _compute_dtype(tensors):
    """The dtype the inputs are computed in.

    Under autocast the ops act like a matmul: float32 and half inputs are
    taken in the autocast dtype (float64 opts out, as in torch); otherwise
    mixed floating inputs (float32 features beside float16 values) are
    computed in the widest of their dtypes. Either way the kernels
    accumulate in float32 and the output has this dtype.
    """
    device_type = tensors[0].device.type
    dtypes = [x.dtype for x in tensors if x is not None]
    if torch.is_autocast_enabled(device_type) and torch.float64 not in dtypes:
        return torch.get_autocast_dtype(device_type)
    dtype = dtypes[0]
    for other in dtypes[1:]:
        dtype = torch.promote_types(dtype, other)
    return dtype


def _prepare(q, k, v, beta, state, log_decay, backend):
    """Picks the backend. Returns (backend, [q, k, v, beta] in the dtype it computes in, the state and
    log_decay in the accumulation dtype (or None), the output dtype)."""
    dtype = _compute_dtype([q, k, v, beta])
    gated = None
    if log_decay is not None:
        needs_grad = torch.is_grad_enabled() and any(
            x is not None and x.requires_grad for x in (q, k, v, beta, state, log_decay))
        gated = fla.GatedUse(delta=beta is not None, needs_grad=needs_grad)
    name = resolve_backend(backend, q.to(dtype), v.shape[-1], gated)
    acc = accumulation_dtype(dtype)
    computed = dtype if name in _READS_HALF_TYPES else acc
    inputs = [None if x is None else x.to(dtype).to(computed) for x in (q, k, v, beta)]
    state, log_decay = (None if x is None else x.to(acc) for x in (state, log_decay))
    return name, inputs, state, log_decay, dtype


def _zero_state(k, v, dtype):
    return k.new_zeros(*k.shape[:2], v.shape[-1], k.shape[-1], dtype=accumulation_dtype(dtype))


def _gated(log_decay, name):
    """The gate as a keyword for the backends: the reference loops multiply by a_t itself, the others
    take its log; nothing for the paper's rules."""
    if log_decay is None:
        return {}
    return {"decay": log_decay.exp()} if name == "reference" else {"log_decay": log_decay}


def _run(rule_index, q, k, v, beta, state, log_decay, backend):
    name, (q, k, v, beta), state, log_decay, dtype = _prepare(q, k, v, beta, state, log_decay, backend)
    if q.shape[2] == 0:
        return v.new_zeros(v.shape, dtype=dtype), _zero_state(k, v, dtype) if state is None else state
    betas = () if beta is None else (beta,)
    with torch.autocast(q.device.type, enabled=False):  # the backends choose their own precision
        out, W = _IMPLEMENTATIONS[name][rule_index](q, k, v, *betas, state, **_gated(log_decay, name))
    return out.to(dtype), W


def _run_state(rule_index, q, k, v, beta, state, log_decay, backend):
    """As _run, the final state only (q is not read)."""
    name, (_, k, v, beta), state, log_decay, dtype = _prepare(k, k, v, beta, state, log_decay, backend)
    if k.shape[2] == 0:
        return _zero_state(k, v, dtype) if state is None else state
    betas = () if beta is None else (beta,)
    with torch.autocast(k.device.type, enabled=False):
        return _STATE_IMPLEMENTATIONS[name][rule_index](k, v, *betas, state, **_gated(log_decay, name))


def _checked_call(run, rule_index, q, k, v, beta, state, decay, log_decay, backend):
    """Checks the inputs, then run(...) with the gate as its log (decay.py: exact gradients at a = 0)."""
    check_inputs(q, k, v, beta, state, decay, log_decay)
    if decay is None:
        return run(rule_index, q, k, v, beta, state, log_decay, backend)
    decay = decay.to(accumulation_dtype(_compute_dtype([q, k, v, beta])))
    return run_with_decay(lambda log, *tensors: run(rule_index, *tensors, log, backend), decay, (q, k, v, beta, state))


def fast_weight_sum_state(k, v, state=None, *, decay=None, log_decay=None, backend="auto"):
    """The sum rule's final fast weight alone (Eq. 17): W_T = W_0 + sum_t v_t k_t^T.

    For memories that are written first and read later (the paper's
    synthetic retrieval, or a prompt carried into decoding): no per-step
    outputs are computed. Arguments and gradients as fast_weight_sum.
    """
    return _checked_call(_run_state, 0, k, k, v, None, state, decay, log_decay, backend)


def fast_weight_delta_state(k, v, beta, state=None, *, decay=None, log_decay=None, backend="auto"):
    """The delta rule's final fast weight alone (Eqs. 20, 24); see fast_weight_sum_state."""
    return _checked_call(_run_state, 1, k, k, v, beta, state, decay, log_decay, backend)


def fast_weight_sum(q, k, v, state=None, *, decay=None, log_decay=None, backend="auto"):
    """Sum-rule fast weights (Eq. 17, Eq. 11).

    W_t = W_{t-1} + v_t k_t^T;  out_t = W_t q_t.
    With ``decay`` ``[B, H, T]`` (a_t in [0, 1]; 0 is a full forget): W_t = a_t W_{t-1} + v_t k_t^T
    (the gated sum rule); None means 1 everywhere, the paper's rule.

    Args:
        q, k: ``[B, H, T, D]`` feature-mapped queries and keys.
        v: ``[B, H, T, Dv]`` values.
        state: initial fast weight W ``[B, H, Dv, D]``, or None for zeros.
        decay: ``[B, H, T]`` in [0, 1] (0: a full forget), or None.
        log_decay: the same as its log, ``[B, H, T]`` in [-inf, 0] (what gates produce); give one of the two.
        backend: one of ``BACKENDS``.
    Returns:
        ``(out [B, H, T, Dv], W_T [B, H, Dv, D])``. Gradients flow to q, k, v,
        the decay (or its log) and the initial state, exactly also where a_t = 0 (decay.py).

    Activation memory kept for backward: ``reference`` one ``Dv x D`` state per
    step (testing only); ``chunked`` only the inputs; ``cuda`` the inputs and
    one ``Dv x D`` state per 16 steps.
    """
    return _checked_call(_run, 0, q, k, v, None, state, decay, log_decay, backend)


def fast_weight_delta(q, k, v, beta, state=None, *, decay=None, log_decay=None, backend="auto"):
    """Delta-rule fast weights (Eqs. 20, 24, 25).

    vbar_t = W_{t-1} k_t;  W_t = W_{t-1} + beta_t (v_t - vbar_t) k_t^T;
    out_t = W_t q_t.
    With ``decay`` (the gated delta rule, Gated DeltaNet): vbar_t = a_t W_{t-1} k_t
    and W_t = a_t W_{t-1} + beta_t (v_t - vbar_t) k_t^T.

    Args:
        q, k: ``[B, H, T, D]`` feature-mapped queries and keys.
        v: ``[B, H, T, Dv]`` values.
        beta: ``[B, H, T]`` write strengths in (0, 1).
        state: initial fast weight W ``[B, H, Dv, D]``, or None for zeros.
        decay, log_decay: as in fast_weight_sum.
        backend: one of ``BACKENDS``.
    Returns:
        ``(out [B, H, T, Dv], W_T [B, H, Dv, D])``. Gradients flow to q, k, v,
        beta, the decay (or its log) and the initial state.

    The recurrence is stable when ``beta_t * |k_t|^2 <= 2`` (e.g. sum-normalised
    non-negative keys, as the paper uses).

    Activation memory kept for backward: ``reference`` one ``Dv x D`` state per
    step (testing only); ``chunked`` the inputs, one ``D x Dv`` state per chunk
    of C tokens (C = 32 for D <= 32, else 64), three ``C x C`` matrices per
    chunk, and two tensors the size of k and v (the WY factors); ``cuda`` the
    inputs, one ``Dv x D`` state per 16 steps and the pseudo-values
    ``beta_t (v_t - vbar_t)`` (the size of v).
    """
    return _checked_call(_run, 1, q, k, v, beta, state, decay, log_decay, backend)

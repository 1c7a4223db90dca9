"""The two public fast-weight ops and the choice of backend.

Both ops take already feature-mapped queries and keys and apply no
normalisation: see SPEC.md and the paper's Eqs. 17/11 (sum) and 20/24/25
(delta). Half-precision inputs are computed in float32 (the CUDA kernels read
them as they are and accumulate in float32) and the output is returned in the
input dtype; the returned state stays in the accumulation
dtype (float32, or float64 for float64 inputs) so that carried state does
not lose precision from one segment to the next.
"""
import torch

from . import chunked, cuda, reference
from .errors import BackendUnavailableError
from .validation import check_inputs

BACKENDS = ("auto", "reference", "chunked", "cuda")

# (sum rule, delta rule) of each backend. reference and chunked compute in
# the accumulation dtype; cuda reads half types itself.
_IMPLEMENTATIONS = {
    "reference": (reference.fast_weight_sum_reference, reference.fast_weight_delta_reference),
    "chunked": (chunked.fast_weight_sum_chunked, chunked.fast_weight_delta_chunked),
    "cuda": (cuda.fast_weight_sum_kernel, cuda.fast_weight_delta_kernel),
}


# Final state only: (sum rule, delta rule) of each backend.
_STATE_IMPLEMENTATIONS = {
    "reference": (reference.fast_weight_sum_state_reference, reference.fast_weight_delta_state_reference),
    "chunked": (chunked.fast_weight_sum_state_chunked, chunked.fast_weight_delta_state_chunked),
    "cuda": (cuda.fast_weight_sum_state_kernel, cuda.fast_weight_delta_state_kernel),
}


def resolve_backend(backend, q):
    """Map a backend name (possibly "auto") to the one that runs on q."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend == "cuda":
        if not q.is_cuda:
            raise BackendUnavailableError(
                f"backend 'cuda' runs on CUDA tensors, but q is on {q.device}; "
                "use backend='chunked' (or 'auto') on the CPU")
        cuda.load_extension()  # raises, saying what is missing
        return backend
    if backend == "auto":
        # On GPUs the kernels (one launch per pass, no per-chunk Python loop);
        # elsewhere, or where they cannot run, the chunkwise form.
        return "cuda" if cuda.kernels_usable(q) else "chunked"
    return backend


def accumulation_dtype(dtype):
    """float64 stays float64; everything else accumulates in float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _run(rule_index, q, k, v, beta, state, backend):
    B, H, T, D, Dv = check_inputs(q, k, v, beta, state)
    name = resolve_backend(backend, q)
    acc = accumulation_dtype(q.dtype)
    state = None if state is None else state.to(acc)  # None: zeros, which backends can skip
    if T == 0:
        return q.new_zeros(B, H, 0, Dv), q.new_zeros(B, H, Dv, D, dtype=acc) if state is None else state
    betas = () if beta is None else (beta,)
    if name == "cuda":
        out, W = _IMPLEMENTATIONS[name][rule_index](q, k, v, *betas, state)
    else:
        out, W = _IMPLEMENTATIONS[name][rule_index](*[x.to(acc) for x in (q, k, v) + betas], state)
    return out.to(q.dtype), W


def _run_state(rule_index, k, v, beta, state, backend):
    B, H, T, D, Dv = check_inputs(k, k, v, beta, state)
    name = resolve_backend(backend, k)
    acc = accumulation_dtype(k.dtype)
    state = None if state is None else state.to(acc)
    if T == 0:
        return k.new_zeros(B, H, Dv, D, dtype=acc) if state is None else state
    tensors = (k, v) + (() if beta is None else (beta,))
    if name != "cuda":
        tensors = [x.to(acc) for x in tensors]
    return _STATE_IMPLEMENTATIONS[name][rule_index](*tensors, state)


def fast_weight_sum_state(k, v, state=None, *, backend="auto"):
    """The sum rule's final fast weight alone (Eq. 17): W_T = W_0 + sum_t v_t k_t^T.

    For memories that are written first and read later (the paper's
    synthetic retrieval, or a prompt carried into decoding): no per-step
    outputs are computed. Arguments and gradients as fast_weight_sum.
    """
    return _run_state(0, k, v, None, state, backend)


def fast_weight_delta_state(k, v, beta, state=None, *, backend="auto"):
    """The delta rule's final fast weight alone (Eqs. 20, 24); see fast_weight_sum_state."""
    return _run_state(1, k, v, beta, state, backend)


def fast_weight_sum(q, k, v, state=None, *, backend="auto"):
    """Sum-rule fast weights (Eq. 17, Eq. 11).

    W_t = W_{t-1} + v_t k_t^T;  out_t = W_t q_t.

    Args:
        q, k: ``[B, H, T, D]`` feature-mapped queries and keys.
        v: ``[B, H, T, Dv]`` values.
        state: initial fast weight W ``[B, H, Dv, D]``, or None for zeros.
        backend: one of ``BACKENDS``.
    Returns:
        ``(out [B, H, T, Dv], W_T [B, H, Dv, D])``. Gradients flow to q, k, v
        and the initial state.

    Activation memory kept for backward: ``reference`` one ``Dv x D`` state per
    step (testing only); ``chunked`` only the inputs; ``cuda`` the inputs and
    one ``Dv x D`` state per 16 steps.
    """
    return _run(0, q, k, v, None, state, backend)


def fast_weight_delta(q, k, v, beta, state=None, *, backend="auto"):
    """Delta-rule fast weights (Eqs. 20, 24, 25).

    vbar_t = W_{t-1} k_t;  W_t = W_{t-1} + beta_t (v_t - vbar_t) k_t^T;
    out_t = W_t q_t.

    Args:
        q, k: ``[B, H, T, D]`` feature-mapped queries and keys.
        v: ``[B, H, T, Dv]`` values.
        beta: ``[B, H, T]`` write strengths in (0, 1).
        state: initial fast weight W ``[B, H, Dv, D]``, or None for zeros.
        backend: one of ``BACKENDS``.
    Returns:
        ``(out [B, H, T, Dv], W_T [B, H, Dv, D])``. Gradients flow to q, k, v,
        beta and the initial state.

    The recurrence is stable when ``beta_t * |k_t|^2 <= 2`` (e.g. sum-normalised
    non-negative keys, as the paper uses).

    Activation memory kept for backward: ``reference`` one ``Dv x D`` state per
    step (testing only); ``chunked`` the inputs, one ``D x Dv`` state per chunk
    of C tokens (C = 32 for D <= 32, else 64), three ``C x C`` matrices per
    chunk, and two tensors the size of k and v (the WY factors); ``cuda`` the
    inputs, one ``Dv x D`` state per 16 steps and the pseudo-values
    ``beta_t (v_t - vbar_t)`` (the size of v).
    """
    return _run(1, q, k, v, beta, state, backend)

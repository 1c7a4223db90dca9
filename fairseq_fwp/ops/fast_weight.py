"""The two public fast-weight ops and the choice of backend.

Both ops take already feature-mapped queries and keys and apply no
normalisation: see SPEC.md and the paper's Eqs. 17/11 (sum) and 20/24/25
(delta). Half-precision inputs are computed in float32 and the output is
returned in the input dtype; the returned state stays in the accumulation
dtype (float32, or float64 for float64 inputs) so that carried state does
not lose precision from one segment to the next.
"""
import torch

from . import chunked, reference
from .validation import check_inputs

BACKENDS = ("auto", "reference", "chunked", "cuda")


class BackendUnavailableError(RuntimeError):
    """A backend was requested that cannot run in this installation."""


_IMPLEMENTATIONS = {
    "reference": (reference.fast_weight_sum_reference, reference.fast_weight_delta_reference),
    "chunked": (chunked.fast_weight_sum_chunked, chunked.fast_weight_delta_chunked),
}


def resolve_backend(backend, device):
    """Map a backend name (possibly "auto") to an implemented one."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {', '.join(BACKENDS)}; got {backend!r}")
    if backend == "cuda":
        raise BackendUnavailableError(
            "backend 'cuda' is not available: the csrc/ CUDA kernels are not part of this "
            "build of fairseq-fwp yet; use backend='chunked' (works on CPU and CUDA tensors)"
        )
    if backend == "auto":
        # The chunkwise form is the fastest path we have on every device; the
        # reference loop is for testing only.
        return "chunked"
    return backend


def _accumulation_dtype(dtype):
    return torch.float64 if dtype == torch.float64 else torch.float32


def _run(rule_index, q, k, v, beta, state, backend):
    B, H, T, D, Dv = check_inputs(q, k, v, beta, state)
    name = resolve_backend(backend, q.device)
    acc = _accumulation_dtype(q.dtype)
    if state is None:
        state = q.new_zeros(B, H, Dv, D, dtype=acc)
    else:
        state = state.to(acc)
    if T == 0:
        return q.new_zeros(B, H, 0, Dv), state
    tensors = [x.to(acc) for x in (q, k, v) + (() if beta is None else (beta,))]
    out, W = _IMPLEMENTATIONS[name][rule_index](*tensors, state)
    return out.to(q.dtype), W


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
    step (testing only); ``chunked`` only the inputs.
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
    of C tokens (C = 32 for D <= 32, else 64), two ``C x C`` matrices per
    chunk, and two tensors the size of k and v (the WY factors).
    """
    return _run(1, q, k, v, beta, state, backend)

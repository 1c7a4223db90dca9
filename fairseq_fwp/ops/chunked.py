"""Chunkwise-parallel fast-weight algorithms with hand-written backward passes.

The sequence is cut into chunks of C tokens. Inside a chunk everything is a
dense matrix product; across chunks only the fast weight is carried. The
derivation is in ``ops/README.md``; the code below uses the row convention
``S = W^T`` (``[D, Dv]``) so that ``out_t^T = q_t^T S_t``.

Activation memory kept for backward (per batch row and head):
- sum rule: the inputs only (q, k, v and the initial state); chunk states are
  recomputed by one cumulative sum in the backward pass.
- delta rule: the inputs, one ``D x Dv`` state per chunk (``ceil(T/C)`` of
  them), three ``C x C`` matrices per chunk (the inverse of the triangular
  system, ``tril(Q K^T)`` and ``K K^T``: ``T x C`` numbers each) and the WY
  factors ``Wk`` and ``U`` (the size of k and v). No per-time-step fast
  weight is ever stored.
"""
import torch

from .chunked_gated import gated_chunked
from .chunking import DEFAULT_CHUNK_SIZE, default_chunk_size, from_chunks, to_chunks  # noqa: F401
from .errors import refuse_a_second_derivative
from .protocol import Backend, Kernel


def _t(x):
    return x.transpose(-1, -2)


def _add_matmul_(acc, a, b):
    """acc += a @ b in place, batched over all leading dims.

    Fewer fresh temporaries matter on CPU, where every new large tensor pays
    for its page faults.
    """
    flat = lambda x: x.reshape(-1, *x.shape[-2:])  # noqa: E731 (views: leading dims are contiguous)
    flat(acc).baddbmm_(flat(a), flat(b))  # acc is contiguous: flat(acc) is a view
    return acc


def _chunk_starts(S0, S_end):
    """States at the start of every chunk, [B, H, N, D, Dv], from those at their ends.

    None when they are all zero (one chunk from a zero state), so that callers
    skip the D x Dv work: a short decoder sentence needs none of it.
    """
    if S0 is None and S_end.shape[2] == 1:
        return None
    first = S_end.new_zeros(S_end[:, :, :1].shape) if S0 is None else S0.unsqueeze(2)
    return torch.cat([first, S_end[:, :, :-1]], 2)


class _SumRuleChunked(torch.autograd.Function):
    """Sum rule, Eq. 17 + Eq. 11, fully parallel over chunks.

    S0 = None means a zero initial state; an unused final state gets no
    gradient (None): both skip their D x Dv products.
    """

    @staticmethod
    def forward(ctx, q, k, v, S0, chunk):
        ctx.set_materialize_grads(False)
        T = q.shape[2]
        Q, K, V = (to_chunks(x, chunk) for x in (q, k, v))
        S_end = _sum_chunk_ends(K, V, S0)
        S_start = _chunk_starts(S0, S_end)
        A = (Q @ _t(K)).tril()  # inclusive: out_t reads W_t, which has step t
        out = A @ V
        if S_start is not None:
            _add_matmul_(out, Q, S_start)
        ctx.save_for_backward(q, k, v, S0)
        ctx.chunk = chunk
        return from_chunks(out, T), S_end[:, :, -1]

    @staticmethod
    def backward(ctx, d_out, dS_final):
        refuse_a_second_derivative("chunked")
        q, k, v, S0 = ctx.saved_tensors
        chunk, T = ctx.chunk, q.shape[2]
        d_out = torch.zeros_like(v) if d_out is None else d_out
        Q, K, V, dO = (to_chunks(x, chunk) for x in (q, k, v, d_out))
        S_start = _chunk_starts(S0, _sum_chunk_ends(K, V, S0))
        # Gradient reaching the state at the end of chunk n: every later
        # chunk's queries read it (Q_m^T dO_m) and so does the final state.
        qdo = _t(Q) @ dO if Q.shape[2] > 1 or ctx.needs_input_grad[3] else None
        dS_end = None
        if Q.shape[2] > 1:  # the sums over m > n, shifted (not the sums over m >= n less Q_n^T dO_n: rounding)
            later = qdo[:, :, 1:].flip(2).cumsum(2).flip(2)
            dS_end = torch.cat([later, torch.zeros_like(qdo[:, :, :1])], 2)
        if dS_final is not None:
            dS_end = dS_final.unsqueeze(2) if dS_end is None else dS_end + dS_final.unsqueeze(2)
        dA = (dO @ _t(V)).tril()
        dq = dA @ K
        dk = _t(dA) @ Q
        dv = _t((Q @ _t(K)).tril()) @ dO
        if S_start is not None:
            _add_matmul_(dq, dO, _t(S_start))
        if dS_end is not None:
            dk = dk + V @ _t(dS_end)  # dS_end may broadcast over chunks
            dv = dv + K @ dS_end
        dS0 = None
        if ctx.needs_input_grad[3]:
            dS0 = qdo.sum(2) if dS_final is None else dS_final + qdo.sum(2)
        return (from_chunks(dq, T), from_chunks(dk, T), from_chunks(dv, T), dS0, None)


def _sum_chunk_ends(K, V, S0):
    """States at the end of every chunk, [B, H, N, D, Dv]."""
    S_end = (_t(K) @ V).cumsum(2)
    return S_end if S0 is None else S_end + S0.unsqueeze(2)


def _delta_chunk_factors(K, V, beta):
    """The WY/UT factors of each chunk (see ops/README.md).

    Within a chunk the delta rule writes S_end = S0 + K^T U with pseudo-values
    U = Uv - Wk S0, where [Wk | Uv] solves the unit lower-triangular system
    (I + strictly_lower(diag(beta) K K^T)) [Wk | Uv] = diag(beta) [K | V].
    Returns (Tinv, Wk, Uv, KKt) with Tinv the inverse of that system's matrix
    and KKt = K K^T, which the backward needs again.
    """
    KKt = K @ _t(K)
    M = (KKt * beta.unsqueeze(-1)).tril_(-1)
    M.diagonal(dim1=-2, dim2=-1).fill_(1)
    eye = torch.eye(K.shape[-2], dtype=K.dtype, device=K.device).expand_as(M)
    Tinv = torch.linalg.solve_triangular(M, eye, upper=False, unitriangular=True)
    return Tinv, Tinv @ (K * beta.unsqueeze(-1)), Tinv @ (V * beta.unsqueeze(-1)), KKt


class _DeltaRuleChunked(torch.autograd.Function):
    """Delta rule, Eqs. 20, 24, 25, with T/C sequential steps.

    S0 = None means a zero initial state; an unused final state gets no
    gradient (None). A single chunk from a zero state then needs no D x Dv
    work but its final state.
    """

    @staticmethod
    def forward(ctx, q, k, v, beta, S0, chunk):
        ctx.set_materialize_grads(False)
        T = q.shape[2]
        Q, K, V = (to_chunks(x, chunk) for x in (q, k, v))
        b = to_chunks(beta.unsqueeze(-1), chunk).squeeze(-1)
        Tinv, Wk, Uv, KKt = _delta_chunk_factors(K, V, b)
        # Only the chunk-start states are sequential: S_{n+1} = S_n + K_n^T U_n.
        S, ends, U = S0, [], torch.empty_like(Uv)
        for n in range(Q.shape[2]):
            if S is None:  # U = Uv - Wk S with S = 0
                U[:, :, n] = Uv[:, :, n]
                S = _t(K[:, :, n]) @ U[:, :, n]
            else:
                torch.sub(Uv[:, :, n], Wk[:, :, n] @ S, out=U[:, :, n])
                S = S + _t(K[:, :, n]) @ U[:, :, n]
            ends.append(S)
        S_start = _chunk_starts(S0, torch.stack(ends, 2))
        A = (Q @ _t(K)).tril_()  # inclusive: out_t reads W_t, which has step t
        out = A @ U
        if S_start is not None:
            _add_matmul_(out, Q, S_start)
        ctx.save_for_backward(q, k, v, beta, S_start, Tinv, Wk, U, A, KKt)
        ctx.chunk = chunk
        return from_chunks(out, T), S

    @staticmethod
    def backward(ctx, d_out, dS_final):
        refuse_a_second_derivative("chunked")
        q, k, v, beta, S_start, Tinv, Wk, U, A, KKt = ctx.saved_tensors
        chunk, T = ctx.chunk, q.shape[2]
        d_out = torch.zeros_like(v) if d_out is None else d_out
        Q, K, V, dO = (to_chunks(x, chunk) for x in (q, k, v, d_out))
        b = to_chunks(beta.unsqueeze(-1), chunk).squeeze(-1).unsqueeze(-1)

        # Reverse sweep over chunks: the only sequential part of the backward.
        # dU_n = A_n^T dO_n + K_n dS_{n+1};  dS_n = dS_{n+1} + Q_n^T dO_n - Wk_n^T dU_n
        dU = _t(A) @ dO
        dS_end, dS = None, None
        if Q.shape[2] > 1 or dS_final is not None or ctx.needs_input_grad[4]:
            QtdO = _t(Q) @ dO
            dS_end = U.new_empty(*Q.shape[:3], Q.shape[-1], U.shape[-1])
            dS = torch.zeros_like(dS_end[:, :, 0]) if dS_final is None else dS_final
            for n in reversed(range(Q.shape[2])):
                dS_end[:, :, n] = dS
                dU[:, :, n] += K[:, :, n] @ dS
                dS = dS + QtdO[:, :, n] - _t(Wk[:, :, n]) @ dU[:, :, n]

        dA = (dO @ _t(U)).tril_()
        dQ = dA @ K
        # Through the solve [Wk | Uv] = M^-1 diag(b) [K | V]. With dWk = -dU S^T
        # the right-hand-side gradients are dR_v = M^-T dU and dR_k = -dR_v S^T,
        # and dM = -(dR_k Wk^T + dR_v Uv^T) = -dR_v U^T (strictly lower part).
        dR_v = _t(Tinv) @ dU
        dM = (dR_v @ _t(U)).tril_(-1).neg_()
        P = dM * b  # M = I + strictly_lower(diag(b) K K^T): d(K K^T) = diag(b) dM
        dK = _t(dA) @ Q
        if dS_end is not None:
            _add_matmul_(dK, U, _t(dS_end))
        _add_matmul_(dK, P + _t(P), K)
        db = dM.mul_(KKt).sum(-1)
        db += (dR_v * V).sum(-1)
        if S_start is not None:  # the terms through S_start (zero for a lone chunk from zero)
            _add_matmul_(dQ, dO, _t(S_start))
            neg_dR_k = dR_v @ _t(S_start)
            dK.addcmul_(b, neg_dR_k, value=-1)
            db -= (neg_dR_k * K).sum(-1)
        dV = dR_v.mul_(b)
        db = db.reshape(*db.shape[:2], -1)[:, :, :T]
        dS0 = dS if ctx.needs_input_grad[4] else None
        return (from_chunks(dQ, T), from_chunks(dK, T), from_chunks(dV, T), db, dS0, None)


def fast_weight_sum_chunked(q, k, v, state, chunk_size=None):
    """Sum rule; ``state`` is W ``[B, H, Dv, D]``, or None for zeros."""
    chunk = min(chunk_size or default_chunk_size(q.shape[-1]), q.shape[2])
    out, S = _SumRuleChunked.apply(q, k, v, None if state is None else _t(state), chunk)
    return out, _t(S)


def fast_weight_delta_chunked(q, k, v, beta, state, chunk_size=None):
    """Delta rule; ``state`` is W ``[B, H, Dv, D]``, or None for zeros."""
    chunk = min(chunk_size or default_chunk_size(q.shape[-1]), q.shape[2])
    out, S = _DeltaRuleChunked.apply(q, k, v, beta, None if state is None else _t(state), chunk)
    return out, _t(S)


def fast_weight_sum_state_chunked(k, v, state):
    """Sum rule, final fast weight only: W_T = W_0 + V^T K, one product (autograd)."""
    W = v.transpose(-1, -2) @ k
    return W if state is None else state + W


def fast_weight_delta_state_chunked(k, v, beta, state, chunk_size=None):
    """Delta rule, final fast weight only: the WY recurrence over chunks, no outputs (autograd).

    Keeps per chunk what autograd needs of the factors; no per-step state.
    """
    chunk = min(chunk_size or default_chunk_size(k.shape[-1]), k.shape[2])
    K, V = to_chunks(k, chunk), to_chunks(v, chunk)
    _, Wk, Uv, _ = _delta_chunk_factors(K, V, to_chunks(beta.unsqueeze(-1), chunk).squeeze(-1))
    S = None if state is None else _t(state)
    for n in range(K.shape[2]):
        U = Uv[:, :, n] if S is None else Uv[:, :, n] - Wk[:, :, n] @ S
        S = _t(K[:, :, n]) @ U if S is None else S + _t(K[:, :, n]) @ U
    return _t(S)


# -- the kernels of the built-in rules (rules/sum.py, rules/delta.py); decoding: the rules' own steps --

BACKEND = Backend("chunked", reads_half_types=False)  # pure torch: any device and dtype
SUM = Kernel(lambda call, q, k, v, beta, state, log_decay: fast_weight_sum_chunked(q, k, v, state),
             lambda call, k, v, beta, state, log_decay: fast_weight_sum_state_chunked(k, v, state))
DELTA = Kernel(lambda call, q, k, v, beta, state, log_decay: fast_weight_delta_chunked(q, k, v, beta, state),
               lambda call, k, v, beta, state, log_decay: fast_weight_delta_state_chunked(k, v, beta, state))
# The gated rules' final state: the outputs are computed and dropped.
GATED_SUM = Kernel(lambda call, q, k, v, beta, state, log_decay: gated_chunked(q, k, v, None, log_decay, state),
                   lambda call, k, v, beta, state, log_decay: gated_chunked(k, k, v, None, log_decay, state)[1])
GATED_DELTA = Kernel(lambda call, q, k, v, beta, state, log_decay: gated_chunked(q, k, v, beta, log_decay, state),
                     lambda call, k, v, beta, state, log_decay: gated_chunked(k, k, v, beta, log_decay, state)[1])


def _interleaved(q, k, v, beta, log_decay):
    """DeltaProduct's N writes per token as one sequence N times as long: the token's keys, values and
    strengths in order, its query at its last write (zero queries elsewhere), its decay at its first."""
    B, H, T, N, D = k.shape
    zeros = q.new_zeros(B, H, T, N - 1, D)
    queries = torch.cat([zeros, q.unsqueeze(3)], dim=3).flatten(2, 3)
    if log_decay is not None:  # [B, H, T] or, per key channel, [B, H, T, D]
        log_decay = torch.cat([log_decay.unsqueeze(3), log_decay.new_zeros(B, H, T, N - 1, *log_decay.shape[3:])],
                              dim=3).flatten(2, 3)
    return queries, k.flatten(2, 3), v.flatten(2, 3), beta.flatten(2, 3), log_decay


def product(kernel):
    """The kernel of a rule with N writes per token (k ``[B, H, T, N, D]``, v ``[B, H, T, N, Dv]``, beta
    ``[B, H, T, N]``) from the kernel of its one-write form, run over the interleaved sequence; the outputs
    are those of each token's last write."""
    def sequence(call, q, k, v, beta, state, log_decay):
        queries, keys, values, strengths, log_decay = _interleaved(q, k, v, beta, log_decay)
        out, W = kernel.sequence(call, queries, keys, values, strengths, state, log_decay)
        return out.unflatten(2, (q.shape[2], k.shape[3]))[:, :, :, -1], W

    def final_state(call, k, v, beta, state, log_decay):
        _, keys, values, strengths, log_decay = _interleaved(k[:, :, :, 0], k, v, beta, log_decay)
        return kernel.final_state(call, keys, values, strengths, state, log_decay)

    return Kernel(sequence, final_state)

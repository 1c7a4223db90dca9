"""Chunkwise-parallel fast-weight algorithms with hand-written backward passes.

The sequence is cut into chunks of C tokens. Inside a chunk everything is a
dense matrix product; across chunks only the fast weight is carried. The
derivation is in ``ops/README.md``; the code below uses the row convention
``S = W^T`` (``[D, Dv]``) so that ``out_t^T = q_t^T S_t``.

Activation memory kept for backward (per batch row and head):
- sum rule: the inputs only (q, k, v and the initial state); chunk states are
  recomputed by one cumulative sum in the backward pass.
- delta rule: the inputs, one ``D x Dv`` state per chunk (``ceil(T/C)`` of
  them) and the ``C x C`` inverse of each chunk's triangular system
  (``T x C`` numbers). No per-time-step fast weight is ever stored.
"""
import torch
import torch.nn.functional as F

from .reference import delta_step, sum_step

DEFAULT_CHUNK_SIZE = 64


def default_chunk_size(feature_dim):
    """Chunk length C for feature size D.

    The C x C work (the triangular solve, C^2 D products) must not swamp the
    D-sized work: measured fwd+bwd on the 2-core CPU (docs/benchmarks.md),
    C = 32 is 2.7x faster than C = 64 at D = 16, and C = 64 is best at
    D = 64 and D = 128.
    """
    return 32 if feature_dim <= 32 else DEFAULT_CHUNK_SIZE


def _to_chunks(x, chunk):
    """[B, H, T, *F] -> [B, H, N, C, *F], zero-padding T up to N * C.

    Zero keys (and zero beta) at padded positions write nothing, so the final
    state is unaffected; padded outputs are sliced off by the caller.
    """
    T = x.shape[2]
    pad = (-T) % chunk
    if pad:
        x = F.pad(x, (0, 0) * (x.dim() - 3) + (0, pad))
    # Contiguous chunks: inputs are often permuted views ([T, B, H, d] memory),
    # and batched matmuls on such strides fall back to one matrix at a time.
    return x.reshape(*x.shape[:2], -1, chunk, *x.shape[3:]).contiguous()


def _from_chunks(x, T):
    """[B, H, N, C, F] -> [B, H, T, F] (drops the padding)."""
    return x.reshape(*x.shape[:2], -1, x.shape[-1])[:, :, :T]


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


class _SumRuleChunked(torch.autograd.Function):
    """Sum rule, Eq. 17 + Eq. 11, fully parallel over chunks."""

    @staticmethod
    def forward(ctx, q, k, v, S0, chunk):
        T = q.shape[2]
        Q, K, V = (_to_chunks(x, chunk) for x in (q, k, v))
        S_start, S_end = _sum_chunk_states(K, V, S0)
        A = (Q @ _t(K)).tril()  # inclusive: out_t reads W_t, which has step t
        out = Q @ S_start + A @ V
        S_final = S_end[:, :, -1]
        ctx.save_for_backward(q, k, v, S0)
        ctx.chunk = chunk
        return _from_chunks(out, T), S_final

    @staticmethod
    def backward(ctx, d_out, dS_final):
        q, k, v, S0 = ctx.saved_tensors
        chunk, T = ctx.chunk, q.shape[2]
        Q, K, V, dO = (_to_chunks(x, chunk) for x in (q, k, v, d_out))
        S_start, _ = _sum_chunk_states(K, V, S0)
        # Gradient reaching the state at the end of chunk n: every later
        # chunk's queries read it (Q_m^T dO_m) and so does the final state.
        qdo = _t(Q) @ dO
        later = qdo.flip(2).cumsum(2).flip(2)
        dS_end = dS_final.unsqueeze(2) + later - qdo
        dA = (dO @ _t(V)).tril()
        dq = dO @ _t(S_start) + dA @ K
        dk = _t(dA) @ Q + V @ _t(dS_end)
        dv = _t((Q @ _t(K)).tril()) @ dO + K @ dS_end
        dS0 = dS_final + later[:, :, 0]
        return (_from_chunks(dq, T), _from_chunks(dk, T), _from_chunks(dv, T), dS0, None)


def _sum_chunk_states(K, V, S0):
    """States at the start of every chunk, [B, H, N, D, Dv], and their sum."""
    kv = _t(K) @ V
    S_end = S0.unsqueeze(2) + kv.cumsum(2)
    return torch.cat([S0.unsqueeze(2), S_end[:, :, :-1]], 2), S_end


def _delta_chunk_factors(K, V, beta):
    """The WY/UT factors of each chunk (see ops/README.md).

    Within a chunk the delta rule writes S_end = S0 + K^T U with pseudo-values
    U = Uv - Wk S0, where [Wk | Uv] solves the unit lower-triangular system
    (I + strictly_lower(diag(beta) K K^T)) [Wk | Uv] = diag(beta) [K | V].
    Returns (Tinv, Wk, Uv) with Tinv the inverse of that system's matrix.
    """
    Kb = K * beta.unsqueeze(-1)
    M = (Kb @ _t(K)).tril_(-1)
    M.diagonal(dim1=-2, dim2=-1).fill_(1)
    eye = torch.eye(K.shape[-2], dtype=K.dtype, device=K.device).expand_as(M)
    Tinv = torch.linalg.solve_triangular(M, eye, upper=False, unitriangular=True)
    return Tinv, Tinv @ Kb, Tinv @ (V * beta.unsqueeze(-1))


class _DeltaRuleChunked(torch.autograd.Function):
    """Delta rule, Eqs. 20, 24, 25, with T/C sequential steps."""

    @staticmethod
    def forward(ctx, q, k, v, beta, S0, chunk):
        T = q.shape[2]
        Q, K, V = (_to_chunks(x, chunk) for x in (q, k, v))
        b = _to_chunks(beta.unsqueeze(-1), chunk).squeeze(-1)
        Tinv, Wk, Uv = _delta_chunk_factors(K, V, b)
        # Only the chunk-start states are sequential: S_{n+1} = S_n + K_n^T U_n.
        S, states, U = S0, [], torch.empty_like(Uv)
        for n in range(Q.shape[2]):
            states.append(S)
            torch.sub(Uv[:, :, n], Wk[:, :, n] @ S, out=U[:, :, n])
            S = S + _t(K[:, :, n]) @ U[:, :, n]
        S_start = torch.stack(states, 2)
        A = (Q @ _t(K)).tril_()  # inclusive: out_t reads W_t, which has step t
        out = _add_matmul_(Q @ S_start, A, U)
        ctx.save_for_backward(q, k, v, beta, S_start, Tinv, Wk, U, A)
        ctx.chunk = chunk
        return _from_chunks(out, T), S

    @staticmethod
    def backward(ctx, d_out, dS_final):
        q, k, v, beta, S_start, Tinv, Wk, U, A = ctx.saved_tensors
        chunk, T = ctx.chunk, q.shape[2]
        Q, K, V, dO = (_to_chunks(x, chunk) for x in (q, k, v, d_out))
        b = _to_chunks(beta.unsqueeze(-1), chunk).squeeze(-1).unsqueeze(-1)

        # Reverse sweep over chunks: the only sequential part of the backward.
        # dU_n = A_n^T dO_n + K_n dS_{n+1};  dS_n = dS_{n+1} + Q_n^T dO_n - Wk_n^T dU_n
        dU, QtdO = _t(A) @ dO, _t(Q) @ dO
        dS_end = torch.empty_like(S_start)
        dS = dS_final
        for n in reversed(range(Q.shape[2])):
            dS_end[:, :, n] = dS
            dU[:, :, n] += K[:, :, n] @ dS
            dS = dS + QtdO[:, :, n] - _t(Wk[:, :, n]) @ dU[:, :, n]

        dA = (dO @ _t(U)).tril_()
        dQ = _add_matmul_(dO @ _t(S_start), dA, K)
        # Through the solve [Wk | Uv] = M^-1 diag(b) [K | V]. With dWk = -dU S^T
        # the right-hand-side gradients are dR_v = M^-T dU and dR_k = -dR_v S^T,
        # and dM = -(dR_k Wk^T + dR_v Uv^T) = -dR_v U^T (strictly lower part).
        dR_v = _t(Tinv) @ dU
        neg_dR_k = dR_v @ _t(S_start)
        dM = (dR_v @ _t(U)).tril_(-1).neg_()
        P = dM * b  # M = I + strictly_lower(diag(b) K K^T): d(K K^T) = diag(b) dM
        dK = _add_matmul_(_t(dA) @ Q, U, _t(dS_end))
        _add_matmul_(dK, P + _t(P), K)
        dK.addcmul_(b, neg_dR_k, value=-1)
        db = dM.mul_(K @ _t(K)).sum(-1)
        db += (dR_v * V).sum(-1) - (neg_dR_k * K).sum(-1)
        dV = dR_v.mul_(b)
        db = db.reshape(*db.shape[:2], -1)[:, :, :T]
        return (_from_chunks(dQ, T), _from_chunks(dK, T), _from_chunks(dV, T), db, dS, None)


def fast_weight_sum_chunked(q, k, v, state, chunk_size=None):
    """Sum rule; ``state`` is W ``[B, H, Dv, D]`` (never None here)."""
    if q.shape[2] == 1:  # decoding: one recurrent step beats any chunking
        out, W = sum_step(state, q[:, :, 0], k[:, :, 0], v[:, :, 0])
        return out.unsqueeze(2), W
    chunk = min(chunk_size or default_chunk_size(q.shape[-1]), q.shape[2])
    out, S = _SumRuleChunked.apply(q, k, v, _t(state), chunk)
    return out, _t(S)


def fast_weight_delta_chunked(q, k, v, beta, state, chunk_size=None):
    """Delta rule; ``state`` is W ``[B, H, Dv, D]`` (never None here)."""
    if q.shape[2] == 1:
        out, W = delta_step(state, q[:, :, 0], k[:, :, 0], v[:, :, 0], beta[:, :, 0])
        return out.unsqueeze(2), W
    chunk = min(chunk_size or default_chunk_size(q.shape[-1]), q.shape[2])
    out, S = _DeltaRuleChunked.apply(q, k, v, beta, _t(state), chunk)
    return out, _t(S)

"""Chunkwise forms of the gated rules, with a hand-written backward pass.

A decay a_t in [0, 1] per (batch, head, step) scales the memory before step t
writes (reference.py); the ops take its log (decay.py). Row convention
S = W^T as in chunked.py; derivation in ops/README.md ("Gated rules"). Inside
a chunk of C steps, with c_t = sum_{i<=t} log a_i (from the chunk's start):

    gamma_t = exp(c_t)               decay from the chunk's start through t
    G_tj    = exp(c_t - c_j), j <= t decay from step j (exclusive) through t
    rho_t   = exp(c_C - c_t)         decay from step t (exclusive) to the end

and with the pseudo-values U (V itself for the sum rule; for the delta rule
the WY/UT solve M U = diag(b) (V - diag(gamma) K S0) with
M = I + strictly_lower(diag(b) (K K^T * G))):

    O     = diag(gamma) Q S0 + (tril(Q K^T) * G) U
    S_end = gamma_C S0 + (diag(rho) K)^T U

Only ratios exp(c_t - c_j) <= 1 are ever formed, so strong decays cannot
overflow. A full forget (a_t = 0, log a_t = -inf, or any log a_t so
negative that a_t is below the dtype's eps^2) would make such a difference
-inf - (-inf), or swamp the others in c; instead c keeps the other logs only
(summed in float64), beside a count of the full forgets so far, and a factor
whose span holds a full forget is exactly 0. Without a decay the ops use chunked.py, which this
leaves as fast as it was.

Memory kept for backward: the inputs, one ``D x Dv`` state per chunk, per
chunk the ``C x C`` matrices ``tril(Q K^T) * G`` and G (and for the delta rule
``M^-1`` and ``K K^T``) and U (and ``Wk``), the size of v (and of k).
"""
import math

import torch

from .chunking import default_chunk_size, from_chunks, to_chunks
from .errors import refuse_a_second_derivative


def _t(x):
    return x.transpose(-1, -2)


def full_forget_below(dtype):
    """log a below which a decay counts as a full forget: a < eps^2 of the dtype, whose share of any
    output lies far below the dtype's rounding (the step-by-step recurrence computes the same to within
    it). Masks written as large negative numbers (-1e9, finfo.min) are full forgets too."""
    return 2.0 * math.log(torch.finfo(dtype).eps)


def _chunk_decays(log_decay, chunk):
    """gamma, G (lower triangle, diagonal included; zero above), rho and gamma_C of every chunk.

    Each is exp(c_t - c_j) over a span (j, t] of steps, computed as exp of the span's finite logs, and
    exactly 0 where a full forget (full_forget_below) lies in the span. c is summed in float64: after
    a strong decay (log a = -30, say) the later steps' c carry its size, and their float32 differences
    would keep only about 1e-6 of their own.
    """
    log_a = to_chunks(log_decay.unsqueeze(-1), chunk).squeeze(-1)  # padded steps: log a = 0
    forgets = log_a < full_forget_below(log_a.dtype)
    c = log_a.masked_fill(forgets, 0.0).double().cumsum(-1)
    n = forgets.cumsum(-1)  # full forgets from the chunk's start through each step
    C = c.shape[-1]
    lower = torch.ones(C, C, dtype=torch.bool, device=c.device).tril()

    def span(c_to, c_from, n_to, n_from, keep=None):
        kept = n_to == n_from if keep is None else (n_to == n_from) & keep
        return (c_to - c_from).to(log_a.dtype).masked_fill(~kept, float("-inf")).exp()

    G = span(c.unsqueeze(-1), c.unsqueeze(-2), n.unsqueeze(-1), n.unsqueeze(-2), lower)
    zero = torch.zeros_like(c[..., :1])
    gamma = span(c, zero, n, 0)
    rho = span(c[..., -1:], c, n[..., -1:], n)
    gamma_end = span(c[..., -1], zero[..., 0], n[..., -1], 0)
    return gamma, G, rho, gamma_end


class _GatedChunked(torch.autograd.Function):
    """Gated sum rule (beta None) or gated delta rule; log_decay = log a, ``[B, H, T]``."""

    @staticmethod
    def forward(ctx, q, k, v, beta, log_decay, S0, chunk):
        T = q.shape[2]
        Q, K, V = (to_chunks(x, chunk) for x in (q, k, v))
        gamma, G, rho, gamma_end = _chunk_decays(log_decay, chunk)
        delta = beta is not None
        Tinv = Wk = KK = None
        if delta:
            b = to_chunks(beta.unsqueeze(-1), chunk)  # [B, H, N, C, 1]
            KK = K @ _t(K)
            M = (KK * G * b).tril_(-1)
            M.diagonal(dim1=-2, dim2=-1).fill_(1)
            eye = torch.eye(chunk, dtype=K.dtype, device=K.device).expand_as(M)
            Tinv = torch.linalg.solve_triangular(M, eye, upper=False, unitriangular=True)
            Wk, U = Tinv @ (K * (b * gamma.unsqueeze(-1))), Tinv @ (V * b)
        else:
            U = V
        # Only the chunk-start states are sequential: S_{n+1} = gamma_C S_n + (rho K_n)^T U_n.
        S = torch.zeros(*Q.shape[:2], Q.shape[-1], V.shape[-1], dtype=Q.dtype, device=Q.device) if S0 is None else S0
        starts = []
        for n in range(Q.shape[2]):
            starts.append(S)
            if delta:
                U[:, :, n] -= Wk[:, :, n] @ S
            S = gamma_end[:, :, n, None, None] * S + _t(K[:, :, n] * rho[:, :, n, :, None]) @ U[:, :, n]
        S_start = torch.stack(starts, 2)
        A = (Q @ _t(K)) * G
        out = A @ U + gamma.unsqueeze(-1) * (Q @ S_start)
        ctx.save_for_backward(q, k, v, beta, log_decay, S_start, A, G, U, Tinv, Wk, KK)
        ctx.chunk = chunk
        return from_chunks(out, T), S

    @staticmethod
    def backward(ctx, d_out, dS_final):
        refuse_a_second_derivative("chunked")
        q, k, v, beta, log_decay, S_start, A, G, U, Tinv, Wk, KK = ctx.saved_tensors
        chunk, T = ctx.chunk, q.shape[2]
        Q, K, V, dO = (to_chunks(x, chunk) for x in (q, k, v, d_out))
        gamma, _, rho, gamma_end = _chunk_decays(log_decay, chunk)
        delta = beta is not None

        # Reverse sweep: dU_n = A_n^T dO_n + (rho K_n) dS_{n+1};
        # dS_n = gamma_C dS_{n+1} + (gamma Q_n)^T dO_n - Wk_n^T dU_n (the last term: delta rule only).
        dU = _t(A) @ dO
        QdO = _t(Q * gamma.unsqueeze(-1)) @ dO
        dS = torch.zeros_like(S_start[:, :, 0]) if dS_final is None else dS_final
        dS_end = torch.empty_like(S_start)
        for n in reversed(range(Q.shape[2])):
            dS_end[:, :, n] = dS
            dU[:, :, n] += (K[:, :, n] * rho[:, :, n, :, None]) @ dS
            dS = gamma_end[:, :, n, None, None] * dS + QdO[:, :, n]
            if delta:
                dS = dS - _t(Wk[:, :, n]) @ dU[:, :, n]

        dA = (dO @ _t(U)).tril_()
        dAG = dA * G
        QS = Q @ S_start
        UdS = U @ _t(dS_end)  # [.., C, D]: the end state's pull on each key
        dQ = dAG @ K + gamma.unsqueeze(-1) * (dO @ _t(S_start))
        dK = _t(dAG) @ Q + rho.unsqueeze(-1) * UdS
        dG = dA * (Q @ _t(K))
        d_gamma = (dO * QS).sum(-1)
        d_rho = (K * UdS).sum(-1)
        d_gamma_end = (S_start * dS_end).sum((-1, -2))
        if delta:  # through the solve [Wk | Uv] = M^-1 diag(b) [diag(gamma) K | V]
            b = to_chunks(beta.unsqueeze(-1), chunk)
            dR_v = _t(Tinv) @ dU
            dR_k = -dR_v @ _t(S_start)
            P = (dR_v @ _t(U)).tril_(-1).neg_()  # dM, strictly lower
            dKKG = P * b  # d(K K^T * G)
            dKK = dKKG * G
            dK = dK + (dKK + _t(dKK)) @ K + dR_k * (b * gamma.unsqueeze(-1))
            dG = dG + dKKG * KK
            d_gamma = d_gamma + b.squeeze(-1) * (dR_k * K).sum(-1)
            db = (P * KK * G).sum(-1) + (dR_v * V).sum(-1) + (dR_k * K).sum(-1) * gamma
            dV = dR_v * b
            db = db.reshape(*db.shape[:2], -1)[:, :, :T]
        else:
            dV, db = dU, None
        # The decays: every factor is exp of a difference of the cumulative log decays c.
        dGG = dG * G
        dc = d_gamma * gamma + dGG.sum(-1) - dGG.sum(-2) - d_rho * rho
        dc[..., -1] += (d_rho * rho).sum(-1) + d_gamma_end * gamma_end
        d_log = dc.flip(-1).cumsum(-1).flip(-1)  # c = cumsum(log a) within the chunk
        d_log = d_log.reshape(*d_log.shape[:2], -1)[:, :, :T]
        dS0 = dS if ctx.needs_input_grad[5] else None
        return (from_chunks(dQ, T), from_chunks(dK, T), from_chunks(dV, T), db, d_log, dS0, None)


def gated_chunked(q, k, v, beta, log_decay, state, chunk_size=None):
    """Gated sum rule (beta None) or gated delta rule; ``state`` is W ``[B, H, Dv, D]`` or None;
    ``log_decay`` is log a_t ``[B, H, T]`` (-inf: a full forget), which gets the decay's gradient."""
    chunk = min(chunk_size or default_chunk_size(q.shape[-1]), q.shape[2])
    out, S = _GatedChunked.apply(q, k, v, beta, log_decay, None if state is None else _t(state), chunk)
    return out, _t(S)

"""Chunkwise forms of the rules with a decay per key channel: GLA, KDA and GDN-2 (autograd backward).

A log-decay g_t in [-inf, 0]^D scales the key channels of the memory before step t writes: W_{t-1} Diag(a_t)
with a_t = exp(g_t) (rules/channels.py). In the row convention S = W^T ``[D, Dv]`` every step is

    S'_t = Diag(a_t) S_{t-1};   u_t = w_t - S'_t^T r_t;   S_t = S'_t + k_t u_t^T;   o_t = S_t^T q_t

with a retrieval key r_t and a written value w_t per rule: GLA none and v_t (u_t = v_t), KDA beta_t k_t and
beta_t v_t, GDN-2 b_t * k_t and w_t * v_t. Inside a chunk, with c_t = sum_{i<=t} g_i per channel from the
chunk's start, every decay between two steps is a vector of ratios R(t, j) = exp(c_t - c_j), and

    U   = M^-1 (W - (R diag(gamma)) S0),   M = I + strictly_lower(A),   A_tj = r_t . (R(t, j) * k_j)
    O   = (Q diag(gamma)) S0 + P U,        P_tj = q_t . (R(t, j) * k_j) for j <= t
    S_C = diag(gamma_C) S0 + (K diag(rho))^T U

where gamma_t = exp(c_t) and rho_t = exp(c_C - c_t) per channel (both <= 1). P and A cannot be one product of
decayed rows as for a decay per head: the ratios differ per channel. They are products all the same,
(x_t * exp(c_t)) . (k_j * exp(-c_j)), in float64 over chunks of CHUNK steps (secondary chunking in log space:
the chunks are short, and their states carry the rest). That is exact and cannot overflow: a log-decay below
the dtype's log(eps^2) is a full forget, kept out of c, so within a chunk |c| <= CHUNK |log(eps^2)|, which
exp keeps finite in float64 (511 for float32 inputs; float64 inputs take chunks of 8: 577).

Full forgets (g = -inf, or any g below log(eps^2)) are counted per channel, and a ratio whose span holds one
is exactly 0, as in chunked_gated.py: the few chunks that hold one form P and A from the ratios themselves.

Memory kept for backward (autograd): per chunk the C x C matrices P, A and M^-1, the decayed inputs, and one
D x Dv state.
"""
import torch

from .chunked_gated import full_forget_below
from .chunking import from_chunks, to_chunks

CHUNK = {torch.float32: 16, torch.float64: 8}  # steps per chunk, by the dtype the op computes in


def _ratio(c_to, c_from, n_to, n_from, keep=None):
    """exp(c_to - c_from) per channel (broadcast), exactly 0 where a full forget lies between, or where `keep`
    is False; the exponent is masked before exp, so it is never positive where the ratio is not wanted."""
    kept = n_to == n_from if keep is None else (n_to == n_from) & keep
    return (c_to - c_from).masked_fill(~kept, float("-inf")).exp()


def _decays(log_decay, chunk):
    """Per chunk: c (float64), the full-forget counts n ``[B, H, N, C, D]``, and whether each chunk holds one."""
    g = to_chunks(log_decay, chunk)  # padded steps: g = 0
    forgets = g < full_forget_below(g.dtype)
    c = g.masked_fill(forgets, 0.0).double().cumsum(-2)
    return c, forgets.cumsum(-2), forgets.flatten(-2).any(-1)


def _decayed_products(x, k, c, n, forgetting, dtype, diagonal):
    """sum_d x_td k_jd R_d(t, j) for j <= t (diagonal) or j < t, as ``[B, H, N, C, C]``."""
    C = x.shape[-2]
    lower = torch.tril(torch.ones(C, C, dtype=torch.bool, device=x.device), 0 if diagonal else -1)
    products = (x.double() * c.exp()) @ (k.double() * (-c).exp()).transpose(-1, -2)
    products = products.masked_fill(~lower, 0.0).to(dtype)
    if forgetting.any():  # those chunks from the ratios, zero across a full forget
        xs, ks, cs, ns = (y[forgetting] for y in (x, k, c, n))
        R = _ratio(cs.unsqueeze(-2), cs.unsqueeze(-3), ns.unsqueeze(-2), ns.unsqueeze(-3), lower.unsqueeze(-1))
        exact = (xs.unsqueeze(-2) * ks.unsqueeze(-3) * R.to(dtype)).sum(-1)
        products = products.masked_scatter(forgetting[..., None, None].expand_as(products), exact)
    return products


def channel_chunked(q, k, v, log_decay, state, retrieval=None, written=None, chunk_size=None):
    """The per-channel rules over a sequence: q, k ``[B, H, T, D]``, v ``[B, H, T, Dv]``, log_decay
    ``[B, H, T, D]``, state W ``[B, H, Dv, D]`` or None; retrieval r_t ``[B, H, T, D]`` (None: the sum rule,
    GLA), written w_t ``[B, H, T, Dv]`` (None: v). Returns (out ``[B, H, T, Dv]``, W_T)."""
    B, H, T, D = q.shape
    dtype = q.dtype
    chunk = min(chunk_size or CHUNK[torch.float64 if dtype == torch.float64 else torch.float32], T)
    Q, K = to_chunks(q, chunk), to_chunks(k, chunk)
    Wv = to_chunks(v if written is None else written, chunk)
    c, n, forgetting = _decays(log_decay, chunk)
    zero_c, zero_n = torch.zeros_like(c[..., :1, :]), torch.zeros_like(n[..., :1, :])
    gamma = _ratio(c, zero_c, n, zero_n).to(dtype)  # [B, H, N, C, D]
    rho = _ratio(c[..., -1:, :], c, n[..., -1:, :], n).to(dtype)
    gamma_end = gamma[..., -1, :]  # [B, H, N, D]
    P = _decayed_products(Q, K, c, n, forgetting, dtype, diagonal=True)
    if retrieval is None:
        U0, Wk = Wv, None
    else:
        R = to_chunks(retrieval, chunk)
        M = torch.eye(chunk, dtype=dtype, device=q.device) + _decayed_products(R, K, c, n, forgetting, dtype,
                                                                                diagonal=False)
        M_inv = torch.linalg.solve_triangular(M, torch.eye(chunk, dtype=dtype, device=q.device).expand_as(M),
                                              upper=False, unitriangular=True)
        U0, Wk = M_inv @ Wv, M_inv @ (R * gamma)  # U = U0 - Wk S0
    # Chunk by chunk: U = U0 - Wk S, O = (Q gamma) S + P U, S <- gamma_C * S + (K rho)^T U. unbind, not
    # indexing, in the loop: autograd then gathers each input's gradient once, not once per chunk.
    Kr = (K * rho).transpose(-1, -2)  # [B, H, N, D, C]
    steps = zip(*(x.unbind(2) for x in (Q * gamma, P, U0, Kr, gamma_end)),
                *((Wk.unbind(2),) if Wk is not None else ()))
    S = None if state is None else state.transpose(-1, -2).to(dtype)
    outs = []
    for Qg, P_i, U, Kr_i, decayed, *Wk_i in steps:
        if S is not None:
            if Wk_i:
                U = U - Wk_i[0] @ S
            outs.append(Qg @ S + P_i @ U)
            S = decayed.unsqueeze(-1) * S + Kr_i @ U
        else:
            outs.append(P_i @ U)
            S = Kr_i @ U
    out = from_chunks(torch.stack(outs, 2), T)
    return out, S.transpose(-1, -2)

"""One decoding step of each rule, updating the fast weight in place (no autograd).

An incremental decoder owns its fast weight W ``[B, H, Dv, D]`` (float32, or
float64) and advances it one token at a time. The functional step
(``reference.sum_step`` / ``delta_step``) builds the outer product and a new
W at every token: two state-sized temporaries, which cost more than the
arithmetic on a CPU (fresh memory is page-faulted in). Here W is read once for
everything the step needs and then receives a rank-1 update where it lives:

- sum rule (Eq. 17, Eq. 11): out = W q + v (k . q), then W += v k^T;
- delta rule (Eqs. 20, 24, 25): [vbar | W q] = W [k | q],
  u = beta (v - vbar), out = W q + u (k . q), then W += u k^T.

Both equal the functional steps (the query reads the updated memory:
W_t q = W_{t-1} q + u (k . q)); tests/test_ops.py checks them against those.
q, k: ``[B, H, D]``, v: ``[B, H, Dv]``, beta and log_decay: ``[B, H]``, in any
float dtype; the output has W's dtype. With a decay a = exp(log_decay) (the
gated rules; -inf: a full forget), W is scaled by a first (W <- a W), then
the step is the same.

A decoder that starts from an empty memory can hold W as its factors for a
while (the dual form): after t tokens W = U^T K with the keys K ``[t, D]``
and the writes U ``[t, Dv]`` (v for the sum rule, the pseudo-values for the
delta rule), t (D + Dv) numbers against D Dv. ``factored_step`` advances
that form; below ``factored_length_limit(D, Dv)`` tokens it is the smaller
one, and beam search, which copies every hypothesis's state at every step,
copies less.
"""
import torch


def _decay_(W, log_decay):
    if log_decay is not None:
        W.mul_(log_decay.to(W.dtype).exp().unsqueeze(-1).unsqueeze(-1))


@torch.no_grad()
def sum_step_(W, q, k, v, log_decay=None):
    """Sum rule, one token; W is updated in place. Returns out ``[B, H, Dv]``."""
    q, k, v = (x.to(W.dtype) for x in (q, k, v))
    _decay_(W, log_decay)
    out = _read(W, q.unsqueeze(-2)).squeeze(-2)
    out.addcmul_(v, (k * q).sum(-1, keepdim=True))
    W.addcmul_(v.unsqueeze(-1), k.unsqueeze(-2))  # W += v k^T, no outer-product temporary
    return out


@torch.no_grad()
def delta_step_(W, q, k, v, beta, log_decay=None):
    """Delta rule, one token; W is updated in place. Returns out ``[B, H, Dv]``."""
    q, k, v, beta = (x.to(W.dtype) for x in (q, k, v, beta))
    _decay_(W, log_decay)
    read = _read(W, torch.stack([k, q], dim=-2))  # one pass over W: [B, H, 2, Dv]
    vbar, out = read[..., 0, :], read[..., 1, :]
    u = (v - vbar).mul_(beta.unsqueeze(-1))  # pseudo-value beta (v - vbar)
    out.addcmul_(u, (k * q).sum(-1, keepdim=True))
    W.addcmul_(u.unsqueeze(-1), k.unsqueeze(-2))
    return out


def _read(W, rows):
    """rows ``[B, H, n, D]`` times W^T: W x for each row x (row vectors against W^T run about
    twice as fast on CPUs as W times column vectors)."""
    return rows @ W.transpose(-1, -2)


def factored_length_limit(D, Dv):
    """Tokens up to which the factors (t (D + Dv) numbers) are smaller than W (D Dv)."""
    return D * Dv // (D + Dv)


@torch.no_grad()
def factored_step(keys, writes, q, k, v, beta=None, log_decay=None, dtype=torch.float32):
    """One token of the sum rule (beta None) or the delta rule with W = writes^T keys.

    keys ``[B, H, t, D]`` and writes ``[B, H, t, Dv]`` (None before the first
    token) hold W_{t-1}. The new token's write is v (sum rule) or
    u = beta (v - W_{t-1} k) (delta rule, Eq. 24), and
    out = W_t q = writes^T (keys q) + u (k . q). Returns (out ``[B, H, Dv]``,
    keys, writes) with the token appended; dtype is the accumulation dtype.
    A decay scales every earlier write first (a W_{t-1} = (a writes)^T keys).
    """
    q, k, v = (x.to(dtype) for x in (q, k, v))
    if log_decay is not None and writes is not None:
        writes = writes * log_decay.to(dtype).exp().unsqueeze(-1).unsqueeze(-1)
    u = v
    out = torch.zeros_like(v)
    if keys is not None:
        # Row vectors against the cached factors (a softmax decoder's layout: much faster on
        # CPUs than matrix-times-vector): scores k_j . [k | q], then the writes they weight.
        probes = q.unsqueeze(-2) if beta is None else torch.stack([k, q], dim=-2)  # [B, H, 1 or 2, D]
        read = (probes @ keys.transpose(-1, -2)) @ writes  # [B, H, 1 or 2, Dv]: W_{t-1} [k | q]
        out = read[..., -1, :]
        if beta is not None:
            u = (v - read[..., 0, :]) * beta.to(dtype).unsqueeze(-1)
    elif beta is not None:
        u = v * beta.to(dtype).unsqueeze(-1)
    out = out + u * (k * q).sum(-1, keepdim=True)
    keys = k.unsqueeze(2) if keys is None else torch.cat([keys, k.unsqueeze(2)], 2)
    writes = u.unsqueeze(2) if writes is None else torch.cat([writes, u.unsqueeze(2)], 2)
    return out, keys, writes


def materialize(keys, writes):
    """W = writes^T keys ``[B, H, Dv, D]`` (contiguous, owned by the caller)."""
    return writes.transpose(-1, -2) @ keys

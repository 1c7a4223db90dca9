"""A causal memory while decoding (``Memory``), and the pure-torch decoding step of each rule.

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

``Memory`` holds one of the two forms for every row (hypothesis) and moves
with beam search's reorders: W is gathered into a spare buffer kept beside
it and the two are swapped, so no state-sized tensor is allocated per step;
the factors are gathered like a softmax decoder's key/value cache.
``torch_step_`` is the chunked backend's decoding step (factors while they
are smaller, then W in place); other backends step on W
(``Memory.fast_weight_for``).
"""
import dataclasses
from typing import Optional

import torch
from torch import Tensor


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


@dataclasses.dataclass
class Memory:
    """The fast weight of every row: W ``[rows, H, Dv, D]``, or its factors (keys ``[rows, H, t, D]`` and
    writes ``[rows, H, t, Dv]``, W = writes^T keys), or nothing yet (an empty memory)."""

    fast_weight: Optional[Tensor] = None
    keys: Optional[Tensor] = None
    writes: Optional[Tensor] = None
    spare: Optional[Tensor] = None  # W's reorder buffer

    def materialized(self):
        """W (built from the factors where they hold it), or None for an empty memory."""
        if self.keys is not None:
            return materialize(self.keys, self.writes)
        return self.fast_weight

    def hold_(self, W):
        """Hold W from now on (the factors are dropped)."""
        self.fast_weight, self.keys, self.writes = W, None, None

    def fast_weight_for(self, q, v, dtype):
        """W, held from now on (zeros for an empty memory, in `dtype`), for a step with q ``[rows, H, D]``
        and v ``[rows, H, Dv]``."""
        if self.fast_weight is None:
            W = self.materialized()
            self.hold_(q.new_zeros(*q.shape[:2], v.shape[-1], q.shape[-1], dtype=dtype) if W is None else W)
        return self.fast_weight

    def reorder_(self, new_order):
        """Gather the rows by new_order (beam search): W into its spare (allocated only when the number of
        rows changes), the factors into new tensors. An identity order copies nothing."""
        rows = self.fast_weight if self.fast_weight is not None else self.keys
        if rows is None or is_identity(new_order, rows.shape[0]):
            return
        if self.keys is not None:
            self.keys, self.writes = self.keys.index_select(0, new_order), self.writes.index_select(0, new_order)
            return
        spare = self.spare
        if spare is None or spare.shape[0] != new_order.numel():
            spare = self.fast_weight.new_empty((new_order.numel(),) + self.fast_weight.shape[1:])
        torch.index_select(self.fast_weight, 0, new_order, out=spare)
        self.fast_weight, self.spare = spare, self.fast_weight

    def detached(self):
        """A copy that carries no autograd history (the state a next segment starts from)."""
        return Memory(*(None if x is None else x.detach() for x in (self.fast_weight, self.keys, self.writes)))

    def to(self, device):
        return Memory(*(None if x is None else x.to(device) for x in (self.fast_weight, self.keys, self.writes)))


def torch_step_(memory, q, k, v, beta=None, log_decay=None, dtype=torch.float32):
    """One token for every row, in pure torch (beta None: the sum rules); advances `memory` in place.

    An empty memory grows as its factors while they are smaller than W (factored_length_limit), then
    holds W, which later tokens update in place. Returns out ``[rows, H, Dv]``.
    """
    if memory.fast_weight is not None:
        if beta is None:
            return sum_step_(memory.fast_weight, q, k, v, log_decay)
        return delta_step_(memory.fast_weight, q, k, v, beta, log_decay)
    out, keys, writes = factored_step(memory.keys, memory.writes, q, k, v, beta, log_decay, dtype)
    if keys.shape[2] >= factored_length_limit(k.shape[-1], v.shape[-1]):
        memory.hold_(materialize(keys, writes))  # W is smaller from here on
    else:
        memory.keys, memory.writes = keys, writes
    return out


def is_identity(order, size):
    return order.numel() == size and torch.equal(order, torch.arange(size, device=order.device))

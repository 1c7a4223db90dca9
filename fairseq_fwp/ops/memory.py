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
delta rule), t (D + Dv) numbers against D Dv. ``factored_read`` reads that
form for one more token and ``Memory.append_`` adds the token's factors;
below ``factored_length_limit(D, Dv)`` tokens it is the smaller one, and
beam search, which copies every hypothesis's state at every step, copies
less.

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
def factored_read(keys, writes, q, k, v, beta=None, log_decay=None, dtype=torch.float32):
    """One token of the sum rule (beta None) or the delta rule with W = writes^T keys.

    keys ``[B, H, t, D]`` and writes ``[B, H, t, Dv]`` (None before the first
    token) hold W_{t-1}; a decay scales `writes` in place first
    (a W_{t-1} = (a writes)^T keys). The new token's write is v (sum rule) or
    u = beta (v - W_{t-1} k) (delta rule, Eq. 24), and
    out = W_t q = writes^T (keys q) + u (k . q). Returns (out ``[B, H, Dv]``,
    the write u ``[B, H, Dv]``), in the accumulation dtype `dtype`; the
    caller appends (k, u) to the factors.
    """
    q, k, v = (x if x.dtype == dtype else x.to(dtype) for x in (q, k, v))
    if log_decay is not None and writes is not None:
        writes.mul_(log_decay.to(dtype).exp().unsqueeze(-1).unsqueeze(-1))
    u = v
    out = None
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
    contribution = u * (k * q).sum(-1, keepdim=True)
    return (contribution if out is None else out + contribution), u


def materialize(keys, writes):
    """W = writes^T keys ``[B, H, Dv, D]`` (contiguous, owned by the caller)."""
    return writes.transpose(-1, -2) @ keys


@dataclasses.dataclass
class Memory:
    """The fast weight of every row: W ``[rows, H, Dv, D]``, or its factors (keys ``[rows, H, t, D]`` and
    writes ``[rows, H, t, Dv]``, W = writes^T keys), or nothing yet (an empty memory).

    Factors that grow token by token (``append_``) and follow beam search's reorders are rewritten into
    one of two storages kept beside them, in turns, large enough for every token they will hold:
    writing into memory kept from the step before is several times faster on CPUs than into fresh
    memory, and the factors stay contiguous for the reads. A reorder leaves one zero slot at the end
    (``free_slot``), which the next token fills: one copy of the factors per step, not two. A zero slot
    changes nothing that is read (its key is zero). W's reorders use a spare the same way.
    """

    fast_weight: Optional[Tensor] = None
    keys: Optional[Tensor] = None
    writes: Optional[Tensor] = None
    spare: Optional[Tensor] = dataclasses.field(default=None, repr=False)  # W's reorder buffer
    storages: tuple = dataclasses.field(default=(), repr=False)  # ((keys', writes') flat storages) x 2
    free_slot: bool = dataclasses.field(default=False, repr=False)  # the factors' last slot is zero, unused
    choice: tuple = dataclasses.field(default=(), repr=False)  # (flag, call, backends.Choice) of the last step

    def backend_for(self, name, call, resolve):
        """The backend that `name` resolves to for `call` (resolve(name, call)), kept for the steps after
        it while the flag and the call stay the same: one decoding does not ask again at every token."""
        if self.choice[:2] != (name, call):
            self.choice = (name, call, resolve(name, call))
        return self.choice[2]

    @property
    def tokens(self):
        """Tokens the factors hold (a free slot does not count)."""
        return 0 if self.keys is None else self.keys.shape[2] - self.free_slot

    def materialized(self):
        """W (built from the factors where they hold it), or None for an empty memory."""
        if self.keys is not None:
            return materialize(self.keys, self.writes)
        return self.fast_weight

    def hold_(self, W):
        """Hold W from now on (the factors are dropped)."""
        self.fast_weight, self.keys, self.writes, self.storages, self.free_slot = W, None, None, (), False

    def fast_weight_for(self, q, v, dtype):
        """W, held from now on (zeros for an empty memory, in `dtype`), for a step with q ``[rows, H, D]``
        and v ``[rows, H, Dv]``."""
        if self.fast_weight is None:
            W = self.materialized()
            self.hold_(q.new_zeros(*q.shape[:2], v.shape[-1], q.shape[-1], dtype=dtype) if W is None else W)
        return self.fast_weight

    def append_(self, k, u, room):
        """One more token's key k ``[rows, H, D]`` and write u ``[rows, H, Dv]`` in the factors, which will
        hold at most `room` tokens."""
        if self.free_slot:
            self.keys[:, :, -1], self.writes[:, :, -1], self.free_slot = k, u, False
            return
        t = self.tokens
        rows, H = k.shape[:2]
        keys, writes = self._next_storage(rows, H, t + 1, k, u, room)
        for old, new, out in ((self.keys, k, keys), (self.writes, u, writes)):
            if old is None:
                out.copy_(new.unsqueeze(2))
            else:
                torch.cat([old, new.unsqueeze(2)], 2, out=out)
        self.keys, self.writes = keys, writes

    def reorder_(self, new_order):
        """Gather the rows by new_order (beam search), into the storage or spare kept for it. An identity
        order copies nothing."""
        rows = self.fast_weight if self.fast_weight is not None else self.keys
        if rows is None or is_identity(new_order, rows.shape[0]):
            return
        if self.keys is None:
            self.fast_weight, self.spare = _gathered(self.fast_weight, self.spare, new_order)
            return
        H, n = self.keys.shape[1:3]
        slots = n + (not self.free_slot)  # with a zero slot for the next token
        keys, writes = self._next_storage(new_order.numel(), H, slots, self.keys, self.writes, slots)
        for old, new in ((self.keys, keys), (self.writes, writes)):
            torch.index_select(old, 0, new_order, out=new[:, :, :n])
            new[:, :, n:].zero_()
        self.keys, self.writes, self.free_slot = keys, writes, True

    def _next_storage(self, rows, H, t, like_keys, like_writes, room):
        """[rows, H, t, D] and [rows, H, t, Dv] views of the storage the factors are not in now (made, for
        `room` tokens, where there is none large enough)."""
        D, Dv = like_keys.shape[-1], like_writes.shape[-1]
        current = self.keys.data_ptr() if self.keys is not None and self.storages else None
        pairs = [pair for pair in self.storages if pair[0].data_ptr() != current]
        pair = pairs[0] if pairs else None
        if pair is None or pair[0].numel() < rows * H * t * D:
            slots = max(room + 1, t)  # a free slot beside every token
            pair = tuple(x.new_empty(rows * H * slots * size) for x, size in ((like_keys, D), (like_writes, Dv)))
            self.storages = tuple(p for p in self.storages if p[0].data_ptr() == current)[:1] + (pair,)
        return pair[0][:rows * H * t * D].view(rows, H, t, D), pair[1][:rows * H * t * Dv].view(rows, H, t, Dv)

    def detached(self):
        """A copy that carries no autograd history (the state a next segment starts from)."""
        return self._copy(lambda x: x.detach())

    def to(self, device):
        return self._copy(lambda x: x.to(device))

    def _copy(self, convert):
        fast_weight, keys, writes = (None if x is None else convert(x) for x in (self.fast_weight, self.keys,
                                                                                 self.writes))
        return Memory(fast_weight=fast_weight, keys=keys, writes=writes, free_slot=self.free_slot)


def _gathered(x, spare, new_order):
    """(x's rows in new_order, written into `spare` where it has the right shape; x, the next spare)."""
    if spare is None or spare.shape != (new_order.numel(),) + x.shape[1:]:
        spare = x.new_empty((new_order.numel(),) + x.shape[1:])
    torch.index_select(x, 0, new_order, out=spare)
    return spare, x


def torch_step_(memory, q, k, v, beta=None, log_decay=None, dtype=torch.float32):
    """One token for every row, in pure torch (beta None: the sum rules); advances `memory` in place.

    An empty memory grows as its factors while they are smaller than W (factored_length_limit), then
    holds W, which later tokens update in place. Returns out ``[rows, H, Dv]``.
    """
    if memory.fast_weight is not None:
        if beta is None:
            return sum_step_(memory.fast_weight, q, k, v, log_decay)
        return delta_step_(memory.fast_weight, q, k, v, beta, log_decay)
    out, u = factored_read(memory.keys, memory.writes, q, k, v, beta, log_decay, dtype)
    limit = factored_length_limit(k.shape[-1], v.shape[-1])
    memory.append_(k.to(dtype), u, room=limit)
    if memory.tokens >= limit:
        memory.hold_(memory.materialized())  # W is smaller from here on
    return out


def is_identity(order, size):
    return order.numel() == size and torch.equal(order, torch.arange(size, device=order.device))

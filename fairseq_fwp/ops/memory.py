"""The fast weight as a memory that an update rule writes and reads: the one place that knows its form.

A rule's step (rules/) is written once against three operations of a memory: ``decay_(a)`` (W <- a W),
``read(x)`` (W x) and ``write_(k, u)`` (W <- W + u k^T). Two memories implement them:

- ``FunctionalMemory``: W as a value, a new tensor at every write, which autograd follows: the reference
  backend runs a rule's steps over a sequence on it (the float64-exact ground truth).
- ``Memory``: what an incremental decoder owns, advanced in place, one token at a time, for every row
  (hypothesis). It holds W ``[rows, H, Dv, D]`` (float32, or float64), or, from an empty start, W's
  factors while they are smaller: after t tokens W = U^T K with the keys K ``[t, D]`` and the writes U
  ``[t, Dv]``, t (D + Dv) numbers against D Dv (below ``factored_length_limit(D, Dv)`` tokens; the dual
  form). Beam search, which copies every hypothesis's state at every step, then copies less. W receives
  its rank-1 writes where it lives: a functional step would build the outer product and a new W at every
  token, two state-sized temporaries that cost more than the arithmetic on a CPU (fresh memory is
  page-faulted in).

``Memory`` also keeps the backend chosen for its steps (``backend_for``), moves with beam search's
reorders (W into a spare buffer kept beside it, swapped; the factors into one of two storages kept beside
them, in turns, so no state-sized tensor is allocated per step), and holds the encoder-decoder memory of
each source sentence (``hold_`` / ``hold_factors_``, ``select_rows_``). Nothing outside this module
touches its fields.
"""
import dataclasses
from typing import Optional

import torch
from torch import Tensor


def factored_length_limit(D, Dv):
    """Tokens up to which the factors (t (D + Dv) numbers) are smaller than W (D Dv)."""
    return D * Dv // (D + Dv)


def _decay_factor(a):
    """What W ``[rows, H, Dv, D]`` is multiplied by: a ``[rows, H]`` whole (a W), or a ``[rows, H, D]`` per
    key channel (W Diag(a): its columns)."""
    return a.unsqueeze(-2) if a.dim() == 3 else a.unsqueeze(-1).unsqueeze(-1)


def _check_reads(x):
    """A rule's step reads n vectors per row and head: [rows, H, D] alone would broadcast wrongly."""
    if x.dim() != 4:
        raise ValueError(f"memory.read takes x [rows, H, n, D], n vectors per row and head (one: x.unsqueeze(-2)); "
                         f"got x of shape {tuple(x.shape)}")


class FunctionalMemory:
    """W ``[B, H, Dv, D]`` as a value: each write makes a new W, which autograd follows."""

    def __init__(self, fast_weight):
        self.fast_weight = fast_weight

    def decay_(self, a):
        if a is not None:
            self.fast_weight = self.fast_weight * _decay_factor(a)

    def read(self, x):
        """x ``[B, H, n, D]`` -> W x ``[B, H, n, Dv]``."""
        _check_reads(x)
        return x @ self.fast_weight.transpose(-1, -2)

    def write_(self, k, u):
        self.fast_weight = self.fast_weight + u.unsqueeze(-1) * k.unsqueeze(-2)


@dataclasses.dataclass
class Memory:
    """The fast weight of every row: W, or its factors, or nothing yet (an empty memory).

    Construct it empty, or with ``fast_weight=W`` (a state carried into decoding); everything else goes
    through its methods.
    """

    fast_weight: Optional[Tensor] = None
    _keys: Optional[Tensor] = dataclasses.field(default=None, repr=False)
    _writes: Optional[Tensor] = dataclasses.field(default=None, repr=False)
    _shape: tuple = dataclasses.field(default=(), repr=False)  # (rows, H, D, Dv, dtype, device) while empty
    _spare: Optional[Tensor] = dataclasses.field(default=None, repr=False)  # W's reorder buffer
    _storages: tuple = dataclasses.field(default=(), repr=False)  # ((keys', writes') flat storages) x 2
    _free_slot: bool = dataclasses.field(default=False, repr=False)  # the factors' last slot is zero, unused
    _choice: tuple = dataclasses.field(default=(), repr=False)  # (flag, call, backends.Choice) of the last step

    # -- what it holds -------------------------------------------------------------------

    @property
    def is_empty(self):
        return self.fast_weight is None and self._keys is None

    @property
    def rows(self):
        """Rows (hypotheses, streams or source sentences) it holds; None while empty."""
        held = self.fast_weight if self.fast_weight is not None else self._keys
        return None if held is None else held.shape[0]

    @property
    def tokens(self):
        """Tokens the factors hold (a free slot does not count); 0 for W or an empty memory."""
        return 0 if self._keys is None else self._keys.shape[2] - self._free_slot

    @property
    def is_factored(self):
        return self._keys is not None

    def tensors(self):
        """The tensors it holds (the reorder spares and storages, allocated once, apart)."""
        return [x for x in (self.fast_weight, self._keys, self._writes) if x is not None]

    def held(self):
        """(W, None, None), or (None, keys, writes) where it holds W = writes^T keys as its factors ``[rows, H, t,
        D]`` and ``[rows, H, t, Dv]``, or (None, None, None) empty: what a fused read takes as it is."""
        if self._keys is not None:
            return None, self._keys[:, :, :self.tokens], self._writes[:, :, :self.tokens]
        return self.fast_weight, None, None

    def materialized(self):
        """W (built from the factors where they hold it), or None for an empty memory."""
        if self._keys is not None:
            return self._writes.transpose(-1, -2) @ self._keys
        return self.fast_weight

    def hold_(self, W):
        """Hold W from now on (the factors are dropped)."""
        self.fast_weight, self._keys, self._writes, self._storages, self._free_slot = W, None, None, (), False

    def hold_factors_(self, keys, writes):
        """Hold W = writes^T keys as its factors, keys ``[rows, H, t, D]`` and writes ``[rows, H, t, Dv]``
        (a source sentence's memory: phi(K) and V)."""
        self.fast_weight, self._keys, self._writes, self._storages, self._free_slot = None, keys, writes, (), False

    def start_(self, k, v, dtype):
        """Before a step of rows k ``[rows, H, D]``, v ``[rows, H, Dv]``: what an empty memory will hold."""
        if self.is_empty:
            self._shape = (*k.shape[:2], k.shape[-1], v.shape[-1], dtype, k.device)

    def fast_weight_for(self, q, v, dtype, D=None):
        """W, held from now on (zeros for an empty memory, in `dtype`), for a kernel's step with q
        ``[rows, H, D]`` and v ``[rows, H, Dv]`` (D: the features' size where q is not feature-mapped yet)."""
        if self.fast_weight is None:
            W = self.materialized()
            self.hold_(q.new_zeros(*q.shape[:2], v.shape[-1], D or q.shape[-1], dtype=dtype) if W is None else W)
        return self.fast_weight

    def backend_for(self, name, call, resolve):
        """The backend that `name` resolves to for `call` (resolve(name, call)), kept for the steps after
        it while the flag and the call stay the same: one decoding does not ask again at every token."""
        if self._choice[:2] != (name, call):
            self._choice = (name, call, resolve(name, call))
        return self._choice[2]

    # -- what a rule's step does with it (rules/) ------------------------------------------------

    def decay_(self, a):
        """W <- a W, a ``[rows, H]``, or W <- W Diag(a), a ``[rows, H, D]`` per key channel; None: no decay."""
        if a is None:
            return
        if self.fast_weight is not None:
            self.fast_weight.mul_(_decay_factor(a))
        elif a.dim() == 3 and self._keys is not None:  # W Diag(a) = writes^T (keys Diag(a))
            self._keys.mul_(_decay_factor(a))
        elif self._writes is not None:  # a W = (a writes)^T keys
            self._writes.mul_(_decay_factor(a))

    def read(self, x):
        """x ``[rows, H, n, D]`` -> W x ``[rows, H, n, Dv]``, in x's dtype. Row vectors against W^T (or
        against the factors, a softmax decoder's key/value layout) run about twice as fast on CPUs as W
        times column vectors."""
        _check_reads(x)
        if self.fast_weight is not None:
            W = self.fast_weight if self.fast_weight.dtype == x.dtype else self.fast_weight.to(x.dtype)
            return x @ W.transpose(-1, -2)
        if self._keys is not None:
            keys, writes = (y if y.dtype == x.dtype else y.to(x.dtype) for y in (self._keys, self._writes))
            return (x @ keys.transpose(-1, -2)) @ writes
        return x.new_zeros(*x.shape[:-1], self._shape[3])

    def write_(self, k, u):
        """W <- W + u k^T for k ``[rows, H, D]``, u ``[rows, H, Dv]``. An empty memory grows as its factors
        while they are smaller than W, then holds W, which later writes update in place."""
        if self.fast_weight is not None:
            self.fast_weight.addcmul_(u.unsqueeze(-1), k.unsqueeze(-2))  # no outer-product temporary
            return
        limit = factored_length_limit(k.shape[-1], u.shape[-1])
        if limit == 0:
            self.hold_(u.unsqueeze(-1) * k.unsqueeze(-2))
            return
        self._append_(k, u, room=limit)
        self.hold_fast_weight_at_(limit)

    def hold_fast_weight_at_(self, limit):
        """Hold W once the factors reach `limit` tokens: W is smaller from there on."""
        if self.tokens >= limit:
            self.hold_(self.materialized())

    def _append_(self, k, u, room):
        """One more token's key and write in the factors, which will hold at most `room` tokens."""
        keys, writes = self.factor_slots_(1, k.shape[:2], k.shape[-1], u.shape[-1], (k, u), room)
        keys[:, :, -1], writes[:, :, -1] = k, u

    def factor_slots_(self, n, rows_and_heads, D, Dv, like, room):
        """The factors with n more slots, which the caller fills with n tokens' keys and writes: (keys ``[rows,
        H, t + n, D]``, writes ``[rows, H, t + n, Dv]``), the t tokens held first; from now on the memory holds
        t + n tokens (at most `room`). An empty memory starts its factors in the dtypes and device of `like`,
        a tensor for the keys and one for the writes."""
        if self._free_slot and n == 1:
            self._free_slot = False
            return self._keys, self._writes
        t = self.tokens
        keys, writes = self._next_storage(*rows_and_heads, t + n, D, Dv, like, room)
        if t:
            keys[:, :, :t], writes[:, :, :t] = self._keys[:, :, :t], self._writes[:, :, :t]
        self._keys, self._writes, self._free_slot = keys, writes, False
        return keys, writes

    # -- rows ------------------------------------------------------------------------------

    def reorder_(self, new_order):
        """Gather the rows by new_order (beam search), into the storage or spare kept for it. An identity
        order copies nothing. A reorder leaves the factors one zero slot at the end, which the next token
        fills: one copy of the factors per step, not two (a zero slot changes nothing read: its key is 0)."""
        rows = self.rows
        if rows is None or is_identity(new_order, rows):
            return
        if self._keys is None:
            self.fast_weight, self._spare = _gathered(self.fast_weight, self._spare, new_order)
            return
        H, n = self._keys.shape[1:3]
        slots = n + (not self._free_slot)  # with a zero slot for the next token
        keys, writes = self._next_storage(new_order.numel(), H, slots, self._keys.shape[-1], self._writes.shape[-1],
                                          (self._keys, self._writes), slots)
        for old, new in ((self._keys, keys), (self._writes, writes)):
            torch.index_select(old, 0, new_order, out=new[:, :, :n])
            new[:, :, n:].zero_()
        self._keys, self._writes, self._free_slot = keys, writes, True

    def select_rows_(self, index):
        """Keep the rows `index` (source memories, as sentences leave a beam search's batch)."""
        if self._keys is not None:
            self._keys, self._writes = self._keys.index_select(0, index), self._writes.index_select(0, index)
        elif self.fast_weight is not None:
            self.hold_(self.fast_weight.index_select(0, index))

    def _next_storage(self, rows, H, t, D, Dv, like, room):
        """[rows, H, t, D] and [rows, H, t, Dv] views of the storage the factors are not in now (made, in the
        dtypes and device of `like` (keys', writes'), for `room` tokens, where there is none large enough).
        Writing into memory kept from the step before is several times faster on CPUs than into fresh memory,
        and the factors stay contiguous for reads."""
        current = self._keys.data_ptr() if self._keys is not None and self._storages else None
        pairs = [pair for pair in self._storages if pair[0].data_ptr() != current]
        pair = pairs[0] if pairs else None
        if pair is None or pair[0].numel() < rows * H * t * D:
            slots = max(room + 1, t)  # a free slot beside every token
            pair = tuple(x.new_empty(rows * H * slots * size) for x, size in zip(like, (D, Dv)))
            self._storages = tuple(p for p in self._storages if p[0].data_ptr() == current)[:1] + (pair,)
        return pair[0][:rows * H * t * D].view(rows, H, t, D), pair[1][:rows * H * t * Dv].view(rows, H, t, Dv)

    # -- copies ----------------------------------------------------------------------------

    def detached(self):
        """A copy that carries no autograd history (the state a next segment starts from)."""
        return self._copy(lambda x: x.detach())

    def to(self, device):
        return self._copy(lambda x: x.to(device))

    def copied(self):
        """A copy that shares no storage: the original may be advanced and reordered in place."""
        return self._copy(torch.clone)

    def _copy(self, convert):
        fast_weight, keys, writes = (None if x is None else convert(x) for x in (self.fast_weight, self._keys,
                                                                                 self._writes))
        return Memory(fast_weight=fast_weight, _keys=keys, _writes=writes, _free_slot=self._free_slot)


def _gathered(x, spare, new_order):
    """(x's rows in new_order, written into `spare` where it has the right shape; x, the next spare)."""
    if spare is None or spare.shape != (new_order.numel(),) + x.shape[1:]:
        spare = x.new_empty((new_order.numel(),) + x.shape[1:])
    torch.index_select(x, 0, new_order, out=spare)
    return spare, x


def is_identity(order, size):
    if size == 1:  # batch 1: one comparison, not a new arange per decoding step
        return order.numel() == 1 and int(order) == 0
    return order.numel() == size and torch.equal(order, torch.arange(size, device=order.device))

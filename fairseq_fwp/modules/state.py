"""What a fast-weight attention carries between calls: one ``FastWeightState``.

Incremental decoding keeps one per layer in fairseq's incremental state,
carry-over keeps one per stream (carried_streams.py), and beam search moves
them with its reorders. Every tensor is batch-first, one row per hypothesis
(or stream).

- causal layers (decoder self-attention): the memory (``ops.Memory``: W, or
  its factors while they are smaller), the key sum z of attention
  normalisation, the short convolutions' caches, and the FAVOR+ draw the
  memory was written with. Reorders gather every row (``reorder_``): W and
  z into spare buffers kept beside them, so that no state-sized tensor is
  allocated per step, and an identity order copies nothing.
- non-causal layers (encoder-decoder attention): the source memory
  W = sum_j v_j phi(k_j)^T of each source sentence, held as its factors
  (phi(K) and V) where they are smaller (a source of fewer than
  D Dv / (D + Dv) tokens), and z where attention normalisation is on.
  fairseq's beam search repeats every source sentence once per beam in
  consecutive rows; their memories would be equal, so one is kept per
  sentence (``rows_per_memory`` consecutive rows read it) and is moved only
  when sentences leave the batch. Any other reorder still works: rows that
  stop coming in groups get one memory each.
"""
import dataclasses
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..ops import Memory
from ..ops.memory import is_identity


@dataclasses.dataclass
class FastWeightState:
    memory: Memory = dataclasses.field(default_factory=Memory)
    key_sum: Optional[Tensor] = None  # z [rows, H, D] (Eq. 18), where attention normalisation is on
    convolutions: Tuple[Tensor, ...] = ()  # the q, k, v convolutions' caches [rows, C, K - 1], or none
    feature_draw: Optional[int] = None  # FAVOR+: the draw the memory was written in
    rows_per_memory: int = 1  # non-causal: consecutive rows that read one source memory
    key_sum_spare: Optional[Tensor] = dataclasses.field(default=None, repr=False)

    # -- causal rows ------------------------------------------------------------------

    def reorder_(self, new_order):
        """Move every row where beam search says (causal layers)."""
        held = self.tensors()
        if not held or is_identity(new_order, held[0].shape[0]):
            return  # greedy search, or a beam that kept every hypothesis in place
        self.memory.reorder_(new_order)
        if self.key_sum is not None:
            spare = self.key_sum_spare
            if spare is None or spare.shape[0] != new_order.numel():
                spare = self.key_sum.new_empty((new_order.numel(),) + self.key_sum.shape[1:])
            torch.index_select(self.key_sum, 0, new_order, out=spare)
            self.key_sum, self.key_sum_spare = spare, self.key_sum
        if self.convolutions:
            self.convolutions = tuple(cache.index_select(0, new_order) for cache in self.convolutions)

    def detached(self):
        """A copy without autograd history (truncated backpropagation between segments)."""
        return FastWeightState(self.memory.detached(), _detach(self.key_sum),
                               tuple(cache.detach() for cache in self.convolutions), self.feature_draw)

    def to(self, device):
        return FastWeightState(self.memory.to(device), _to(self.key_sum, device),
                               tuple(cache.to(device) for cache in self.convolutions), self.feature_draw)

    def copied(self):
        """A copy that shares no storage (a session's state, kept while decoding advances the original)."""
        return FastWeightState(self.memory.copied(), None if self.key_sum is None else self.key_sum.clone(),
                               tuple(cache.clone() for cache in self.convolutions), self.feature_draw,
                               self.rows_per_memory)

    def check_features(self, draw, what):
        """A memory is only meaningful in the feature space it was written in."""
        if self.feature_draw is not None and self.feature_draw != draw:
            raise RuntimeError(f"{what} was written with FAVOR+ draw {self.feature_draw}, but the features are "
                               f"now draw {draw}: its memory cannot be read with them")

    def tensors(self):
        """The tensors the state holds (the reorder spares, allocated once, apart)."""
        return self.memory.tensors() + [x for x in (self.key_sum, *self.convolutions) if x is not None]

    # -- checkpoints ------------------------------------------------------------------

    def as_dict(self):
        """Plain contiguous tensors and numbers, for a checkpoint (the memory as W). Contiguous: fairseq hands
        a loaded checkpoint to the other ranks by sending each tensor's memory as if it were contiguous (a
        transposed W arrived transposed)."""
        contiguous = lambda x: None if x is None else x.contiguous()  # noqa: E731
        return {"fast_weight": contiguous(self.memory.materialized()), "key_sum": contiguous(self.key_sum),
                "convolutions": [cache.contiguous() for cache in self.convolutions],
                "feature_draw": self.feature_draw}

    @classmethod
    def from_dict(cls, saved):
        return cls(Memory(fast_weight=saved["fast_weight"]), saved["key_sum"], tuple(saved["convolutions"]),
                   saved["feature_draw"])

    # -- non-causal: one source memory per sentence ----------------------------------------

    def reorder_sources_(self, new_order):
        """Move the per-source memories with the rows that read them."""
        g, sources = self.rows_per_memory, self.memory.rows
        if is_identity(new_order, g * sources):
            return  # greedy search, or a beam that kept every hypothesis in place
        source = torch.div(new_order, g, rounding_mode="floor")  # the memory each new row reads
        kept = new_order.numel() % g == 0 and bool((source.view(-1, g) == source.view(-1, g)[:, :1]).all())
        if kept:  # rows still come in groups of g: one memory per group
            source = source.view(-1, g)[:, 0]
            if is_identity(source, sources):
                return
        else:  # an arbitrary reorder: one memory per row from now on
            self.rows_per_memory = 1
        self.memory.select_rows_(source)
        if self.key_sum is not None:
            self.key_sum = self.key_sum.index_select(0, source)

    def read_sources(self, q, with_normalizer):
        """W q for query rows q ``[rows, H, T, D]`` that share their source's memory (sources, rows =
        sources * rows_per_memory), and with_normalizer z . q (else None). Returns ([rows, H, T, Dv],
        [rows, H, T, 1] or None)."""
        if not with_normalizer:
            return self._per_source(q, self.memory.read)[0], None
        return tuple(self._per_source(q, self.memory.read, lambda x: x @ self.key_sum.unsqueeze(-1).to(q.dtype)))

    def source_weights(self, q):
        """q . phi(k_j) for query rows q ``[rows, H, T, D]`` and each source position j, ``[rows, H, T, S]``: the
        memory's factors, phi(K) (zero at padding), which it holds while weights are asked for."""
        _, keys, _ = self.memory.held()
        if keys is None:
            raise ValueError("attention weights need the source's keys, and this memory holds W alone: ask for "
                             "weights from the step that builds it (the first), which keeps them")
        return self._per_source(q, lambda x: x @ keys.transpose(-1, -2).to(q.dtype))[0]

    def _per_source(self, q, *reads):
        """[read(x) for read in reads] of each source's query rows together (a memory is read once for its rows),
        rows first again."""
        n, (rows, H, T, D) = self.memory.rows, q.shape
        g = rows // n
        grouped = q.view(n, g, H, T, D).transpose(1, 2).reshape(n, H, g * T, D)
        return [read(grouped).view(n, H, g, T, -1).transpose(1, 2).reshape(rows, H, T, -1) for read in reads]


def buffer_tensors(buffer):
    """The tensors of one layer's buffer in fairseq's incremental state: a FastWeightState's, or those of
    a softmax attention's dict (its key/value cache): what a decoder holds per layer."""
    if isinstance(buffer, FastWeightState):
        return buffer.tensors()
    return [x for x in buffer.values() if isinstance(x, torch.Tensor)]


def rows_per_source(key, key_padding_mask):
    """How many consecutive rows of key ``[S, rows, C]`` (and of its padding mask) repeat each source.

    1 unless the rows come in equal groups of g identical ones (beam search
    with beam g); then one memory per group serves all of its rows.
    """
    rows = key.shape[1]
    g = 1
    while g < rows and torch.equal(key[:, g], key[:, 0]):
        g += 1
    if g == 1 or rows % g:
        return 1
    for x, dim in ((key, 1), (key_padding_mask, 0)):
        if x is None:
            continue
        grouped = x.unflatten(dim, (rows // g, g))
        if not torch.equal(grouped, grouped.narrow(dim + 1, 0, 1).expand_as(grouped)):
            return 1
    return g


def _detach(x):
    return None if x is None else x.detach()


def _to(x, device):
    return None if x is None else x.to(device)

"""The fast-weight state of fairseq's incremental decoding, and beam search's reorders of it.

Two kinds of buffer (both batch-first):

- rows (decoder self-attention): one fast weight per hypothesis, z
  ``[rows, H, D]`` and the short convolutions' caches ``[rows, C, K - 1]``. A memory that starts empty is held as its factors, the
  keys ``[rows, H, t, D]`` and writes ``[rows, H, t, Dv]`` of its t tokens
  (W = writes^T keys, the dual form), while they are smaller than W
  (t < D Dv / (D + Dv)); then as W ``[rows, H, Dv, D]``, advanced in place
  at every token (ops/decoding.py). Beam search reorders them at every step:
  W and z are gathered into a spare buffer kept beside them
  (``<name>_spare``) and the two are swapped, so no state-sized tensor is
  allocated per step; an identity order copies nothing. The factors are
  gathered like a softmax decoder's key/value cache.
- sources (encoder-decoder attention): the memory W = sum_j v_j phi(k_j)^T of
  the source sentence. fairseq's beam search repeats every source sentence
  once per beam in consecutive rows; their memories would be equal, so one is
  kept per sentence (``MEMORY_ROWS`` records how many consecutive rows read
  it) and is moved only when sentences leave the batch. Any other reorder
  still works: rows that stop coming in groups get one memory each.
"""
import torch

from ..ops import decoding

MEMORY = ("fast_weight", "key_sum")  # W and z: fixed shapes, so rows are gathered into spares
MEMORY_ROWS = "rows_per_memory"


def advance_rows(buffer, q, k, v, beta, log_decay, dtype):
    """One token for every row (beta None: the sum rules; log_decay None: the paper's rules);
    returns out ``[rows, H, Dv]``."""
    W = buffer.get("fast_weight")
    if W is not None:
        if beta is None:
            return decoding.sum_step_(W, q, k, v, log_decay)
        return decoding.delta_step_(W, q, k, v, beta, log_decay)
    out, keys, writes = decoding.factored_step(buffer.get("keys"), buffer.get("writes"), q, k, v, beta, log_decay,
                                               dtype)
    if keys.shape[2] >= decoding.factored_length_limit(k.shape[-1], v.shape[-1]):
        store_fast_weight(buffer, decoding.materialize(keys, writes))  # W is smaller from here on
    else:
        buffer["keys"], buffer["writes"] = keys, writes
    return out


def fast_weight(buffer):
    """The rows' W (materialised from the factors where they hold it), or None for an empty memory."""
    if buffer.get("keys") is not None:
        return decoding.materialize(buffer["keys"], buffer["writes"])
    return buffer.get("fast_weight")


def store_fast_weight(buffer, W):
    buffer["fast_weight"] = W
    buffer["keys"] = buffer["writes"] = None


def reorder_rows(buffer, new_order):
    """Gather every row buffer by new_order: W and z into their spares (allocated only when the
    number of rows changes), the rest (factors, convolution caches) into new tensors."""
    names = [name for name, value in buffer.items() if value is not None and not name.endswith("_spare")]
    if not names or _is_identity(new_order, buffer[names[0]].shape[0]):
        return
    for name in names:
        value = buffer[name]
        if name not in MEMORY:
            buffer[name] = value.index_select(0, new_order)
            continue
        spare = buffer.get(name + "_spare")
        if spare is None or spare.shape[0] != new_order.numel():
            spare = value.new_empty((new_order.numel(),) + value.shape[1:])
        torch.index_select(value, 0, new_order, out=spare)
        buffer[name], buffer[name + "_spare"] = spare, value


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


def read_memory(W, q):
    """out = W q for query rows that share their source's memory.

    W: ``[sources, H, Dv, D]``; q: ``[rows, H, T, D]`` with rows = sources * g,
    consecutive rows reading one memory. Returns ``[rows, H, T, Dv]``.
    """
    n, (rows, H, T, D) = W.shape[0], q.shape
    g = rows // n
    grouped = q.view(n, g, H, T, D).transpose(1, 2).reshape(n, H, g * T, D)
    out = grouped @ W.transpose(-1, -2).to(q.dtype)  # W is read once per source, for all its rows
    return out.view(n, H, g, T, -1).transpose(1, 2).reshape(rows, H, T, -1)


def memory_rows(buffer):
    return int(buffer[MEMORY_ROWS])


def reorder_sources(buffer, new_order):
    """Move the per-source memories with the rows that read them."""
    g = memory_rows(buffer)
    source = torch.div(new_order, g, rounding_mode="floor")  # the memory each new row reads
    kept = new_order.numel() % g == 0 and bool((source.view(-1, g) == source.view(-1, g)[:, :1]).all())
    if kept:  # rows still come in groups of g: one memory per group
        source = source.view(-1, g)[:, 0]
        if _is_identity(source, buffer["fast_weight"].shape[0]):
            return
    else:  # an arbitrary reorder: one memory per row from now on
        buffer[MEMORY_ROWS] = torch.tensor(1)
    for name in MEMORY:
        if buffer.get(name) is not None:
            buffer[name] = buffer[name].index_select(0, source)


def _is_identity(order, size):
    return order.numel() == size and torch.equal(order, torch.arange(size, device=order.device))

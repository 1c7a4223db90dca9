"""FastWeightAttention's non-causal path: encoder self-attention and encoder-decoder attention (Eq. 15).

One memory W = sum_j v_j phi(k_j)^T over every unpadded source position, read by every query (Eq. 11), the
output divided by z . phi(q) with z = sum_j phi(k_j) where attention normalisation is on (Eq. 19). For
encoder-decoder attention while decoding, the memory is built once per source sentence, not per beam (fairseq's
beam search repeats each source once per beam: state.rows_per_source), and kept as static state in the
incremental state: as its factors phi(K) and V while they are smaller than W (factored_length_limit), which
every query then reads for less.

Attention weights: the output is linear in the source's values, y_i = sum_j a_ij v_j, with a_ij = phi(q_i) .
phi(k_j), divided by the same normaliser: exact, though never formed to compute y. They are computed where
asked (need_weights, in eval mode: never while training), from phi(K), which the memory then holds as factors
whatever the source's length: O(T S) per layer.
"""
import torch

from ..ops.fast_weight import accumulation_dtype
from ..ops.memory import factored_length_limit
from .normaliser import divided_by_normalizer
from .state import FastWeightState, rows_per_source


def attend_to_sources(layer, query, key, key_padding_mask, incremental_state, static_kv, weights_wanted):
    """The layer's output ``[T, B, C]`` for queries ``[T, B, C]`` over the sources `key` ``[S, B, C]`` (padding
    where key_padding_mask ``[B, S]`` is True), and the attention weights ``[B, H, T, S]`` where wanted (else
    None)."""
    cached = incremental_state is not None and static_kv
    state = layer._get_input_buffer(incremental_state) if cached else FastWeightState()
    if cached and not weights_wanted and not state.memory.is_empty and query.shape[0] == 1 \
            and layer.fused_step is not None and layer.fused_step.runs(query, None):
        out = layer.fused_step.read(layer._step_heads(layer.q_proj(query)), state)  # a decoding step, one call
        return layer._finish_step(out, query), None
    q = layer._phi(layer.q_proj(query))
    if state.memory.is_empty:
        g = rows_per_source(key, key_padding_mask) if cached else 1
        mask = None if key_padding_mask is None else key_padding_mask[::g]
        source_memory(layer, key[:, ::g], mask, state, factored=cached, keep_keys=weights_wanted)
        state.rows_per_memory = g
        if cached:
            layer._set_input_buffer(incremental_state, state)
    out, normalizer = state.read_sources(q, layer.options.attention_normalization)
    weights = state.source_weights(q) if weights_wanted else None
    if normalizer is not None:  # Eq. 19
        out = divided_by_normalizer(out, normalizer, layer.options.eps)
        weights = None if weights is None else divided_by_normalizer(weights, normalizer, layer.options.eps)
    return layer._finish(out, query), weights


def source_memory(layer, key, key_padding_mask, state, factored, keep_keys=False):
    """Eq. 15 over the unpadded source, W = sum_j v_j phi(k_j)^T and z = sum_j phi(k_j), into `state`: while
    decoding (factored) a source shorter than factored_length_limit, and where weights are asked for (keep_keys)
    any source, keeps phi(K) and V instead."""
    k, v = layer._phi(layer.k_proj(key)), layer._heads(layer.v_proj(key))
    if key_padding_mask is not None:
        k = k * (~key_padding_mask).unsqueeze(1).unsqueeze(-1).to(k.dtype)
    state.key_sum = k.to(accumulation_dtype(k.dtype)).sum(2) if layer.options.attention_normalization else None
    if keep_keys or (factored and k.shape[2] < factored_length_limit(k.shape[-1], v.shape[-1])):
        state.memory.hold_factors_(k.contiguous(), v.contiguous())  # read at every step: laid out once
    else:
        state.memory.hold_(torch.einsum("bhte,bhtd->bhed", v, k))

"""The dual-form computations on a record, in float64 and in fixed row chunks (so results are reproducible).

With keys X = (x_1..x_T), errors E = (e_1..e_T), e_t = scale_t * g_t:
    attention weights   alpha_t = x_t . x                              (Def. 2.1)
    dual output         S2(x) = W0 x + sum_t alpha_t e_t (+ b0 + sum_t e_t)   (Eq. 14, bias on input 1)
    dual weights        W = W0 + sum_t e_t x_t^T,  b = b0 + sum_t e_t  (Eq. 12)
Only the first `rows` rows count: those of the updates a checkpoint has seen.
"""
import numpy as np

CHUNK_ROWS = 1 << 16


def _chunks(rows):
    for start in range(0, rows, CHUNK_ROWS):
        yield start, min(start + CHUNK_ROWS, rows)


def _errors(record, layer, start, stop, scales):
    return np.asarray(record.grads(layer)[start:stop], dtype=np.float64) * scales[start:stop, None]


def attention_weights(record, layer, query, rows):
    """alpha_t = x_t . query for the first `rows` training rows; query: [d_in]."""
    keys, query = record.keys(layer), np.asarray(query, dtype=np.float64)
    alpha = np.empty(rows, dtype=np.float64)
    for start, stop in _chunks(rows):
        alpha[start:stop] = np.asarray(keys[start:stop], dtype=np.float64) @ query
    return alpha


def dual_outputs(record, layer, queries, rows):
    """S2(x) of Eq. 14 for each row of queries [M, d_in] -> [M, d_out]."""
    w0, b0 = record.initial_weights(layer)
    queries = np.asarray(queries, dtype=np.float64)
    out = queries @ w0.astype(np.float64).T
    scales, keys = record.row_scales(rows), record.keys(layer)
    bias_change = 0.0
    for start, stop in _chunks(rows):
        errors = _errors(record, layer, start, stop, scales)
        out += (queries @ np.asarray(keys[start:stop], dtype=np.float64).T) @ errors
        bias_change = bias_change + errors.sum(0)
    if b0 is not None:
        out += b0.astype(np.float64) + bias_change
    return out


def dual_weights(record, layer, rows):
    """(W, b) of Eq. 12 rebuilt from W0 and the first `rows` rows; b is None without a bias."""
    w0, b0 = record.initial_weights(layer)
    weight = w0.astype(np.float64)
    bias = None if b0 is None else b0.astype(np.float64)
    scales, keys = record.row_scales(rows), record.keys(layer)
    for start, stop in _chunks(rows):
        errors = _errors(record, layer, start, stop, scales)
        weight += errors.T @ np.asarray(keys[start:stop], dtype=np.float64)
        if bias is not None:
            bias += errors.sum(0)
    return weight, bias

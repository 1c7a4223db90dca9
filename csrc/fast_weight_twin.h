// CPU twin of the CUDA kernels (fast_weight_cuda.cu): the same algorithm with
// the same loop structure, so the kernels' math is tested where no GPU is.
//
// What is the same: the work split into tiles of `rows` rows of W, the forward
// that checkpoints each row before every chunk and saves the delta rule's
// pseudo-values u_t, the backward that walks chunks in reverse and rebuilds
// W_{t-1} by replaying the chunk's writes from its checkpoint (one shared
// helper writes W in both passes, so the replay is bit-identical), and the
// per-tile partial gradients dq, dk, dbeta summed over the tile's rows in row
// order. What differs: a GPU warp spreads a row over 32 lanes and sums with
// butterflies; here one loop walks the row.
#pragma once

#include <cstdint>
#include <vector>

#include "fast_weight.h"

namespace fwp {
namespace twin {

// w += u x (Eq. 17 / Eq. 24): the one place W is written, forward and replay.
template <typename acc_t>
void write_row(acc_t* w, acc_t u, const acc_t* x, int64_t D) {
  for (int64_t d = 0; d < D; ++d) w[d] += u * x[d];
}

template <typename acc_t, typename scalar_t>
void to_acc(acc_t* dst, const scalar_t* src, int64_t n) {
  for (int64_t i = 0; i < n; ++i) dst[i] = static_cast<acc_t>(src[i]);
}

// The rows of one tile: [first, last).
inline void tile_rows(const Problem& p, int64_t tile, int64_t* first, int64_t* last) {
  *first = tile * p.rows;
  *last = *first + p.rows < p.Dv ? *first + p.rows : p.Dv;
}

template <typename scalar_t, typename acc_t>
void forward_tile(const Problem& p, const ForwardArgs& a, int64_t bh, int64_t tile) {
  const int64_t T = p.T, D = p.D, Dv = p.Dv;
  const scalar_t* q = static_cast<const scalar_t*>(a.q) + bh * T * D;
  const scalar_t* k = static_cast<const scalar_t*>(a.k) + bh * T * D;
  const scalar_t* v = static_cast<const scalar_t*>(a.v) + bh * T * Dv;
  const scalar_t* beta = p.delta ? static_cast<const scalar_t*>(a.beta) + bh * T : nullptr;
  scalar_t* out = static_cast<scalar_t*>(a.out) + bh * T * Dv;
  acc_t* u_saved = a.u ? static_cast<acc_t*>(a.u) + bh * T * Dv : nullptr;
  acc_t* checkpoints = static_cast<acc_t*>(a.checkpoints);
  std::vector<acc_t> w(D), k_t(D), q_t(D);

  int64_t first, last;
  tile_rows(p, tile, &first, &last);
  for (int64_t e = first; e < last; ++e) {
    const acc_t* W0 = static_cast<const acc_t*>(a.W0) + (bh * Dv + e) * D;
    w.assign(W0, W0 + D);
    for (int64_t t = 0; t < T; ++t) {
      if (checkpoints && t % p.chunk == 0) {
        acc_t* dst = checkpoints + ((bh * num_chunks(p) + t / p.chunk) * Dv + e) * D;
        for (int64_t d = 0; d < D; ++d) dst[d] = w[d];
      }
      to_acc(k_t.data(), k + t * D, D);
      to_acc(q_t.data(), q + t * D, D);
      acc_t u = static_cast<acc_t>(v[t * Dv + e]);
      if (p.delta) {
        const acc_t vbar = dot(w.data(), k_t.data(), D);            // Eq. 20
        u = static_cast<acc_t>(beta[t]) * (u - vbar);              // Eq. 24
        if (u_saved) u_saved[t * Dv + e] = u;
      }
      write_row(w.data(), u, k_t.data(), D);
      out[t * Dv + e] = static_cast<scalar_t>(dot(w.data(), q_t.data(), D));  // Eq. 11 / 25
    }
    acc_t* W_final = static_cast<acc_t*>(a.W_final) + (bh * Dv + e) * D;
    for (int64_t d = 0; d < D; ++d) W_final[d] = w[d];
  }
}

// dq_tiles, dk_tiles and dbeta_tiles must be zero on entry: rows add into
// them in row order, which is the GPU's fixed reduction order.
template <typename scalar_t, typename acc_t>
void backward_tile(const Problem& p, const BackwardArgs& a, int64_t bh, int64_t tile) {
  const int64_t T = p.T, D = p.D, Dv = p.Dv;
  const scalar_t* q = static_cast<const scalar_t*>(a.q) + bh * T * D;
  const scalar_t* k = static_cast<const scalar_t*>(a.k) + bh * T * D;
  const scalar_t* v = static_cast<const scalar_t*>(a.v) + bh * T * Dv;
  const scalar_t* beta = p.delta ? static_cast<const scalar_t*>(a.beta) + bh * T : nullptr;
  const scalar_t* d_out = static_cast<const scalar_t*>(a.d_out) + bh * T * Dv;
  const acc_t* u_saved = p.delta ? static_cast<const acc_t*>(a.u) + bh * T * Dv : nullptr;
  const acc_t* checkpoints = static_cast<const acc_t*>(a.checkpoints);
  const int64_t tile_offset = tile * p.BH + bh;
  acc_t* dq_tile = static_cast<acc_t*>(a.dq_tiles) + tile_offset * T * D;
  acc_t* dk_tile = static_cast<acc_t*>(a.dk_tiles) + tile_offset * T * D;
  acc_t* dbeta_tile = p.delta ? static_cast<acc_t*>(a.dbeta_tiles) + tile_offset * T : nullptr;
  acc_t* dv = static_cast<acc_t*>(a.dv) + bh * T * Dv;

  std::vector<acc_t> dw(D), w_prev(D), k_chunk(p.chunk * D), q_t(D), u_chunk(p.chunk);
  int64_t first, last;
  tile_rows(p, tile, &first, &last);
  for (int64_t e = first; e < last; ++e) {
    const acc_t* dW_final = static_cast<const acc_t*>(a.dW_final) + (bh * Dv + e) * D;
    dw.assign(dW_final, dW_final + D);  // gradient reaching W_t, starting from dL/dW_T
    for (int64_t n = num_chunks(p) - 1; n >= 0; --n) {
      const int64_t start = n * p.chunk;
      const int64_t len = T - start < p.chunk ? T - start : p.chunk;
      to_acc(k_chunk.data(), k + start * D, len * D);
      for (int64_t j = 0; j < len; ++j)  // the chunk's writes u_j (the sum rule writes v_j)
        u_chunk[j] = p.delta ? u_saved[(start + j) * Dv + e] : static_cast<acc_t>(v[(start + j) * Dv + e]);
      const acc_t* w_start = checkpoints + ((bh * num_chunks(p) + n) * Dv + e) * D;

      for (int64_t j = len - 1; j >= 0; --j) {
        const int64_t t = start + j;
        const acc_t* k_t = k_chunk.data() + j * D;
        w_prev.assign(w_start, w_start + D);  // W_{t-1}: replay the chunk's writes before t
        for (int64_t i = 0; i < j; ++i) write_row(w_prev.data(), u_chunk[i], k_chunk.data() + i * D, D);
        to_acc(q_t.data(), q + t * D, D);
        const acc_t u = u_chunk[j];
        const acc_t g = static_cast<acc_t>(d_out[t * Dv + e]);
        for (int64_t d = 0; d < D; ++d) dw[d] += g * q_t[d];  // out_t = W_t q_t
        const acc_t du = dot(dw.data(), k_t, D);               // W_t = W_{t-1} + u_t k_t^T
        acc_t dvbar = 0;
        if (p.delta) {
          const acc_t b = static_cast<acc_t>(beta[t]);
          const acc_t vbar = dot(w_prev.data(), k_t, D);
          dbeta_tile[t] += du * (static_cast<acc_t>(v[t * Dv + e]) - vbar);
          dvbar = -b * du;  // vbar_t = W_{t-1} k_t, u_t = beta_t (v_t - vbar_t)
          dv[t * Dv + e] = b * du;
        } else {
          dv[t * Dv + e] = du;
        }
        for (int64_t d = 0; d < D; ++d) {
          const acc_t w_t = w_prev[d] + u * k_t[d];  // W_t, as the forward wrote it
          dq_tile[t * D + d] += g * w_t;
          dk_tile[t * D + d] += u * dw[d] + dvbar * w_prev[d];
          dw[d] += dvbar * k_t[d];  // now dL/dW_{t-1}
        }
      }
    }
    acc_t* dW0 = static_cast<acc_t*>(a.dW0) + (bh * Dv + e) * D;
    for (int64_t d = 0; d < D; ++d) dW0[d] = dw[d];
  }
}

}  // namespace twin
}  // namespace fwp

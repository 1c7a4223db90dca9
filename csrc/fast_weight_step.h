// One decoding step of a fast-weight self-attention, fused: the feature map of the query and the keys, their
// normalisation, attention normalisation, the decay, the writes and the read, for one (row, head) at a time.
// The math is the reference step's (fairseq_fwp/ops/rules/, modules/fast_weight_attention.py), in another
// order of the same sums; plain pointers and sizes, no torch (the glue is in fast_weight.cpp).
//
// Layouts (contiguous, per (row, head) slice): q [d]; k [N, d]; v [N, dv]; beta [N] or, for the erase and
// write gates, [D + dv]; log_decay [1] or [D]; W [dv, D] (W[e, :] . phi is value channel e); z [D].
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>

#include "fast_weight.h"

namespace fwp {

enum class FeatureMap : int { kLinear = 0, kSiLU = 1, kDPFP = 2, kPerformer = 3 };
enum class QKNorm : int { kNone = 0, kSum = 1, kL2 = 2 };
// What a write stores: v (the sum rule), beta (v - W k) (the delta rule), or w * v - W (b * k) (GDN-2).
enum class Write : int { kSum = 0, kDelta = 1, kEraseWrite = 2 };
enum class Decay : int { kNone = 0, kHead = 1, kChannel = 2 };

struct StepOptions {
  FeatureMap map;
  int64_t nu;              // DPFP's nu
  const void* projection;  // FAVOR+'s P [d, m] (in the step's dtype), m = D / 2
  double input_scale;      // FAVOR+'s input scaling
  QKNorm qk_norm;
  bool attention_normalization;
  bool normalised_retrieval;  // the delta rules' Eqs. 26-28 under attention normalisation
  Write write;
  int64_t writes;  // N writes per token (DeltaProduct)
  Decay decay;
  double eps;  // attention normalisation's
};

struct StepSizes {
  int64_t d, D, dv;
};

// phi(x) of one head's vector x [d] into out [D]; r: scratch of 2 d.
template <typename T>
void feature_map(const StepOptions& o, const StepSizes& s, const T* x, T* out, T* r) {
  const int64_t d = s.d;
  switch (o.map) {
    case FeatureMap::kLinear:  // elu(x) + 1 (Eq. 30)
      for (int64_t i = 0; i < d; ++i) out[i] = x[i] > T(0) ? x[i] + T(1) : std::exp(x[i]);
      return;
    case FeatureMap::kSiLU:
      for (int64_t i = 0; i < d; ++i) out[i] = x[i] / (T(1) + std::exp(-x[i]));
      return;
    case FeatureMap::kDPFP: {  // r = [relu(x), relu(-x)]; block i: r * roll(r, i) (Eq. 37)
      const int64_t n = 2 * d;
      for (int64_t j = 0; j < d; ++j) {
        r[j] = std::max(x[j], T(0));
        r[d + j] = std::max(-x[j], T(0));
      }
      for (int64_t i = 1; i <= o.nu; ++i) {  // roll(r, i)[j] = r[j - i], wrapping around (no division per element)
        T* block = out + (i - 1) * n;
        for (int64_t j = 0; j < i; ++j) block[j] = r[j] * r[j - i + n];
        for (int64_t j = i; j < n; ++j) block[j] = r[j] * r[j - i];
      }
      return;
    }
    case FeatureMap::kPerformer: {  // (2m)^-1/2 ([exp(P^T x - |x|^2/2); exp(-P^T x - |x|^2/2)] + 1e-4)
      const int64_t m = s.D / 2;
      const T* P = static_cast<const T*>(o.projection);
      T half_sq = 0;
      for (int64_t i = 0; i < d; ++i) {
        r[i] = x[i] * T(o.input_scale);
        half_sq += r[i] * r[i];
      }
      half_sq *= T(0.5);
      const T scale = T(1) / std::sqrt(T(2 * m));
      for (int64_t j = 0; j < m; ++j) {
        T u = 0;
        for (int64_t i = 0; i < d; ++i) u += r[i] * P[i * m + j];
        out[j] = (std::exp(u - half_sq) + T(1e-4)) * scale;
        out[m + j] = (std::exp(-u - half_sq) + T(1e-4)) * scale;
      }
      return;
    }
  }
}

// Eq. 29 (sum) or L2 normalisation of phi [D], as feature_maps.normalize_features.
template <typename T>
void normalise(QKNorm how, int64_t D, T* phi) {
  if (how == QKNorm::kNone) return;
  T total = 0;
  for (int64_t i = 0; i < D; ++i) total += how == QKNorm::kSum ? phi[i] : phi[i] * phi[i];
  const T eps = T(1e-6);
  const T denominator = how == QKNorm::kSum ? std::max(total, eps) : std::max(std::sqrt(total), eps);
  for (int64_t i = 0; i < D; ++i) phi[i] /= denominator;
}

// The fast weight of one (row, head), as W [dv, D] itself (W[e, :] . phi is value channel e).
template <typename T>
struct DenseMemory {
  T* W;
  int64_t D, dv;

  void decay(T a) {
    for (int64_t i = 0; i < dv * D; ++i) W[i] *= a;
  }
  void decay_columns(const T* a) {  // W Diag(a)
    for (int64_t e = 0; e < dv; ++e)
      for (int64_t j = 0; j < D; ++j) W[e * D + j] *= a[j];
  }
  void apply(const T* x, T* out) const {  // out = W x
    for (int64_t e = 0; e < dv; ++e) out[e] = dot(W + e * D, x, D);
  }
  void write(const T* u, const T* key) {  // W <- W + u key^T
    for (int64_t e = 0; e < dv; ++e)
      for (int64_t j = 0; j < D; ++j) W[e * D + j] += u[e] * key[j];
  }
};

// The same fast weight as its factors, W = writes^T keys, keys [capacity, D] and writes [capacity, dv], of which
// the first t hold tokens (the dual form; ops/memory.py): a write fills slot t. scores: scratch of capacity.
template <typename T>
struct FactoredMemory {
  T* keys;
  T* writes;
  int64_t t, D, dv;
  T* scores;

  void decay(T a) {  // a W = (a writes)^T keys
    for (int64_t i = 0; i < t * dv; ++i) writes[i] *= a;
  }
  void decay_columns(const T* a) {  // W Diag(a) = writes^T (keys Diag(a))
    for (int64_t i = 0; i < t; ++i)
      for (int64_t j = 0; j < D; ++j) keys[i * D + j] *= a[j];
  }
  void apply(const T* x, T* out) const {  // out = writes^T (keys x)
    for (int64_t i = 0; i < t; ++i) scores[i] = dot(keys + i * D, x, D);
    for (int64_t e = 0; e < dv; ++e) out[e] = 0;
    for (int64_t i = 0; i < t; ++i)
      for (int64_t e = 0; e < dv; ++e) out[e] += scores[i] * writes[i * dv + e];
  }
  void write(const T* u, const T* key) {
    std::copy(key, key + D, keys + t * D);
    std::copy(u, u + dv, writes + t * dv);
    ++t;
  }
};

// One (row, head): advances the memory (W, or its factors) and z [D] in place and writes out [dv].
// scratch: 3 D + 2 d + 2 dv.
template <typename T, typename Memory>
void fused_step(const StepOptions& o, const StepSizes& s, const T* q, const T* k, const T* v, const T* beta,
                const T* log_decay, Memory& memory, T* z, T* out, T* scratch) {
  const int64_t D = s.D, dv = s.dv, d = s.d;
  T* phi_q = scratch;
  T* phi_k = phi_q + D;
  T* key = phi_k + D;  // the key a write retrieves with: phi(k) (scaled, under Eqs. 26-28) or b * phi(k)
  T* r = key + D;
  T* u = r + 2 * d;
  T* retrieved = u + dv;
  feature_map(o, s, q, phi_q, r);
  normalise(o.qk_norm, D, phi_q);
  if (o.decay == Decay::kHead) {
    memory.decay(std::exp(log_decay[0]));
  } else if (o.decay == Decay::kChannel) {  // W Diag(a): a per column
    for (int64_t j = 0; j < D; ++j) key[j] = std::exp(log_decay[j]);
    memory.decay_columns(key);
  }
  for (int64_t n = 0; n < o.writes; ++n) {
    feature_map(o, s, k + n * d, phi_k, r);
    normalise(o.qk_norm, D, phi_k);
    T strength = o.write == Write::kDelta ? beta[n] : T(1);
    for (int64_t j = 0; j < D; ++j) key[j] = phi_k[j];
    if (o.attention_normalization) {
      if (o.normalised_retrieval) {  // Eqs. 26-28: k' = phi(k) / (d + eps), beta' = beta d
        T z_sum = 0;
        for (int64_t j = 0; j < D; ++j) z_sum += z[j];
        const T scale = z_sum > T(0) ? dot(z, phi_k, D) : T(1);
        for (int64_t j = 0; j < D; ++j) key[j] = phi_k[j] / (scale + T(o.eps));
        strength *= scale;
      }
      for (int64_t j = 0; j < D; ++j) z[j] += phi_k[j];
    }
    if (o.write == Write::kEraseWrite)
      for (int64_t j = 0; j < D; ++j) key[j] *= beta[j];
    if (o.write != Write::kSum) memory.apply(key, retrieved);
    for (int64_t e = 0; e < dv; ++e) {
      const T written = o.write == Write::kEraseWrite ? beta[D + e] * v[n * dv + e] : v[n * dv + e];
      u[e] = o.write == Write::kSum ? written
             : o.write == Write::kDelta ? strength * (written - retrieved[e])
                                        : written - retrieved[e];
    }
    memory.write(u, o.write == Write::kEraseWrite || !o.normalised_retrieval ? phi_k : key);
  }
  const T normaliser = o.attention_normalization ? dot(z, phi_q, D) + T(o.eps) : T(1);
  memory.apply(phi_q, out);
  for (int64_t e = 0; e < dv; ++e) out[e] /= normaliser;
}

// One (row, head) of a read of a source memory (encoder-decoder attention, Eq. 15's W read by a query): out [dv]
// = W phi(q), the memory W or its factors, divided by z . phi(q) + eps under attention normalisation (Eq. 19).
// scratch: D + 2 d.
template <typename T, typename Memory>
void fused_read(const StepOptions& o, const StepSizes& s, const T* q, const Memory& memory, const T* z, T* out,
                T* scratch) {
  T* phi_q = scratch;
  feature_map(o, s, q, phi_q, phi_q + s.D);
  normalise(o.qk_norm, s.D, phi_q);
  const T normaliser = o.attention_normalization ? dot(z, phi_q, s.D) + T(o.eps) : T(1);
  memory.apply(phi_q, out);
  for (int64_t e = 0; e < s.dv; ++e) out[e] /= normaliser;
}

}  // namespace fwp

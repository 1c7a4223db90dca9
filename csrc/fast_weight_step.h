// One decoding step of a fast-weight self-attention, fused: the feature map of the query and the keys, their
// normalisation, attention normalisation, the decay, the writes and the read, for one (row, head) at a time.
// The math is the reference step's (fairseq_fwp/ops/rules/, modules/fast_weight_attention.py), in another
// order of the same sums; plain pointers and sizes, no torch (the glue is in fast_weight.cpp).
//
// One source for both devices: the step is written over a team (SerialTeam below on the CPU; the CUDA kernel's
// BlockTeam, one thread block per (row, head), in fast_weight_step_cuda.cu). A team runs the step's phases:
//   each(n, f)                   f(i) for every i < n
//   grid(rows, cols, f)          f(r, c) for every r < rows, c < cols
//   dots(rows, A, x, n, out)     out[r] = A[r, :n] . x (A's rows n apart)
//   combine(rows, w, A, n, out)  out[c] = sum_r w[r] A[r, c], c < n (A [rows, n])
// and totals that every member gets: dot(a, b, n), sum(n, f). The items of a phase are independent (no item
// reads what another item of the same phase writes: a GPU block runs them in any order; the tests run the
// CPU's in reverse as well and expect the same bits), and every phase is over before the next begins. Outside
// the phases the code computes scalars only, the same in every member.
//
// Layouts (contiguous, per (row, head) slice): q [d]; k [N, d]; v [N, dv]; beta [N] or, for the erase and
// write gates, [D + dv]; log_decay [1] or [D]; W [dv, D] (W[e, :] . phi is value channel e); z [D].
#pragma once

#include <cmath>
#include <cstdint>

#include "fast_weight.h"

// The step's functions run where their team runs: on the device in the CUDA kernel, on the host otherwise.
#if defined(__CUDACC__)
#define FWP_STEP __device__
#else
#define FWP_STEP
#endif

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

// The tensors of a fused call, every (row, head) i of them (the glue's layouts, fast_weight.cpp): q [RH, d],
// k [RH, N, d], v [RH, N, dv], beta [RH, beta_size], log_decay [RH, decay_size], z [n, D], out [RH, dv], and the
// memories: W [n, dv, D], or keys [n, slots, D] and writes [n, slots, dv] of which the first t hold tokens. A
// step has n = RH memories; a read of source memories has n = RH / rows_per_memory (consecutive rows share one).
struct StepTensors {
  const void *q, *k, *v, *beta, *log_decay;
  void *W, *keys, *writes, *z, *out;
  int64_t N, heads, beta_size, decay_size, slots, t, rows_per_memory;
};

// Scratch of one (row, head), in numbers: the step's (phi(q), phi(k), a key, the feature map's 2 d, the write,
// a retrieval, and the factors' scores) and the read's (phi(q), 2 d, the scores).
inline FWP_HOST_DEVICE int64_t step_scratch(const StepSizes& s, int64_t slots) {
  return 3 * s.D + 2 * s.d + 2 * s.dv + slots;
}
inline FWP_HOST_DEVICE int64_t read_scratch(const StepSizes& s, int64_t slots) { return s.D + 2 * s.d + slots; }

template <typename T>
FWP_STEP T larger(T a, T b) {
  return a > b ? a : b;
}
// exp and sqrt in T's own precision (an unqualified call on a float would find C's double one).
template <typename T>
FWP_STEP T exponential(T x) {
  using std::exp;
  return exp(x);
}
template <typename T>
FWP_STEP T square_root(T x) {
  using std::sqrt;
  return sqrt(x);
}

// The CPU's team: one member walks each phase's items in order, or in reverse (the tests' check that they
// are independent). Totals keep the one order whichever way.
struct SerialTeam {
  bool reversed = false;

  template <typename F>
  void each(int64_t n, F f) const {
    if (reversed) {
      for (int64_t i = n; i-- > 0;) f(i);
    } else {
      for (int64_t i = 0; i < n; ++i) f(i);
    }
  }
  template <typename F>
  void grid(int64_t rows, int64_t cols, F f) const {
    each(rows, [&](int64_t r) { each(cols, [&](int64_t c) { f(r, c); }); });
  }
  template <typename T>
  void dots(int64_t rows, const T* A, const T* x, int64_t n, T* out) const {
    each(rows, [&](int64_t r) { out[r] = dot(A + r * n, x, n); });
  }
  template <typename T>
  void combine(int64_t rows, const T* w, const T* A, int64_t n, T* out) const {  // A's rows outer: contiguous
    each(n, [&](int64_t c) { out[c] = 0; });
    for (int64_t r = 0; r < rows; ++r) each(n, [&](int64_t c) { out[c] += w[r] * A[r * n + c]; });
  }
  template <typename T>
  T dot(const T* a, const T* b, int64_t n) const {
    return fwp::dot(a, b, n);
  }
  template <typename T, typename F>
  T sum(int64_t n, F f) const {
    T total = 0;
    for (int64_t i = 0; i < n; ++i) total += f(i);
    return total;
  }
};

// phi(x) of one head's vector x [d] into out [D]; r: scratch of 2 d.
template <typename T, typename Team>
FWP_STEP void feature_map(const Team& team, const StepOptions& o, const StepSizes& s, const T* x, T* out, T* r) {
  const int64_t d = s.d;
  switch (o.map) {
    case FeatureMap::kLinear:  // elu(x) + 1 (Eq. 30)
      team.each(d, [&](int64_t i) { out[i] = x[i] > T(0) ? x[i] + T(1) : exponential(x[i]); });
      return;
    case FeatureMap::kSiLU:
      team.each(d, [&](int64_t i) { out[i] = x[i] / (T(1) + exponential(-x[i])); });
      return;
    case FeatureMap::kDPFP: {  // r = [relu(x), relu(-x)]; block i: r * roll(r, i) (Eq. 37)
      const int64_t n = 2 * d;
      team.each(d, [&](int64_t j) {
        r[j] = larger(x[j], T(0));
        r[d + j] = larger(-x[j], T(0));
      });
      // roll(r, i)[j] = r[j - i], wrapping around (a select, not a remainder per element)
      team.grid(o.nu, n, [&](int64_t block, int64_t j) {
        const int64_t from = j - (block + 1);
        out[block * n + j] = r[j] * r[from < 0 ? from + n : from];
      });
      return;
    }
    case FeatureMap::kPerformer: {  // (2m)^-1/2 ([exp(P^T x - |x|^2/2); exp(-P^T x - |x|^2/2)] + 1e-4)
      const int64_t m = s.D / 2;
      const T* P = static_cast<const T*>(o.projection);
      team.each(d, [&](int64_t i) { r[i] = x[i] * T(o.input_scale); });
      const T half_sq = team.dot(r, r, d) * T(0.5);
      const T scale = T(1) / square_root(T(2 * m));
      team.each(m, [&](int64_t j) {
        T u = 0;
        for (int64_t i = 0; i < d; ++i) u += r[i] * P[i * m + j];
        out[j] = (exponential(u - half_sq) + T(1e-4)) * scale;
        out[m + j] = (exponential(-u - half_sq) + T(1e-4)) * scale;
      });
      return;
    }
  }
}

// Eq. 29 (sum) or L2 normalisation of phi [D], as feature_maps.normalize_features.
template <typename T, typename Team>
FWP_STEP void normalise(const Team& team, QKNorm how, int64_t D, T* phi) {
  if (how == QKNorm::kNone) return;
  const T total = team.template sum<T>(D, [&](int64_t i) { return how == QKNorm::kSum ? phi[i] : phi[i] * phi[i]; });
  const T eps = T(1e-6);
  const T denominator = how == QKNorm::kSum ? larger(total, eps) : larger(square_root(total), eps);
  team.each(D, [&](int64_t i) { phi[i] /= denominator; });
}

// The fast weight of one (row, head), as W [dv, D] itself (W[e, :] . phi is value channel e).
template <typename T>
struct DenseMemory {
  T* W;
  int64_t D, dv;

  template <typename Team>
  FWP_STEP void decay(const Team& team, T a) {
    team.grid(dv, D, [&](int64_t e, int64_t j) { W[e * D + j] *= a; });
  }
  template <typename Team>
  FWP_STEP void decay_columns(const Team& team, const T* a) {  // W Diag(a)
    team.grid(dv, D, [&](int64_t e, int64_t j) { W[e * D + j] *= a[j]; });
  }
  template <typename Team>
  FWP_STEP void apply(const Team& team, const T* x, T* out) const {  // out = W x
    team.dots(dv, W, x, D, out);
  }
  template <typename Team>
  FWP_STEP void write(const Team& team, const T* u, const T* key) {  // W <- W + u key^T
    team.grid(dv, D, [&](int64_t e, int64_t j) { W[e * D + j] += u[e] * key[j]; });
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

  template <typename Team>
  FWP_STEP void decay(const Team& team, T a) {  // a W = (a writes)^T keys
    team.each(t * dv, [&](int64_t i) { writes[i] *= a; });
  }
  template <typename Team>
  FWP_STEP void decay_columns(const Team& team, const T* a) {  // W Diag(a) = writes^T (keys Diag(a))
    team.grid(t, D, [&](int64_t i, int64_t j) { keys[i * D + j] *= a[j]; });
  }
  template <typename Team>
  FWP_STEP void apply(const Team& team, const T* x, T* out) const {  // out = writes^T (keys x)
    team.dots(t, keys, x, D, scores);
    team.combine(t, scores, writes, dv, out);
  }
  template <typename Team>
  FWP_STEP void write(const Team& team, const T* u, const T* key) {
    T* key_slot = keys + t * D;
    T* write_slot = writes + t * dv;
    team.each(D, [&](int64_t j) { key_slot[j] = key[j]; });
    team.each(dv, [&](int64_t e) { write_slot[e] = u[e]; });
    ++t;
  }
};

// Eqs. 19, 28: out / (z . phi(q) + eps), and 0 where z . phi(q) is 0 (phi(q) shares no feature with a key
// written, so W phi(q) is 0 too), as the layer's sequence forward computes it.
template <typename T, typename Team>
FWP_STEP void divide_by_normaliser(const Team& team, const StepOptions& o, int64_t D, int64_t dv, const T* z,
                                   const T* phi_q, T* out) {
  const T dot = team.dot(z, phi_q, D);
  const T normaliser = dot + T(o.eps);
  team.each(dv, [&](int64_t e) { out[e] = dot > T(0) ? out[e] / normaliser : T(0); });
}

// One (row, head): advances the memory (W, or its factors) and z [D] in place and writes out [dv].
// scratch: step_scratch(s, 0) numbers.
template <typename T, typename Team, typename Memory>
FWP_STEP void fused_step(const Team& team, const StepOptions& o, const StepSizes& s, const T* q, const T* k,
                         const T* v, const T* beta, const T* log_decay, Memory& memory, T* z, T* out, T* scratch) {
  const int64_t D = s.D, dv = s.dv, d = s.d;
  T* phi_q = scratch;
  T* phi_k = phi_q + D;
  T* key = phi_k + D;  // the key a write retrieves with: phi(k) (scaled, under Eqs. 26-28) or b * phi(k)
  T* r = key + D;
  T* u = r + 2 * d;
  T* retrieved = u + dv;
  feature_map(team, o, s, q, phi_q, r);
  normalise(team, o.qk_norm, D, phi_q);
  if (o.decay == Decay::kHead) {
    memory.decay(team, exponential(log_decay[0]));
  } else if (o.decay == Decay::kChannel) {  // W Diag(a): a per column
    team.each(D, [&](int64_t j) { key[j] = exponential(log_decay[j]); });
    memory.decay_columns(team, key);
  }
  for (int64_t n = 0; n < o.writes; ++n) {
    feature_map(team, o, s, k + n * d, phi_k, r);
    normalise(team, o.qk_norm, D, phi_k);
    T strength = o.write == Write::kDelta ? beta[n] : T(1);
    const bool scaled = o.attention_normalization && o.normalised_retrieval;
    T divisor = 1;
    if (scaled) {  // Eqs. 26-28: k' = phi(k) / (d + eps), beta' = beta d
      const T z_sum = team.template sum<T>(D, [&](int64_t j) { return z[j]; });
      const T scale = z_sum > T(0) ? team.dot(z, phi_k, D) : T(1);
      divisor = scale + T(o.eps);
      strength *= scale;
    }
    team.each(D, [&](int64_t j) {
      key[j] = (scaled ? phi_k[j] / divisor : phi_k[j]) * (o.write == Write::kEraseWrite ? beta[j] : T(1));
      if (o.attention_normalization) z[j] += phi_k[j];
    });
    if (o.write != Write::kSum) memory.apply(team, key, retrieved);
    team.each(dv, [&](int64_t e) {
      const T written = o.write == Write::kEraseWrite ? beta[D + e] * v[n * dv + e] : v[n * dv + e];
      u[e] = o.write == Write::kSum ? written
             : o.write == Write::kDelta ? strength * (written - retrieved[e])
                                        : written - retrieved[e];
    });
    memory.write(team, u, o.write == Write::kEraseWrite || !scaled ? phi_k : key);
  }
  memory.apply(team, phi_q, out);
  if (o.attention_normalization) divide_by_normaliser(team, o, D, dv, z, phi_q, out);
}

// One (row, head) of a read of a source memory (encoder-decoder attention, Eq. 15's W read by a query): out [dv]
// = W phi(q), the memory W or its factors, divided by z . phi(q) + eps under attention normalisation (Eq. 19).
// scratch: read_scratch(s, 0) numbers.
template <typename T, typename Team, typename Memory>
FWP_STEP void fused_read(const Team& team, const StepOptions& o, const StepSizes& s, const T* q, const Memory& memory,
                         const T* z, T* out, T* scratch) {
  T* phi_q = scratch;
  feature_map(team, o, s, q, phi_q, phi_q + s.D);
  normalise(team, o.qk_norm, s.D, phi_q);
  memory.apply(team, phi_q, out);
  if (o.attention_normalization) divide_by_normaliser(team, o, s.D, s.dv, z, phi_q, out);
}

// Calls f(memory) with the memory of index `which`: DenseMemory where tensors.W is given, else FactoredMemory
// of x.t tokens (scores: scratch of slots).
template <typename T, typename F>
FWP_STEP void with_memory(const StepTensors& x, const StepSizes& s, int64_t which, T* scores, F f) {
  if (x.W != nullptr) {
    DenseMemory<T> memory{static_cast<T*>(x.W) + which * s.dv * s.D, s.D, s.dv};
    f(memory);
  } else {
    FactoredMemory<T> memory{static_cast<T*>(x.keys) + which * x.slots * s.D,
                             static_cast<T*>(x.writes) + which * x.slots * s.dv, x.t, s.D, s.dv, scores};
    f(memory);
  }
}

template <typename T>
FWP_STEP const T* slice(const void* base, int64_t i, int64_t size) {
  return base == nullptr ? nullptr : static_cast<const T*>(base) + i * size;
}

// The step of (row, head) i of a fused call; scratch: step_scratch(s, x.slots).
template <typename T, typename Team>
FWP_STEP void step_of(const Team& team, const StepOptions& o, const StepSizes& s, const StepTensors& x, int64_t i,
                      T* scratch) {
  with_memory<T>(x, s, i, scratch + step_scratch(s, 0), [&](auto& memory) {
    fused_step(team, o, s, slice<T>(x.q, i, s.d), slice<T>(x.k, i, x.N * s.d), slice<T>(x.v, i, x.N * s.dv),
               slice<T>(x.beta, i, x.beta_size), slice<T>(x.log_decay, i, x.decay_size), memory,
               x.z == nullptr ? nullptr : static_cast<T*>(x.z) + i * s.D, static_cast<T*>(x.out) + i * s.dv,
               scratch);
  });
}

// The read of (row, head) i of a fused call, from its source memory; scratch: read_scratch(s, x.slots).
template <typename T, typename Team>
FWP_STEP void read_of(const Team& team, const StepOptions& o, const StepSizes& s, const StepTensors& x, int64_t i,
                      T* scratch) {
  const int64_t source = (i / x.heads) / x.rows_per_memory * x.heads + i % x.heads;  // (its memory's row, head)
  with_memory<T>(x, s, source, scratch + read_scratch(s, 0), [&](const auto& memory) {
    fused_read(team, o, s, slice<T>(x.q, i, s.d), memory, slice<T>(x.z, source, s.D),
               static_cast<T*>(x.out) + i * s.dv, scratch);
  });
}

}  // namespace fwp

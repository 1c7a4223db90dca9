// The fast-weight kernels' interface: plain pointers and sizes, no torch.
//
// Included by fast_weight_cuda.cu (CUDA headers only, so `nvcc -c` compiles it
// on a machine without a GPU or a CUDA build of torch) and by the torch glue in
// fast_weight.cpp. The CPU twin (fast_weight_twin.h) takes the same struct.
//
// Layouts (contiguous): q, k [BH, T, D]; v, u [BH, T, Dv]; beta [BH, T];
// fast weight W [BH, Dv, D] (row e of W is read as W[e, :] . phi).
// Row e of W evolves independently of the others (Eqs. 17, 20, 24, 25 act on
// each row with the same k_t, q_t, beta_t), so the work is tiled by rows: one
// thread block (or one CPU task) owns `rows` consecutive rows of one (b, h).
#pragma once

#include <cstdint>

namespace fwp {

enum class Dtype : int { kFloat32 = 0, kFloat64 = 1, kFloat16 = 2, kBFloat16 = 3 };

struct Problem {
  int64_t BH;  // batch * heads
  int64_t T;   // time steps
  int64_t D;   // key/query feature size (<= kMaxFeatures on the GPU)
  int64_t Dv;  // value size (rows of W)
  int64_t chunk;  // the state is checkpointed before every `chunk`-th step
  int64_t rows;   // rows of W per tile (one warp per row on the GPU)
  bool delta;     // delta rule (Eqs. 20, 24) if true, sum rule (Eq. 17) if false
};

#if defined(__CUDACC__)
#define FWP_HOST_DEVICE __host__ __device__
#else
#define FWP_HOST_DEVICE
#endif

constexpr int64_t kMaxFeatures = 512;

// sum_i a[i] b[i]: the CPU twin's and the fused step's dot product. Eight partial sums: one running
// sum waits on each addition before the next, eight independent ones fill a SIMD register (-O3
// vectorizes them without reordering any one sum).
template <typename T>
FWP_HOST_DEVICE T dot(const T* a, const T* b, int64_t n) {
  T part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    for (int j = 0; j < 8; ++j) part[j] += a[i + j] * b[i + j];
  T total = 0;
  for (; i < n; ++i) total += a[i] * b[i];
  for (int j = 0; j < 8; ++j) total += part[j];
  return total;
}

FWP_HOST_DEVICE inline int64_t num_chunks(const Problem& p) { return (p.T + p.chunk - 1) / p.chunk; }
FWP_HOST_DEVICE inline int64_t num_tiles(const Problem& p) { return (p.Dv + p.rows - 1) / p.rows; }

// On the GPU each row of W is one warp; each lane holds E features, E =
// ceil(D / 32) rounded up to a power of two (one kernel instantiation per E).
constexpr int64_t kWarpSize = 32;
inline int64_t features_per_lane(int64_t D) {
  int64_t E = 1;
  while (E * kWarpSize < D) E *= 2;
  return E;
}

// Dynamic shared memory of one thread block in bytes (acc_size: the size of
// the accumulation type). The forward stages k and q for a chunk of steps;
// the backward also keeps two row buffers per warp and the tile's per-step
// partial sums. The launchers and fairseq_fwp/ops/cuda.py (through the
// extension) read these, so the limit check and the launch agree.
inline int64_t forward_shared_bytes(const Problem& p, int64_t acc_size) {
  return 2 * p.chunk * kWarpSize * features_per_lane(p.D) * acc_size;
}
inline int64_t backward_shared_bytes(const Problem& p, int64_t acc_size) {
  const int64_t padded = kWarpSize * features_per_lane(p.D);
  return (2 * p.chunk * padded + 2 * p.rows * padded + p.rows * p.chunk + p.rows) * acc_size;
}

// Forward buffers. `scalar` tensors have the input dtype; `acc` tensors are
// float32 (float64 for float64 inputs). checkpoints [BH, ceil(T/chunk), Dv, D]
// and u [BH, T, Dv] (the delta rule's pseudo-values beta_t (v_t - vbar_t)) are
// written only when non-null: they are what the backward pass needs.
struct ForwardArgs {
  const void* q;      // scalar
  const void* k;      // scalar
  const void* v;      // scalar
  const void* beta;   // scalar, null for the sum rule
  const void* W0;     // acc
  void* out;          // scalar [BH, T, Dv]
  void* W_final;      // acc
  void* checkpoints;  // acc or null
  void* u;            // acc or null (delta only)
};

// Backward buffers. Gradients that sum over rows of W (dq, dk, dbeta) are
// written per tile and summed over tiles by the caller, in a fixed order:
// no atomics, so results are deterministic.
struct BackwardArgs {
  const void* q;            // scalar
  const void* k;            // scalar
  const void* v;            // scalar
  const void* beta;         // scalar, null for the sum rule
  const void* d_out;        // scalar [BH, T, Dv]
  const void* dW_final;     // acc
  const void* checkpoints;  // acc
  const void* u;            // acc (delta only)
  void* dq_tiles;           // acc [tiles, BH, T, D]
  void* dk_tiles;           // acc [tiles, BH, T, D]
  void* dbeta_tiles;        // acc [tiles, BH, T] (delta only)
  void* dv;                 // acc [BH, T, Dv]
  void* dW0;                // acc [BH, Dv, D]
};

}  // namespace fwp

// CUDA kernels of the fast-weight ops: sum rule (Eq. 17 + Eq. 11) and delta
// rule (Eqs. 20, 24, 25), forward and backward. CUDA headers only.
//
// Work split: one thread block per (b, h, tile of `rows` rows of W), one warp
// per row, each lane holding E = ceil(D / 32) features of its row in
// registers. Rows are independent (every row sees the same k_t, q_t, beta_t),
// so the fast weight never has to fit one block's shared memory: D up to 512
// and any Dv. Dot products over a row are warp butterflies (every lane gets
// the same bits, no atomics).
//
// Forward: steps run in order; k and q are staged in shared memory one chunk
// of `chunk` steps at a time, between two barriers. Before each chunk the
// row is checkpointed (if asked), and the delta rule's pseudo-values
// u_t = beta_t (v_t - vbar_t) are saved: O(T / chunk) states, no per-step W.
//
// Backward: chunks in reverse. Within a chunk, W_{t-1} is rebuilt from the
// chunk's checkpoint by replaying the saved writes in the forward's order
// with the same fused multiply-adds, so it has the forward's exact bits (no
// rewinding by subtraction). Gradients that sum over rows (dq, dk, dbeta) are
// reduced across the tile's warps through shared memory in a fixed order and
// written per tile; the caller sums the tiles. Deterministic throughout.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "fast_weight_cuda.h"

namespace fwp {
namespace {

constexpr int kWarp = static_cast<int>(kWarpSize);

template <typename scalar_t> struct AccumulatorOf { using type = float; };
template <> struct AccumulatorOf<double> { using type = double; };

__device__ __forceinline__ float load(const float* p) { return *p; }
__device__ __forceinline__ double load(const double* p) { return *p; }
__device__ __forceinline__ float load(const __half* p) { return __half2float(*p); }
__device__ __forceinline__ float load(const __nv_bfloat16* p) { return __bfloat162float(*p); }

__device__ __forceinline__ void store(float* p, float x) { *p = x; }
__device__ __forceinline__ void store(double* p, double x) { *p = x; }
__device__ __forceinline__ void store(__half* p, float x) { *p = __float2half_rn(x); }
__device__ __forceinline__ void store(__nv_bfloat16* p, float x) { *p = __float2bfloat16_rn(x); }

// One explicit FMA for every write to W, in the forward and in the backward's
// replay alike: that is what makes the replayed W bit-identical.
__device__ __forceinline__ float fused(float a, float b, float c) { return fmaf(a, b, c); }
__device__ __forceinline__ double fused(double a, double b, double c) { return fma(a, b, c); }

template <typename acc_t>
__device__ __forceinline__ acc_t warp_sum(acc_t x) {
#pragma unroll
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// Lane `lane` holds features d = lane + 32 i, i < E, of a row. Staged vectors
// in shared memory are zero-padded to 32 E features, so padded features of W
// stay zero and the inner loops need no bounds checks.
template <typename acc_t, int E>
__device__ __forceinline__ acc_t row_dot(const acc_t (&w)[E], const acc_t* x, int lane) {
  acc_t s = 0;
#pragma unroll
  for (int i = 0; i < E; ++i) s = fused(w[i], x[lane + kWarp * i], s);
  return warp_sum(s);
}

// w += u x (Eq. 17 / Eq. 24 with x = k_t).
template <typename acc_t, int E>
__device__ __forceinline__ void write_row(acc_t (&w)[E], acc_t u, const acc_t* x, int lane) {
#pragma unroll
  for (int i = 0; i < E; ++i) w[i] = fused(u, x[lane + kWarp * i], w[i]);
}

template <typename acc_t, int E>
__device__ __forceinline__ void load_row(acc_t (&w)[E], const acc_t* src, int64_t D, int lane) {
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const int64_t d = lane + kWarp * i;
    w[i] = d < D ? src[d] : acc_t(0);
  }
}

template <typename acc_t, int E>
__device__ __forceinline__ void store_row(const acc_t (&w)[E], acc_t* dst, int64_t D, int lane) {
#pragma unroll
  for (int i = 0; i < E; ++i) {
    const int64_t d = lane + kWarp * i;
    if (d < D) dst[d] = w[i];
  }
}

// Copy `len` vectors of size D from global memory (any input dtype) into
// shared memory as acc_t, padded with zeros to `padded` features. All threads.
template <typename scalar_t, typename acc_t>
__device__ void stage(acc_t* dst, const scalar_t* src, int len, int64_t D, int padded) {
  for (int idx = threadIdx.x; idx < len * padded; idx += blockDim.x) {
    const int j = idx / padded, d = idx % padded;
    dst[idx] = d < D ? acc_t(load(src + j * D + d)) : acc_t(0);
  }
}

struct Tile {
  int64_t bh, index, row;
  int warp, lane;
  bool has_row;
};

__device__ __forceinline__ Tile locate(const Problem& p) {
  const int64_t tiles = num_tiles(p);
  Tile t;
  t.bh = blockIdx.x / tiles;
  t.index = blockIdx.x % tiles;
  t.warp = threadIdx.x / kWarp;
  t.lane = threadIdx.x % kWarp;
  t.row = t.index * p.rows + t.warp;
  t.has_row = t.row < p.Dv;
  return t;
}

template <typename scalar_t, int E, bool DELTA>
__global__ void forward_kernel(Problem p, ForwardArgs a) {
  using acc_t = typename AccumulatorOf<scalar_t>::type;
  constexpr int kPadded = kWarp * E;
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  acc_t* k_chunk = reinterpret_cast<acc_t*>(shared_bytes);  // [chunk][kPadded]
  acc_t* q_chunk = k_chunk + p.chunk * kPadded;              // [chunk][kPadded]

  const Tile tile = locate(p);
  const int64_t T = p.T, D = p.D, Dv = p.Dv, e = tile.row;
  const scalar_t* q = static_cast<const scalar_t*>(a.q) + tile.bh * T * D;
  const scalar_t* k = static_cast<const scalar_t*>(a.k) + tile.bh * T * D;
  const scalar_t* v = static_cast<const scalar_t*>(a.v) + tile.bh * T * Dv;
  const scalar_t* beta = DELTA ? static_cast<const scalar_t*>(a.beta) + tile.bh * T : nullptr;
  scalar_t* out = static_cast<scalar_t*>(a.out) + tile.bh * T * Dv;
  acc_t* u_saved = a.u ? static_cast<acc_t*>(a.u) + tile.bh * T * Dv : nullptr;
  acc_t* checkpoints = static_cast<acc_t*>(a.checkpoints);

  acc_t w[E];
  if (tile.has_row) load_row(w, static_cast<const acc_t*>(a.W0) + (tile.bh * Dv + e) * D, D, tile.lane);

  for (int64_t start = 0; start < T; start += p.chunk) {
    const int len = static_cast<int>(T - start < p.chunk ? T - start : p.chunk);
    __syncthreads();  // every warp is done reading the previous chunk
    stage(k_chunk, k + start * D, len, D, kPadded);
    stage(q_chunk, q + start * D, len, D, kPadded);
    __syncthreads();
    if (!tile.has_row) continue;
    if (checkpoints) {
      const int64_t n = start / p.chunk;
      store_row(w, checkpoints + ((tile.bh * num_chunks(p) + n) * Dv + e) * D, D, tile.lane);
    }
    for (int j = 0; j < len; ++j) {
      const int64_t t = start + j;
      const acc_t* k_t = k_chunk + j * kPadded;
      acc_t u = load(v + t * Dv + e);
      if (DELTA) {
        const acc_t vbar = row_dot(w, k_t, tile.lane);  // Eq. 20: the value stored under k_t
        u = acc_t(load(beta + t)) * (u - vbar);         // Eq. 24: W_t = W_{t-1} + u_t k_t^T
        if (u_saved && tile.lane == 0) u_saved[t * Dv + e] = u;
      }
      write_row(w, u, k_t, tile.lane);
      const acc_t o = row_dot(w, q_chunk + j * kPadded, tile.lane);  // Eq. 11 / 25: read W_t
      if (tile.lane == 0) store(out + t * Dv + e, o);
    }
  }
  if (tile.has_row) store_row(w, static_cast<acc_t*>(a.W_final) + (tile.bh * Dv + e) * D, D, tile.lane);
}

template <typename scalar_t, int E, bool DELTA>
__global__ void backward_kernel(Problem p, BackwardArgs a) {
  using acc_t = typename AccumulatorOf<scalar_t>::type;
  constexpr int kPadded = kWarp * E;
  const int rows = static_cast<int>(p.rows);
  extern __shared__ __align__(16) unsigned char shared_bytes[];
  acc_t* k_chunk = reinterpret_cast<acc_t*>(shared_bytes);  // [chunk][kPadded]
  acc_t* q_chunk = k_chunk + p.chunk * kPadded;              // [chunk][kPadded]
  acc_t* dq_rows = q_chunk + p.chunk * kPadded;              // [rows][kPadded]
  acc_t* dk_rows = dq_rows + rows * kPadded;                 // [rows][kPadded]
  acc_t* u_chunk = dk_rows + rows * kPadded;                 // [rows][chunk]
  acc_t* dbeta_rows = u_chunk + rows * p.chunk;              // [rows]

  const Tile tile = locate(p);
  const int64_t T = p.T, D = p.D, Dv = p.Dv, e = tile.row;
  const int lane = tile.lane;
  const scalar_t* q = static_cast<const scalar_t*>(a.q) + tile.bh * T * D;
  const scalar_t* k = static_cast<const scalar_t*>(a.k) + tile.bh * T * D;
  const scalar_t* v = static_cast<const scalar_t*>(a.v) + tile.bh * T * Dv;
  const scalar_t* beta = DELTA ? static_cast<const scalar_t*>(a.beta) + tile.bh * T : nullptr;
  const scalar_t* d_out = static_cast<const scalar_t*>(a.d_out) + tile.bh * T * Dv;
  const acc_t* u_saved = DELTA ? static_cast<const acc_t*>(a.u) + tile.bh * T * Dv : nullptr;
  const acc_t* checkpoints = static_cast<const acc_t*>(a.checkpoints);
  const int64_t tile_offset = tile.index * p.BH + tile.bh;
  acc_t* dq_tile = static_cast<acc_t*>(a.dq_tiles) + tile_offset * T * D;
  acc_t* dk_tile = static_cast<acc_t*>(a.dk_tiles) + tile_offset * T * D;
  acc_t* dbeta_tile = DELTA ? static_cast<acc_t*>(a.dbeta_tiles) + tile_offset * T : nullptr;
  acc_t* dv = static_cast<acc_t*>(a.dv) + tile.bh * T * Dv;
  acc_t* my_u = u_chunk + tile.warp * p.chunk;

  acc_t dw[E];  // gradient reaching W_t (this row), starting from dL/dW_T
  if (tile.has_row) load_row(dw, static_cast<const acc_t*>(a.dW_final) + (tile.bh * Dv + e) * D, D, lane);

  for (int64_t n = num_chunks(p) - 1; n >= 0; --n) {
    const int64_t start = n * p.chunk;
    const int len = static_cast<int>(T - start < p.chunk ? T - start : p.chunk);
    __syncthreads();
    stage(k_chunk, k + start * D, len, D, kPadded);
    stage(q_chunk, q + start * D, len, D, kPadded);
    if (tile.has_row) {
      for (int j = lane; j < len; j += kWarp)  // the chunk's writes u_j (the sum rule writes v_j)
        my_u[j] = DELTA ? u_saved[(start + j) * Dv + e] : acc_t(load(v + (start + j) * Dv + e));
    }
    __syncthreads();
    acc_t w_start[E];
    if (tile.has_row) load_row(w_start, checkpoints + ((tile.bh * num_chunks(p) + n) * Dv + e) * D, D, lane);

    for (int j = len - 1; j >= 0; --j) {
      const int64_t t = start + j;
      const acc_t* k_t = k_chunk + j * kPadded;
      const acc_t* q_t = q_chunk + j * kPadded;
      acc_t dbeta = 0;
      if (tile.has_row) {
        acc_t w_prev[E];  // W_{t-1}: the checkpoint plus the chunk's writes before t, in order
#pragma unroll
        for (int i = 0; i < E; ++i) w_prev[i] = w_start[i];
        for (int i = 0; i < j; ++i) write_row(w_prev, my_u[i], k_chunk + i * kPadded, lane);
        const acc_t u = my_u[j];
        const acc_t g = load(d_out + t * Dv + e);
#pragma unroll
        for (int i = 0; i < E; ++i) dw[i] = fused(g, q_t[lane + kWarp * i], dw[i]);  // out_t = W_t q_t
        const acc_t du = row_dot(dw, k_t, lane);  // W_t = W_{t-1} + u_t k_t^T
        acc_t dvbar = 0;
        if (DELTA) {
          const acc_t b = load(beta + t);
          const acc_t vbar = row_dot(w_prev, k_t, lane);  // bit-identical to the forward's
          dbeta = du * (acc_t(load(v + t * Dv + e)) - vbar);
          dvbar = -b * du;  // vbar_t = W_{t-1} k_t, u_t = beta_t (v_t - vbar_t)
          if (lane == 0) dv[t * Dv + e] = b * du;
        } else if (lane == 0) {
          dv[t * Dv + e] = du;
        }
#pragma unroll
        for (int i = 0; i < E; ++i) {
          const int d = lane + kWarp * i;
          const acc_t w_t = fused(u, k_t[d], w_prev[i]);  // as written in the forward
          dq_rows[tile.warp * kPadded + d] = g * w_t;
          dk_rows[tile.warp * kPadded + d] = u * dw[i] + dvbar * w_prev[i];
          dw[i] = fused(dvbar, k_t[d], dw[i]);  // now dL/dW_{t-1}
        }
      } else {
        for (int i = 0; i < E; ++i) {
          dq_rows[tile.warp * kPadded + lane + kWarp * i] = 0;
          dk_rows[tile.warp * kPadded + lane + kWarp * i] = 0;
        }
      }
      if (lane == 0) dbeta_rows[tile.warp] = dbeta;
      __syncthreads();
      // Sum over the tile's rows in row order: deterministic.
      for (int idx = threadIdx.x; idx < 2 * D; idx += blockDim.x) {
        const bool is_k = idx >= D;
        const int d = is_k ? idx - static_cast<int>(D) : idx;
        const acc_t* src = is_k ? dk_rows : dq_rows;
        acc_t sum = 0;
        for (int r = 0; r < rows; ++r) sum += src[r * kPadded + d];
        (is_k ? dk_tile : dq_tile)[t * D + d] = sum;
      }
      if (DELTA && threadIdx.x == 0) {
        acc_t sum = 0;
        for (int r = 0; r < rows; ++r) sum += dbeta_rows[r];
        dbeta_tile[t] = sum;
      }
      __syncthreads();  // the row buffers are rewritten by the next step
    }
  }
  if (tile.has_row) store_row(dw, static_cast<acc_t*>(a.dW0) + (tile.bh * Dv + e) * D, D, lane);
}

// Above 48 KiB a kernel must opt in to dynamic shared memory.
template <typename Kernel>
cudaError_t allow_shared_memory(Kernel kernel, size_t bytes) {
  if (bytes <= 48 * 1024) return cudaSuccess;
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

struct ForwardLaunch {
  const Problem& p;
  const ForwardArgs& a;
  cudaStream_t stream;
  template <typename scalar_t, int E, bool DELTA>
  cudaError_t run() const {
    using acc_t = typename AccumulatorOf<scalar_t>::type;
    const size_t shared = static_cast<size_t>(forward_shared_bytes(p, sizeof(acc_t)));
    auto kernel = forward_kernel<scalar_t, E, DELTA>;
    const cudaError_t err = allow_shared_memory(kernel, shared);
    if (err != cudaSuccess) return err;
    kernel<<<static_cast<unsigned>(p.BH * num_tiles(p)), static_cast<unsigned>(p.rows * kWarp), shared, stream>>>(p, a);
    return cudaGetLastError();
  }
};

struct BackwardLaunch {
  const Problem& p;
  const BackwardArgs& a;
  cudaStream_t stream;
  template <typename scalar_t, int E, bool DELTA>
  cudaError_t run() const {
    using acc_t = typename AccumulatorOf<scalar_t>::type;
    const size_t shared = static_cast<size_t>(backward_shared_bytes(p, sizeof(acc_t)));
    auto kernel = backward_kernel<scalar_t, E, DELTA>;
    const cudaError_t err = allow_shared_memory(kernel, shared);
    if (err != cudaSuccess) return err;
    kernel<<<static_cast<unsigned>(p.BH * num_tiles(p)), static_cast<unsigned>(p.rows * kWarp), shared, stream>>>(p, a);
    return cudaGetLastError();
  }
};

template <typename scalar_t, int E, typename Launch>
cudaError_t with_rule(bool delta, const Launch& launch) {
  return delta ? launch.template run<scalar_t, E, true>() : launch.template run<scalar_t, E, false>();
}

// Registers per lane grow with E = ceil(D / 32): one instantiation per power of two.
template <typename scalar_t, typename Launch>
cudaError_t with_width(const Problem& p, const Launch& launch) {
  if (p.D <= 32) return with_rule<scalar_t, 1>(p.delta, launch);
  if (p.D <= 64) return with_rule<scalar_t, 2>(p.delta, launch);
  if (p.D <= 128) return with_rule<scalar_t, 4>(p.delta, launch);
  if (p.D <= 256) return with_rule<scalar_t, 8>(p.delta, launch);
  if (p.D <= kMaxFeatures) return with_rule<scalar_t, 16>(p.delta, launch);
  return cudaErrorInvalidValue;
}

template <typename Launch>
cudaError_t with_dtype(Dtype dtype, const Problem& p, const Launch& launch) {
  switch (dtype) {
    case Dtype::kFloat32: return with_width<float>(p, launch);
    case Dtype::kFloat64: return with_width<double>(p, launch);
    case Dtype::kFloat16: return with_width<__half>(p, launch);
    case Dtype::kBFloat16: return with_width<__nv_bfloat16>(p, launch);
  }
  return cudaErrorInvalidValue;
}

}  // namespace

cudaError_t forward_cuda(Dtype dtype, const Problem& p, const ForwardArgs& a, cudaStream_t stream) {
  if (p.BH == 0 || p.T == 0 || p.Dv == 0) return cudaSuccess;
  return with_dtype(dtype, p, ForwardLaunch{p, a, stream});
}

cudaError_t backward_cuda(Dtype dtype, const Problem& p, const BackwardArgs& a, cudaStream_t stream) {
  if (p.BH == 0 || p.T == 0 || p.Dv == 0) return cudaSuccess;
  return with_dtype(dtype, p, BackwardLaunch{p, a, stream});
}

}  // namespace fwp

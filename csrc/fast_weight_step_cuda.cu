// The fused decoding step and read (fast_weight_step.h) on the GPU: one thread block per (row, head), whose
// threads are the team that runs the step's phases, its scratch and the totals' partial sums in shared memory.
// Decoding at small batches is bound by launches, not by arithmetic: this is one launch per layer and step in
// place of the two dozen small ops of the rule's own step. CUDA headers only.
#include <cuda_runtime.h>

#include "fast_weight_cuda.h"
#include "fast_weight_step.h"

namespace fwp {
namespace {

constexpr int kThreads = 128;
constexpr int kLanes = 32;
constexpr int kWarps = kThreads / kLanes;

template <typename T>
__device__ __forceinline__ T warp_total(T x) {
#pragma unroll
  for (int offset = kLanes / 2; offset > 0; offset >>= 1) x += __shfl_xor_sync(0xffffffffu, x, offset);
  return x;
}

// A thread block as fast_weight_step.h's team. A phase's items go to consecutive threads; the rows of a grid
// and of dots go to warps, their columns to lanes (a warp touches a row's consecutive numbers); every phase
// and every total ends at a barrier. Totals add the warps' partial sums in warp order: every thread gets the same.
struct BlockTeam {
  void* partials;  // shared, one per warp

  template <typename F>
  __device__ void each(int64_t n, F f) const {
    for (int64_t i = threadIdx.x; i < n; i += kThreads) f(i);
    __syncthreads();
  }
  template <typename F>
  __device__ void grid(int64_t rows, int64_t cols, F f) const {  // rows to warps, as dots: no division per item
    const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
    for (int64_t r = warp; r < rows; r += kWarps)
      for (int64_t c = lane; c < cols; c += kLanes) f(r, c);
    __syncthreads();
  }
  template <typename T>
  __device__ void dots(int64_t rows, const T* A, const T* x, int64_t n, T* out) const {
    const int warp = threadIdx.x / kLanes, lane = threadIdx.x % kLanes;
    for (int64_t r = warp; r < rows; r += kWarps) {
      T part = 0;
      for (int64_t c = lane; c < n; c += kLanes) part += A[r * n + c] * x[c];
      part = warp_total(part);
      if (lane == 0) out[r] = part;
    }
    __syncthreads();
  }
  template <typename T>
  __device__ void combine(int64_t rows, const T* w, const T* A, int64_t n, T* out) const {
    each(n, [&](int64_t c) {
      T total = 0;
      for (int64_t r = 0; r < rows; ++r) total += w[r] * A[r * n + c];
      out[c] = total;
    });
  }
  template <typename T>
  __device__ T dot(const T* a, const T* b, int64_t n) const {
    return sum<T>(n, [&](int64_t i) { return a[i] * b[i]; });
  }
  template <typename T, typename F>
  __device__ T sum(int64_t n, F f) const {
    T part = 0;
    for (int64_t i = threadIdx.x; i < n; i += kThreads) part += f(i);
    part = warp_total(part);
    T* parts = static_cast<T*>(partials);
    if (threadIdx.x % kLanes == 0) parts[threadIdx.x / kLanes] = part;
    __syncthreads();
    T total = 0;
    for (int w = 0; w < kWarps; ++w) total += parts[w];
    __syncthreads();  // every thread has read the partial sums before the next total writes them
    return total;
  }
};

template <typename T, bool kRead>
__global__ void __launch_bounds__(kThreads) fused_kernel(StepOptions o, StepSizes s, StepTensors x) {
  extern __shared__ __align__(16) unsigned char shared[];
  T* scratch = reinterpret_cast<T*>(shared);
  const BlockTeam team{scratch + (kRead ? read_scratch(s, x.slots) : step_scratch(s, x.slots))};
  if constexpr (kRead) {
    read_of<T>(team, o, s, x, blockIdx.x, scratch);
  } else {
    step_of<T>(team, o, s, x, blockIdx.x, scratch);
  }
}

template <typename T>
cudaError_t launch(bool read, const StepOptions& o, const StepSizes& s, const StepTensors& x, int64_t RH,
                   cudaStream_t stream) {
  auto kernel = read ? fused_kernel<T, true> : fused_kernel<T, false>;
  const int64_t numbers = (read ? read_scratch(s, x.slots) : step_scratch(s, x.slots)) + kWarps;
  const size_t bytes = static_cast<size_t>(numbers) * sizeof(T);
  if (bytes > 48 * 1024) {  // past the default: ask for it (the device refuses what it does not have)
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                                 static_cast<int>(bytes));
    if (err != cudaSuccess) return err;
  }
  kernel<<<static_cast<unsigned>(RH), kThreads, bytes, stream>>>(o, s, x);
  return cudaGetLastError();
}

}  // namespace

cudaError_t fused_cuda(Dtype dtype, bool read, const StepOptions& o, const StepSizes& s, const StepTensors& x,
                       int64_t RH, cudaStream_t stream) {
  if (RH == 0 || s.dv == 0) return cudaSuccess;
  switch (dtype) {
    case Dtype::kFloat32: return launch<float>(read, o, s, x, RH, stream);
    case Dtype::kFloat64: return launch<double>(read, o, s, x, RH, stream);
    default: return cudaErrorInvalidValue;  // the step is float32 and float64 (fused_step.py)
  }
}

}  // namespace fwp

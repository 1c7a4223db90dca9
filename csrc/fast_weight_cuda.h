// Launchers of the CUDA kernels (fast_weight_cuda.cu, fast_weight_step_cuda.cu). CUDA runtime types only.
#pragma once

#include <cuda_runtime_api.h>

#include "fast_weight.h"
#include "fast_weight_step.h"

namespace fwp {

// Each returns the first CUDA error (launch or shared-memory configuration),
// or cudaSuccess. The kernels are asynchronous on `stream`.
cudaError_t forward_cuda(Dtype dtype, const Problem& p, const ForwardArgs& a, cudaStream_t stream);
cudaError_t backward_cuda(Dtype dtype, const Problem& p, const BackwardArgs& a, cudaStream_t stream);
// The fused decoding step (read: the read of source memories) of every (row, head) i < RH (fast_weight_step.h's
// step_of, read_of), float32 or float64.
cudaError_t fused_cuda(Dtype dtype, bool read, const StepOptions& o, const StepSizes& s, const StepTensors& x,
                       int64_t RH, cudaStream_t stream);

}  // namespace fwp

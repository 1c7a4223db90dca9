// Launchers of the CUDA kernels (fast_weight_cuda.cu). CUDA runtime types only.
#pragma once

#include <cuda_runtime_api.h>

#include "fast_weight.h"

namespace fwp {

// Each returns the first CUDA error (launch or shared-memory configuration),
// or cudaSuccess. The kernels are asynchronous on `stream`.
cudaError_t forward_cuda(Dtype dtype, const Problem& p, const ForwardArgs& a, cudaStream_t stream);
cudaError_t backward_cuda(Dtype dtype, const Problem& p, const BackwardArgs& a, cudaStream_t stream);

}  // namespace fwp

// torch glue of the fast-weight kernels: checks, buffers, dispatch to the CUDA
// launchers (fast_weight_cuda.cu, fast_weight_step_cuda.cu, when built with
// FWP_WITH_CUDA) or to the CPU twin (fast_weight_twin.h) and the CPU's fused
// decoding step (fast_weight_step.h). Autograd lives in fairseq_fwp/ops/cuda.py.
// ATen and pybind11 with torch's tensor casters: all this file uses of torch/extension.h, which takes the
// compiler about twice as long (54 s against 30 s on one core).
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "fast_weight.h"
#include "fast_weight_step.h"
#include "fast_weight_twin.h"

#ifdef FWP_WITH_CUDA
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "fast_weight_cuda.h"
#endif

namespace {

at::ScalarType accumulation_type(const at::Tensor& x) {
  return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
}

void check_tensor(const at::Tensor& x, const char* name, const at::Tensor& q, at::ScalarType dtype) {
  TORCH_CHECK(x.is_contiguous(), name, " must be contiguous");
  TORCH_CHECK(x.device() == q.device(), name, " is on ", x.device(), ", but q is on ", q.device());
  TORCH_CHECK(x.scalar_type() == dtype, name, " has dtype ", x.scalar_type(), ", expected ", dtype);
}

fwp::Problem make_problem(const at::Tensor& q, const at::Tensor& v, int64_t chunk, int64_t rows, bool delta) {
  TORCH_CHECK(q.dim() == 4 && v.dim() == 4, "q and v must be [B, H, T, D] and [B, H, T, Dv]");
  TORCH_CHECK(chunk >= 1 && rows >= 1, "chunk and rows must be >= 1");
  fwp::Problem p;
  p.BH = q.size(0) * q.size(1);
  p.T = q.size(2);
  p.D = q.size(3);
  p.Dv = v.size(3);
  p.chunk = chunk;
  p.rows = rows;
  p.delta = delta;
  return p;
}

#ifdef FWP_WITH_CUDA
fwp::Dtype kernel_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat: return fwp::Dtype::kFloat32;
    case at::kDouble: return fwp::Dtype::kFloat64;
    case at::kHalf: return fwp::Dtype::kFloat16;
    case at::kBFloat16: return fwp::Dtype::kBFloat16;
    default: TORCH_CHECK(false, "unsupported dtype ", t);
  }
}

void check_cuda(cudaError_t err, const char* what) {
  TORCH_CHECK(err == cudaSuccess, "fast-weight ", what, " kernel failed: ", cudaGetErrorString(err));
}
#endif

// Runs fn(bh, tile) for every tile of every (b, h), in parallel on CPU.
template <typename Fn>
void for_each_tile(const fwp::Problem& p, const Fn& fn) {
  const int64_t tiles = fwp::num_tiles(p);
  at::parallel_for(0, p.BH * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) fn(i / tiles, i % tiles);
  });
}

void* data_or_null(const c10::optional<at::Tensor>& x) { return x ? x->data_ptr() : nullptr; }

// Returns out, W_final, checkpoints, u (the last two undefined unless
// save_for_backward; u only for the delta rule).
std::vector<at::Tensor> forward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                const c10::optional<at::Tensor>& beta, const at::Tensor& W0, int64_t chunk,
                                int64_t rows, bool save_for_backward) {
  const bool delta = beta.has_value();
  const fwp::Problem p = make_problem(q, v, chunk, rows, delta);
  const at::ScalarType acc = accumulation_type(q);
  for (auto [x, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) check_tensor(*x, name, q, q.scalar_type());
  if (delta) check_tensor(*beta, "beta", q, q.scalar_type());
  check_tensor(W0, "state", q, acc);
  TORCH_CHECK(p.D <= fwp::kMaxFeatures || !q.is_cuda(), "the CUDA kernels take D <= ", fwp::kMaxFeatures,
              ", got D = ", p.D);

  at::Tensor out = at::empty_like(v);
  at::Tensor W_final = at::empty_like(W0);
  at::Tensor checkpoints, u;
  if (save_for_backward) {
    checkpoints = at::empty({q.size(0), q.size(1), fwp::num_chunks(p), p.Dv, p.D}, W0.options());
    if (delta) u = at::empty({q.size(0), q.size(1), p.T, p.Dv}, W0.options());
  }
  const fwp::ForwardArgs args{q.data_ptr(), k.data_ptr(), v.data_ptr(), data_or_null(beta), W0.data_ptr(),
                              out.data_ptr(), W_final.data_ptr(),
                              checkpoints.defined() ? checkpoints.data_ptr() : nullptr,
                              u.defined() ? u.data_ptr() : nullptr};
  if (q.is_cuda()) {
#ifdef FWP_WITH_CUDA
    const c10::cuda::CUDAGuard guard(q.device());
    check_cuda(fwp::forward_cuda(kernel_dtype(q.scalar_type()), p, args, c10::cuda::getCurrentCUDAStream()),
               "forward");
#else
    TORCH_CHECK(false, "this build of the fast-weight extension has no CUDA kernels");
#endif
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "fast_weight_forward_twin", [&] {
      using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
      for_each_tile(p, [&](int64_t bh, int64_t tile) { fwp::twin::forward_tile<scalar_t, acc_t>(p, args, bh, tile); });
    });
  }
  return {out, W_final, checkpoints, u};
}

// Returns dq, dk, dv, dbeta (undefined for the sum rule), dW0.
std::vector<at::Tensor> backward(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                                 const c10::optional<at::Tensor>& beta, const at::Tensor& d_out,
                                 const at::Tensor& dW_final, const at::Tensor& checkpoints,
                                 const c10::optional<at::Tensor>& u, int64_t chunk, int64_t rows) {
  const bool delta = beta.has_value();
  const fwp::Problem p = make_problem(q, v, chunk, rows, delta);
  const at::ScalarType acc = accumulation_type(q);
  check_tensor(d_out, "d_out", q, q.scalar_type());
  check_tensor(dW_final, "dW_final", q, acc);
  check_tensor(checkpoints, "checkpoints", q, acc);
  TORCH_CHECK(!delta || u.has_value(), "the delta rule's backward needs the saved pseudo-values u");

  const int64_t tiles = fwp::num_tiles(p);
  const auto acc_options = dW_final.options();
  // Zeros: the CPU twin adds into the tile buffers (the GPU overwrites them).
  at::Tensor dq_tiles = at::zeros({tiles, q.size(0), q.size(1), p.T, p.D}, acc_options);
  at::Tensor dk_tiles = at::zeros_like(dq_tiles);
  at::Tensor dbeta_tiles = delta ? at::zeros({tiles, q.size(0), q.size(1), p.T}, acc_options) : at::Tensor();
  at::Tensor dv = at::empty({q.size(0), q.size(1), p.T, p.Dv}, acc_options);
  at::Tensor dW0 = at::empty_like(dW_final);
  const fwp::BackwardArgs args{q.data_ptr(), k.data_ptr(), v.data_ptr(), data_or_null(beta), d_out.data_ptr(),
                               dW_final.data_ptr(), checkpoints.data_ptr(), data_or_null(u),
                               dq_tiles.data_ptr(), dk_tiles.data_ptr(),
                               dbeta_tiles.defined() ? dbeta_tiles.data_ptr() : nullptr, dv.data_ptr(),
                               dW0.data_ptr()};
  if (q.is_cuda()) {
#ifdef FWP_WITH_CUDA
    const c10::cuda::CUDAGuard guard(q.device());
    check_cuda(fwp::backward_cuda(kernel_dtype(q.scalar_type()), p, args, c10::cuda::getCurrentCUDAStream()),
               "backward");
#else
    TORCH_CHECK(false, "this build of the fast-weight extension has no CUDA kernels");
#endif
  } else {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, q.scalar_type(), "fast_weight_backward_twin", [&] {
      using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
      for_each_tile(p, [&](int64_t bh, int64_t tile) { fwp::twin::backward_tile<scalar_t, acc_t>(p, args, bh, tile); });
    });
  }
  // Sum the tiles' partial gradients (a fixed-order reduction, deterministic).
  const auto input_type = q.scalar_type();
  return {dq_tiles.sum(0).to(input_type), dk_tiles.sum(0).to(input_type), dv.to(input_type),
          delta ? dbeta_tiles.sum(0).to(input_type) : at::Tensor(), dW0};
}

// Dynamic shared memory (bytes) that the forward and the backward launch ask
// for: the caller compares it with the device's limit before choosing the kernels.
std::vector<int64_t> shared_memory_bytes(int64_t D, int64_t chunk, int64_t rows, int64_t acc_size) {
  fwp::Problem p{1, 1, D, rows, chunk, rows, true};
  return {fwp::forward_shared_bytes(p, acc_size), fwp::backward_shared_bytes(p, acc_size)};
}

fwp::StepOptions step_options(const c10::optional<at::Tensor>& projection, int64_t map, int64_t nu, double input_scale,
                              int64_t qk_norm, bool attention_normalization, bool normalised_retrieval, int64_t write,
                              int64_t writes, int64_t decay, double eps) {
  return {static_cast<fwp::FeatureMap>(map), nu, data_or_null(projection), input_scale, static_cast<fwp::QKNorm>(qk_norm),
          attention_normalization, normalised_retrieval, static_cast<fwp::Write>(write), writes,
          static_cast<fwp::Decay>(decay), eps};
}

// Every size a fused call reads and writes by is checked against its tensors: an unchecked one would read and
// write out of bounds.
void check_shape(const at::Tensor& x, const char* what, const char* name, at::IntArrayRef want) {
  TORCH_CHECK(x.sizes() == want, what, ": ", name, " has shape ", x.sizes(), ", expected ", want);
}

void check_optional_shape(const c10::optional<at::Tensor>& x, const char* what, const char* name, bool wanted,
                          at::IntArrayRef want) {
  TORCH_CHECK(x.has_value() == wanted, what, ": ", name, wanted ? " is missing" : " is not taken with these options");
  if (wanted) check_shape(*x, what, name, want);
}

// A gate of `per_head` numbers per (row, head): [R, H, per_head], or [R, H] where that is 1.
void check_gate(const c10::optional<at::Tensor>& x, const char* what, const char* name, bool wanted, int64_t R,
                int64_t H, int64_t per_head) {
  TORCH_CHECK(x.has_value() == wanted, what, ": ", name, wanted ? " is missing" : " is not taken with these options");
  if (!wanted) return;
  const bool fits = x->dim() >= 2 && x->size(0) == R && x->size(1) == H && x->numel() == R * H * per_head;
  TORCH_CHECK(fits, what, ": ", name, " has shape ", x->sizes(), ", expected [", R, ", ", H, ", ", per_head, "]",
              per_head == 1 ? " or [R, H]" : "");
}

// The feature map's options and the feature size D they give for inputs of size d (fast_weight_step.h's maps).
void check_features(const char* what, int64_t map, int64_t nu, const c10::optional<at::Tensor>& projection,
                    int64_t qk_norm, int64_t d, int64_t D) {
  TORCH_CHECK(qk_norm >= 0 && qk_norm <= 2, what, ": unknown q/k normalisation ", qk_norm);
  switch (static_cast<fwp::FeatureMap>(map)) {
    case fwp::FeatureMap::kLinear:
    case fwp::FeatureMap::kSiLU:
      TORCH_CHECK(D == d, what, ": this map gives D = d = ", d, " features, but the memory has D = ", D);
      break;
    case fwp::FeatureMap::kDPFP:
      TORCH_CHECK(nu >= 1 && nu < 2 * d, what, ": DPFP's nu must be in [1, 2 d - 1], got ", nu);
      TORCH_CHECK(D == 2 * d * nu, what, ": DPFP gives D = 2 d nu = ", 2 * d * nu, " features, but the memory has D = ", D);
      break;
    case fwp::FeatureMap::kPerformer:
      TORCH_CHECK(D % 2 == 0, what, ": FAVOR+ gives an even D, but the memory has D = ", D);
      check_optional_shape(projection, what, "projection", true, {d, D / 2});
      return;
    default:
      TORCH_CHECK(false, what, ": unknown feature map ", map);
  }
  TORCH_CHECK(!projection.has_value(), what, ": projection is FAVOR+'s alone");
}

// The memories of a fused call: W [n, H, dv, D], or its factors keys [n, H, c, D] and writes [n, H, c, dv] (c slots).
struct HeldMemories {
  const c10::optional<at::Tensor>& W;
  const c10::optional<at::Tensor>& keys;
  const c10::optional<at::Tensor>& writes;

  const at::Tensor& held() const { return W ? *W : *writes; }
  int64_t D() const { return W ? W->size(3) : keys->size(3); }
  int64_t dv() const { return W ? W->size(2) : writes->size(3); }
  int64_t slots() const { return W ? 0 : keys->size(2); }
  // rows memories (-1: as many as they hold) of q's H heads each
  void check(const char* what, const at::Tensor& q, int64_t rows) const {
    TORCH_CHECK(W.has_value() != (keys.has_value() && writes.has_value()), what, ": W, or keys and writes");
    for (auto [x, name] : {std::pair{&W, "W"}, {&keys, "keys"}, {&writes, "writes"}}) {
      if (!x->has_value()) continue;
      check_tensor(**x, name, q, held().scalar_type());
      TORCH_CHECK((*x)->dim() == 4, what, ": ", name, " must have 4 dimensions, got ", (*x)->sizes());
    }
    const int64_t H = q.size(1), n = rows < 0 ? held().size(0) : rows;
    if (W) {
      check_shape(*W, what, "W", {n, H, dv(), D()});
    } else {
      check_shape(*keys, what, "keys", {n, H, slots(), D()});
      check_shape(*writes, what, "writes", {n, H, slots(), dv()});
    }
  }
};

enum class Fused { kStep, kRead };

// Runs the fused step or read (fast_weight_step.h's step_of, read_of) of every (row, head) i < RH: on the GPU,
// one thread block each; on the CPU, in parallel over i, each phase's items in order or, for the tests' check
// that they are independent, reversed.
template <Fused kWhat>
void run_fused(const at::Tensor& held, const fwp::StepOptions& o, const fwp::StepSizes& s, const fwp::StepTensors& x,
               int64_t RH, bool reversed_items) {
  if (held.is_cuda()) {
#ifdef FWP_WITH_CUDA
    TORCH_CHECK(!reversed_items, "a GPU runs each phase's items in its own order");
    const c10::cuda::CUDAGuard guard(held.device());
    check_cuda(fwp::fused_cuda(kernel_dtype(held.scalar_type()), kWhat == Fused::kRead, o, s, x, RH,
                               c10::cuda::getCurrentCUDAStream()),
               kWhat == Fused::kStep ? "fused step" : "fused read");
#else
    TORCH_CHECK(false, "this build of the fast-weight extension has no CUDA kernels");
#endif
    return;
  }
  AT_DISPATCH_FLOATING_TYPES(held.scalar_type(), "fused", [&] {
    const fwp::SerialTeam team{reversed_items};
    const int64_t size = kWhat == Fused::kStep ? fwp::step_scratch(s, x.slots) : fwp::read_scratch(s, x.slots);
    at::parallel_for(0, RH, 1, [&](int64_t begin, int64_t end) {
      std::vector<scalar_t> scratch(size);
      for (int64_t i = begin; i < end; ++i) {
        if constexpr (kWhat == Fused::kStep) {
          fwp::step_of<scalar_t>(team, o, s, x, i, scratch.data());
        } else {
          fwp::read_of<scalar_t>(team, o, s, x, i, scratch.data());
        }
      }
    });
  });
}

// One decoding step of every (row, head), fused (fast_weight_step.h): q [R, H, d], k [R, H, N, d], v [R, H, N,
// dv], beta [R, H, N] or [R, H, D + dv], log_decay [R, H] or [R, H, D], z [R, H, D], and the memories (HeldMemories,
// n = R; factors of c = t + N slots, the last N filled by this step), advanced in place, all contiguous, in the
// memory's dtype and on its device. Returns out [R, H, dv].
template <bool kReversedItems>
at::Tensor fused_step(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                      const c10::optional<at::Tensor>& beta, const c10::optional<at::Tensor>& log_decay,
                      const c10::optional<at::Tensor>& W, const c10::optional<at::Tensor>& keys,
                      const c10::optional<at::Tensor>& writes, const c10::optional<at::Tensor>& z,
                      const c10::optional<at::Tensor>& projection, int64_t map, int64_t nu, double input_scale,
                      int64_t qk_norm, bool attention_normalization, bool normalised_retrieval, int64_t write,
                      int64_t decay, double eps) {
  const char* what = "fused_step";
  TORCH_CHECK(q.dim() == 3 && k.dim() == 4 && v.dim() == 4, "fused_step: q [R, H, d], k [R, H, N, d], v [R, H, N, dv]");
  const HeldMemories memories{W, keys, writes};
  const int64_t R = q.size(0), H = q.size(1), RH = R * H, N = k.size(2);
  memories.check(what, q, R);
  const fwp::StepSizes sizes{q.size(2), memories.D(), memories.dv()};
  const int64_t t = W ? 0 : memories.slots() - N;
  TORCH_CHECK(t >= 0, "fused_step: the factors have no slots for the step's ", N, " writes");
  const auto dtype = memories.held().scalar_type();
  for (auto [x, name] : {std::pair{&q, "q"}, {&k, "k"}, {&v, "v"}}) check_tensor(*x, name, q, dtype);
  for (auto [x, name] : {std::pair{&beta, "beta"}, {&log_decay, "log_decay"}, {&z, "z"}, {&projection, "projection"}})
    if (x->has_value()) check_tensor(**x, name, q, dtype);
  check_shape(k, what, "k", {R, H, N, sizes.d});
  check_shape(v, what, "v", {R, H, N, sizes.dv});
  check_features(what, map, nu, projection, qk_norm, sizes.d, sizes.D);
  TORCH_CHECK(write >= 0 && write <= 2 && decay >= 0 && decay <= 2, what, ": unknown write ", write, " or decay ", decay);
  const auto writes_as = static_cast<fwp::Write>(write);
  TORCH_CHECK(writes_as != fwp::Write::kEraseWrite || N == 1, what, ": erase and write gates take one write a token");
  check_gate(beta, what, "beta", writes_as != fwp::Write::kSum, R, H,
             writes_as == fwp::Write::kEraseWrite ? sizes.D + sizes.dv : N);
  const auto decays_as = static_cast<fwp::Decay>(decay);
  check_gate(log_decay, what, "log_decay", decays_as != fwp::Decay::kNone, R, H,
             decays_as == fwp::Decay::kChannel ? sizes.D : 1);
  check_optional_shape(z, what, "z", attention_normalization, {R, H, sizes.D});
  const auto options = step_options(projection, map, nu, input_scale, qk_norm, attention_normalization,
                                    normalised_retrieval, write, N, decay, eps);
  at::Tensor out = at::empty({q.size(0), q.size(1), sizes.dv}, memories.held().options());
  const fwp::StepTensors tensors{q.data_ptr(), k.data_ptr(), v.data_ptr(), data_or_null(beta), data_or_null(log_decay),
                                 data_or_null(W), data_or_null(keys), data_or_null(writes),
                                 data_or_null(z), out.data_ptr(), N, q.size(1),
                                 beta ? beta->numel() / RH : 0, log_decay ? log_decay->numel() / RH : 0,
                                 memories.slots(), t, /*rows_per_memory=*/1};
  run_fused<Fused::kStep>(memories.held(), options, sizes, tensors, RH, kReversedItems);
  return out;
}

// A read of every row's source memory (fast_weight_step.h's fused_read): q [R, H, d]; the memories of n sources
// (HeldMemories; factors of t tokens), each read by R / n consecutive rows; z [n, H, D] under attention
// normalisation. Returns out [R, H, dv].
template <bool kReversedItems>
at::Tensor fused_read(const at::Tensor& q, const c10::optional<at::Tensor>& W, const c10::optional<at::Tensor>& keys,
                      const c10::optional<at::Tensor>& writes, const c10::optional<at::Tensor>& z,
                      const c10::optional<at::Tensor>& projection, int64_t map, int64_t nu, double input_scale,
                      int64_t qk_norm, bool attention_normalization, double eps) {
  const char* what = "fused_read";
  TORCH_CHECK(q.dim() == 3, "fused_read: q [R, H, d]");
  const HeldMemories memories{W, keys, writes};
  memories.check(what, q, -1);
  const int64_t R = q.size(0), H = q.size(1), n = memories.held().size(0);
  const auto dtype = memories.held().scalar_type();
  check_tensor(q, "q", q, dtype);
  for (auto [x, name] : {std::pair{&z, "z"}, {&projection, "projection"}})
    if (x->has_value()) check_tensor(**x, name, q, dtype);
  TORCH_CHECK(n > 0 && R % n == 0, "fused_read: ", R, " rows cannot share ", n, " source memories");
  const fwp::StepSizes sizes{q.size(2), memories.D(), memories.dv()};
  check_features(what, map, nu, projection, qk_norm, sizes.d, sizes.D);
  check_optional_shape(z, what, "z", attention_normalization, {n, H, sizes.D});
  const auto options = step_options(projection, map, nu, input_scale, qk_norm, attention_normalization,
                                    /*normalised_retrieval=*/false, static_cast<int64_t>(fwp::Write::kSum),
                                    /*writes=*/1, static_cast<int64_t>(fwp::Decay::kNone), eps);
  at::Tensor out = at::empty({R, H, sizes.dv}, memories.held().options());
  const fwp::StepTensors tensors{q.data_ptr(), nullptr, nullptr, nullptr, nullptr, data_or_null(W),
                                 data_or_null(keys), data_or_null(writes), data_or_null(z),
                                 out.data_ptr(), /*N=*/0, H, 0, 0, memories.slots(), memories.slots(), R / n};
  run_fused<Fused::kRead>(memories.held(), options, sizes, tensors, R * H, kReversedItems);
  return out;
}

bool has_cuda_kernels() {
#ifdef FWP_WITH_CUDA
  return true;
#else
  return false;
#endif
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "fairseq-fwp fast-weight kernels (CUDA) and their CPU twin";
  m.def("forward", &forward, "fast-weight forward (sum rule if beta is None, else delta rule)");
  m.def("backward", &backward, "fast-weight backward");
  m.def("shared_memory_bytes", &shared_memory_bytes,
        "(forward, backward) dynamic shared memory of one launch, in bytes", py::arg("D"), py::arg("chunk"),
        py::arg("rows"), py::arg("acc_size"));
  m.def("has_cuda_kernels", &has_cuda_kernels, "whether this build has the CUDA kernels");
  m.def("fused_step", &fused_step<false>, "one decoding step of every (row, head), fused (fast_weight_step.h)");
  m.def("fused_read", &fused_read<false>, "a read of every row's source memory, fused (fast_weight_step.h)");
#ifdef FWP_TEST_ENTRY_POINTS  // the tests' own build: their check that a phase's items are independent, as a
                              // GPU's thread block needs them
  m.def("fused_step_items_reversed", &fused_step<true>, "fused_step, each phase's items in reverse order (CPU)");
  m.def("fused_read_items_reversed", &fused_read<true>, "fused_read, each phase's items in reverse order (CPU)");
#endif
  m.attr("max_features") = fwp::kMaxFeatures;
#ifdef FWP_SOURCES_DIGEST  // setup.py's build: the digest of the sources it was built from (ops/csrc_sources.py)
  m.attr("sources_digest") = FWP_SOURCES_DIGEST;
#endif
}

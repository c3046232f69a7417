// CUDA implementations of the ampinit ops, all on the multi-tensor launcher.
//
// The scale, found_inf and optimizer steps are read from device memory inside the kernels:
// no op reads a device value on the host, so none synchronises, and every launch is safe to
// capture in a CUDA graph.  The fused optimizers return early in every block when found_inf is
// set: a skipped step costs one read of a flag, not a sync.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <map>
#include <optional>
#include <vector>

#include "../common.h"
#include "multi_tensor.cuh"

namespace ampinit::cuda {
namespace {

// -- dtype dispatch -----------------------------------------------------------------------------

template <typename Fn>
void with_type(c10::ScalarType type, const Fn& fn) {
  switch (type) {
    case at::kHalf: fn(at::Half{}); break;
    case at::kBFloat16: fn(at::BFloat16{}); break;
    default: fn(float{}); break;  // check_row admits only these three
  }
}

// Rows grouped by the dtypes of their tensors: each group is one set of launches of one
// kernel instantiation.  Returns, per group, the row indices.
std::vector<std::vector<size_t>> group_by_dtypes(const std::vector<std::vector<at::Tensor>>& lists) {
  std::map<std::vector<c10::ScalarType>, std::vector<size_t>> groups;
  const size_t rows = lists.empty() ? 0 : lists[0].size();
  for (size_t i = 0; i < rows; ++i) {
    std::vector<c10::ScalarType> key;
    for (const auto& list : lists) key.push_back(list[i].scalar_type());
    groups[key].push_back(i);
  }
  std::vector<std::vector<size_t>> result;
  for (auto& entry : groups) result.push_back(std::move(entry.second));
  return result;
}

std::vector<std::vector<at::Tensor>> select(const std::vector<std::vector<at::Tensor>>& lists,
                                            const std::vector<size_t>& rows) {
  std::vector<std::vector<at::Tensor>> out(lists.size());
  for (size_t l = 0; l < lists.size(); ++l) {
    for (size_t r : rows) out[l].push_back(lists[l][r]);
  }
  return out;
}

std::vector<int32_t> as_indices(const std::vector<size_t>& rows) {
  return std::vector<int32_t>(rows.begin(), rows.end());
}

__device__ __forceinline__ void flag(float* found_inf, float* per_tensor, int32_t index) {
  *found_inf = 1.0f;  // every writer writes the same value
  if (per_tensor != nullptr) per_tensor[index] = 1.0f;
}

// Chunk geometry shared by the functors.
struct ChunkRange {
  int64_t start, length;
  __device__ ChunkRange(int64_t size, int64_t chunk) : start(chunk * kChunkSize) {
    length = size - start < kChunkSize ? size - start : kChunkSize;
  }
};

// -- functors -------------------------------------------------------------------------------------

template <typename In, typename Out>
struct UnscaleFunctor {
  const float* inv_scale;
  float* found_inf;
  float* per_tensor;
  __device__ void operator()(const TensorListMeta<2>& meta, int t, int64_t chunk) const {
    const ChunkRange range(meta.sizes[t], chunk);
    const In* x = static_cast<const In*>(meta.addresses[0][t]) + range.start;
    Out* y = static_cast<Out*>(meta.addresses[1][t]) + range.start;
    const float inv = *inv_scale;
    bool bad = false;
    const bool vectors = aligned_for_vectors<In>(x) && aligned_for_vectors<Out>(y);
    for_each_element(range.length, vectors, [&](int64_t i, int count) {
      float v[kILP];
      load_n(v, x + i, count);
      for (int k = 0; k < count; ++k) {
        v[k] *= inv;
        bad |= !isfinite(v[k]);
      }
      store_n(y + i, v, count);
    });
    if (bad) flag(found_inf, per_tensor, meta.tensor_index[t]);
  }
};

template <typename In, typename Out>
struct AccumulateFunctor {
  const float* inv_scale;
  float* found_inf;
  float out_weight;
  __device__ void operator()(const TensorListMeta<2>& meta, int t, int64_t chunk) const {
    const ChunkRange range(meta.sizes[t], chunk);
    const In* x = static_cast<const In*>(meta.addresses[0][t]) + range.start;
    Out* y = static_cast<Out*>(meta.addresses[1][t]) + range.start;
    const float inv = *inv_scale;
    bool bad = false;
    const bool vectors = aligned_for_vectors<In>(x) && aligned_for_vectors<Out>(y);
    for_each_element(range.length, vectors, [&](int64_t i, int count) {
      float v[kILP], acc[kILP];
      load_n(v, x + i, count);
      load_n(acc, y + i, count);
      for (int k = 0; k < count; ++k) {
        v[k] *= inv;
        bad |= !isfinite(v[k]);
        acc[k] = acc[k] * out_weight + v[k];
      }
      store_n(y + i, acc, count);
    });
    if (bad) flag(found_inf, nullptr, 0);
  }
};

template <typename In, typename Out>
struct CopyFunctor {
  __device__ void operator()(const TensorListMeta<2>& meta, int t, int64_t chunk) const {
    const ChunkRange range(meta.sizes[t], chunk);
    const In* x = static_cast<const In*>(meta.addresses[0][t]) + range.start;
    Out* y = static_cast<Out*>(meta.addresses[1][t]) + range.start;
    const bool vectors = aligned_for_vectors<In>(x) && aligned_for_vectors<Out>(y);
    for_each_element(range.length, vectors, [&](int64_t i, int count) {
      float v[kILP];
      load_n(v, x + i, count);
      store_n(y + i, v, count);
    });
  }
};

template <typename In>
struct CheckFunctor {
  float* found_inf;
  float* per_tensor;
  __device__ void operator()(const TensorListMeta<1>& meta, int t, int64_t chunk) const {
    const ChunkRange range(meta.sizes[t], chunk);
    const In* x = static_cast<const In*>(meta.addresses[0][t]) + range.start;
    bool bad = false;
    for_each_element(range.length, aligned_for_vectors<In>(x), [&](int64_t i, int count) {
      float v[kILP];
      load_n(v, x + i, count);
      for (int k = 0; k < count; ++k) bad |= !isfinite(v[k]);
    });
    if (bad) flag(found_inf, per_tensor, meta.tensor_index[t]);
  }
};

// Block-wide sum; every thread gets the result.
template <typename T>
__device__ T block_sum(T value) {
  __shared__ T warp_sums[kBlockSize / 32];
  for (int offset = 16; offset > 0; offset /= 2) value += __shfl_down_sync(0xffffffff, value, offset);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  if (lane == 0) warp_sums[warp] = value;
  __syncthreads();
  T total = 0;
  if (threadIdx.x < 32) {
    total = threadIdx.x < (blockDim.x + 31) / 32 ? warp_sums[threadIdx.x] : T(0);
    for (int offset = 16; offset > 0; offset /= 2) total += __shfl_down_sync(0xffffffff, total, offset);
    if (threadIdx.x == 0) warp_sums[0] = total;
  }
  __syncthreads();
  total = warp_sums[0];
  __syncthreads();
  return total;
}

template <typename In>
struct SumOfSquaresFunctor {
  float* partials;  // one per block over all launches of the op
  __device__ void operator()(const TensorListMeta<1>& meta, int t, int64_t chunk) const {
    const ChunkRange range(meta.sizes[t], chunk);
    const In* x = static_cast<const In*>(meta.addresses[0][t]) + range.start;
    float sum = 0.0f;
    for_each_element(range.length, aligned_for_vectors<In>(x), [&](int64_t i, int count) {
      float v[kILP];
      load_n(v, x + i, count);
      for (int k = 0; k < count; ++k) sum += v[k] * v[k];
    });
    sum = block_sum(sum);
    if (threadIdx.x == 0) partials[meta.block_offset + blockIdx.x] = sum;
  }
};

// Per tensor t, the sum of partials[offsets[t] .. offsets[t + 1]), in double.
__global__ void __launch_bounds__(kBlockSize) sum_partials_kernel(const float* partials, const int64_t* offsets,
                                                                 double* per_tensor) {
  double sum = 0.0;
  for (int64_t i = offsets[blockIdx.x] + threadIdx.x; i < offsets[blockIdx.x + 1]; i += blockDim.x) sum += partials[i];
  sum = block_sum(sum);
  if (threadIdx.x == 0) per_tensor[blockIdx.x] = sum;
}

struct IncrementStepFunctor {
  const float* found_inf;
  __device__ void operator()(const TensorListMeta<1>& meta, int t, int64_t) const {
    if (threadIdx.x == 0 && *found_inf == 0.0f) *static_cast<float*>(meta.addresses[0][t]) += 1.0f;
  }
};

struct AdamHyper {
  double lr, beta1, beta2;  // the bias corrections are computed in double
  float eps, weight_decay;
  float one_minus_beta1, one_minus_beta2, decay;  // computed in double on the host, like torch's scalars
  float beta2_f;
  bool decoupled_weight_decay, bias_correction;
};

// Lists: param, grad, exp_avg, exp_avg_sq[, model]; meta.scalars: the (already advanced) steps.
template <typename Grad, typename Model, int Depth>
struct AdamFunctor {
  AdamHyper h;
  const float* inv_scale;
  const float* found_inf;
  __device__ void operator()(const TensorListMeta<Depth>& meta, int t, int64_t chunk) const {
    if (*found_inf != 0.0f) return;  // the skipped step leaves everything as it was
    const ChunkRange range(meta.sizes[t], chunk);
    float* param = static_cast<float*>(meta.addresses[0][t]) + range.start;
    const Grad* grad = static_cast<const Grad*>(meta.addresses[1][t]) + range.start;
    float* exp_avg = static_cast<float*>(meta.addresses[2][t]) + range.start;
    float* exp_avg_sq = static_cast<float*>(meta.addresses[3][t]) + range.start;
    Model* model = nullptr;
    if constexpr (Depth == 5) model = static_cast<Model*>(meta.addresses[4][t]) + range.start;
    // Bias corrections in double, as torch.optim.Adam computes them on the host.
    const double step = *meta.scalars[t];
    const double bc1 = h.bias_correction ? 1.0 - pow(h.beta1, step) : 1.0;
    const double bc2 = h.bias_correction ? 1.0 - pow(h.beta2, step) : 1.0;
    const float step_size = static_cast<float>(h.lr / bc1);  // lr / (1 - beta1^step)
    const float bc2_sqrt = static_cast<float>(sqrt(bc2));
    const float inv = *inv_scale;
    bool vectors = aligned_for_vectors<float>(param) && aligned_for_vectors<Grad>(grad) &&
                   aligned_for_vectors<float>(exp_avg) && aligned_for_vectors<float>(exp_avg_sq);
    if constexpr (Depth == 5) vectors = vectors && aligned_for_vectors<Model>(model);
    for_each_element(range.length, vectors, [&](int64_t i, int count) {
      float g[kILP], w[kILP], m[kILP], v[kILP];
      load_n(g, grad + i, count);
      load_n(w, param + i, count);
      load_n(m, exp_avg + i, count);
      load_n(v, exp_avg_sq + i, count);
      for (int k = 0; k < count; ++k) {
        g[k] *= inv;
        if (h.weight_decay != 0.0f) {
          if (h.decoupled_weight_decay) {
            w[k] *= h.decay;
          } else {
            g[k] += h.weight_decay * w[k];
          }
        }
        m[k] += h.one_minus_beta1 * (g[k] - m[k]);
        v[k] = v[k] * h.beta2_f + h.one_minus_beta2 * g[k] * g[k];
        w[k] += -step_size * m[k] / (sqrtf(v[k]) / bc2_sqrt + h.eps);
      }
      store_n(param + i, w, count);
      store_n(exp_avg + i, m, count);
      store_n(exp_avg_sq + i, v, count);
      if constexpr (Depth == 5) store_n(model + i, w, count);
    });
  }
};

struct SgdHyper {
  float lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov;
};

// Lists: param, grad[, momentum_buffer][, model]; meta.scalars: the (already advanced) steps.
template <typename Grad, typename Model, bool HasMomentum, int Depth>
struct SgdFunctor {
  SgdHyper h;
  const float* inv_scale;
  const float* found_inf;
  __device__ void operator()(const TensorListMeta<Depth>& meta, int t, int64_t chunk) const {
    if (*found_inf != 0.0f) return;
    constexpr bool kHasModel = Depth == (HasMomentum ? 4 : 3);
    const ChunkRange range(meta.sizes[t], chunk);
    float* param = static_cast<float*>(meta.addresses[0][t]) + range.start;
    const Grad* grad = static_cast<const Grad*>(meta.addresses[1][t]) + range.start;
    float* buffer = nullptr;
    Model* model = nullptr;
    if constexpr (HasMomentum) buffer = static_cast<float*>(meta.addresses[2][t]) + range.start;
    if constexpr (kHasModel) model = static_cast<Model*>(meta.addresses[Depth - 1][t]) + range.start;
    const bool first_step = *meta.scalars[t] == 1.0f;  // the buffer starts as the gradient
    const float inv = *inv_scale;
    bool vectors = aligned_for_vectors<float>(param) && aligned_for_vectors<Grad>(grad);
    if constexpr (HasMomentum) vectors = vectors && aligned_for_vectors<float>(buffer);
    if constexpr (kHasModel) vectors = vectors && aligned_for_vectors<Model>(model);
    for_each_element(range.length, vectors, [&](int64_t i, int count) {
      float g[kILP], w[kILP], b[kILP] = {};
      load_n(g, grad + i, count);
      load_n(w, param + i, count);
      if constexpr (HasMomentum) {
        if (!first_step) load_n(b, buffer + i, count);
      }
      for (int k = 0; k < count; ++k) {
        g[k] *= inv;
        if (h.weight_decay != 0.0f) g[k] += h.weight_decay * w[k];
        if constexpr (HasMomentum) {
          b[k] = first_step ? g[k] : b[k] * h.momentum + h.one_minus_dampening * g[k];
          g[k] = h.nesterov ? g[k] + h.momentum * b[k] : b[k];
        }
        w[k] += -h.lr * g[k];
      }
      store_n(param + i, w, count);
      if constexpr (HasMomentum) store_n(buffer + i, b, count);
      if constexpr (kHasModel) store_n(model + i, w, count);
    });
  }
};

__global__ void update_scale_kernel(float* scale, int32_t* growth_tracker, int32_t* hysteresis_tracker,
                                    int64_t* overflow_count, const float* found_inf, float growth_factor,
                                    float backoff_factor, int64_t growth_interval, int32_t hysteresis,
                                    float min_scale, float max_scale) {
  if (*found_inf > 0.0f) {
    *overflow_count += 1;
    *growth_tracker = 0;
    const int32_t credits = *hysteresis_tracker - 1;
    if (credits <= 0) *scale = fmaxf(*scale * backoff_factor, min_scale);
    *hysteresis_tracker = credits > 0 ? credits : 0;
  } else if (++*growth_tracker >= growth_interval) {
    *scale = fminf(*scale * growth_factor, max_scale);
    *growth_tracker = 0;
    *hysteresis_tracker = hysteresis;
  }
}

// -- ops ------------------------------------------------------------------------------------------

float* optional_flags(const char* op, const std::optional<at::Tensor>& per_tensor, size_t n, const at::Device& device) {
  if (!per_tensor.has_value()) return nullptr;
  TORCH_CHECK(per_tensor->scalar_type() == at::kFloat && per_tensor->is_contiguous() &&
                  per_tensor->numel() == static_cast<int64_t>(n) && per_tensor->device() == device,
              "ampinit.", op, ": per_tensor_found_inf must be a contiguous float32 tensor with one element "
              "per input on the inputs' device");
  return per_tensor->data_ptr<float>();
}

void unscale_(at::TensorList inputs, at::TensorList outputs, const at::Tensor& inv_scale, const at::Tensor& found_inf,
              const std::optional<at::Tensor>& per_tensor) {
  const at::Device device = found_inf.device();
  const c10::cuda::CUDAGuard guard(device);
  check_same_length("unscale_", "inputs", inputs.size(), "outputs", outputs.size());
  check_flag("unscale_", "inv_scale", inv_scale, device);
  check_flag("unscale_", "found_inf", found_inf, device);
  float* flags = optional_flags("unscale_", per_tensor, inputs.size(), device);
  for (size_t i = 0; i < inputs.size(); ++i) check_row("unscale_", i, {inputs[i], outputs[i]}, device);
  DenseRows rows({inputs.vec(), outputs.vec()}, {false, true});
  const std::vector<std::vector<at::Tensor>> lists = {rows.list(0), rows.list(1)};
  for (const auto& group : group_by_dtypes(lists)) {
    const auto sub = select(lists, group);
    with_type(sub[0][0].scalar_type(), [&](auto in) {
      with_type(sub[1][0].scalar_type(), [&](auto out) {
        launch<2>(sub, {}, as_indices(group),
                  UnscaleFunctor<decltype(in), decltype(out)>{inv_scale.data_ptr<float>(),
                                                              found_inf.data_ptr<float>(), flags});
      });
    });
  }
  rows.finish();
}

void accumulate_(at::TensorList inputs, at::TensorList outputs, const at::Tensor& inv_scale,
                 const at::Tensor& found_inf, double out_weight) {
  const at::Device device = found_inf.device();
  const c10::cuda::CUDAGuard guard(device);
  check_same_length("accumulate_", "inputs", inputs.size(), "outputs", outputs.size());
  check_flag("accumulate_", "inv_scale", inv_scale, device);
  check_flag("accumulate_", "found_inf", found_inf, device);
  for (size_t i = 0; i < inputs.size(); ++i) check_row("accumulate_", i, {inputs[i], outputs[i]}, device);
  DenseRows rows({inputs.vec(), outputs.vec()}, {false, true});
  const std::vector<std::vector<at::Tensor>> lists = {rows.list(0), rows.list(1)};
  for (const auto& group : group_by_dtypes(lists)) {
    const auto sub = select(lists, group);
    with_type(sub[0][0].scalar_type(), [&](auto in) {
      with_type(sub[1][0].scalar_type(), [&](auto out) {
        launch<2>(sub, {}, as_indices(group),
                  AccumulateFunctor<decltype(in), decltype(out)>{inv_scale.data_ptr<float>(),
                                                                 found_inf.data_ptr<float>(),
                                                                 static_cast<float>(out_weight)});
      });
    });
  }
  rows.finish();
}

void copy_(at::TensorList outputs, at::TensorList inputs) {
  check_same_length("copy_", "outputs", outputs.size(), "inputs", inputs.size());
  if (inputs.empty()) return;
  const at::Device device = inputs[0].device();
  const c10::cuda::CUDAGuard guard(device);
  for (size_t i = 0; i < inputs.size(); ++i) check_row("copy_", i, {inputs[i], outputs[i]}, device);
  DenseRows rows({inputs.vec(), outputs.vec()}, {false, true});
  const std::vector<std::vector<at::Tensor>> lists = {rows.list(0), rows.list(1)};
  for (const auto& group : group_by_dtypes(lists)) {
    const auto sub = select(lists, group);
    with_type(sub[0][0].scalar_type(), [&](auto in) {
      with_type(sub[1][0].scalar_type(), [&](auto out) {
        launch<2>(sub, {}, as_indices(group), CopyFunctor<decltype(in), decltype(out)>{});
      });
    });
  }
  rows.finish();
}

void check_finite_(at::TensorList inputs, const at::Tensor& found_inf, const std::optional<at::Tensor>& per_tensor) {
  const at::Device device = found_inf.device();
  const c10::cuda::CUDAGuard guard(device);
  check_flag("check_finite_", "found_inf", found_inf, device);
  float* flags = optional_flags("check_finite_", per_tensor, inputs.size(), device);
  for (size_t i = 0; i < inputs.size(); ++i) check_row("check_finite_", i, {inputs[i]}, device);
  DenseRows rows({inputs.vec()}, {false});
  const std::vector<std::vector<at::Tensor>> lists = {rows.list(0)};
  for (const auto& group : group_by_dtypes(lists)) {
    const auto sub = select(lists, group);
    with_type(sub[0][0].scalar_type(), [&](auto in) {
      launch<1>(sub, {}, as_indices(group), CheckFunctor<decltype(in)>{found_inf.data_ptr<float>(), flags});
    });
  }
}

std::tuple<at::Tensor, at::Tensor> l2norm(at::TensorList inputs, bool per_tensor) {
  TORCH_CHECK(!inputs.empty(), "ampinit.l2norm: on CUDA, pass at least one tensor (the device comes from it)");
  const at::Device device = inputs[0].device();
  const c10::cuda::CUDAGuard guard(device);
  for (size_t i = 0; i < inputs.size(); ++i) check_row("l2norm", i, {inputs[i]}, device);
  DenseRows rows({inputs.vec()}, {false});
  const auto& in = rows.list(0);
  // Partial sums are laid out tensor by tensor, in launch order; offsets[t] is tensor t's first.
  std::vector<int64_t> offsets(in.size() + 1, 0);
  for (size_t t = 0; t < in.size(); ++t) offsets[t + 1] = offsets[t] + (in[t].numel() + kChunkSize - 1) / kChunkSize;
  // One launch sequence per dtype would break the layout, so tensors are visited in order and
  // each maximal run of one dtype is launched with its block offset.
  at::Tensor partials = at::zeros({std::max<int64_t>(offsets.back(), 1)}, at::dtype(at::kFloat).device(device));
  size_t begin = 0;
  while (begin < in.size()) {
    size_t end = begin + 1;
    while (end < in.size() && in[end].scalar_type() == in[begin].scalar_type()) ++end;
    std::vector<at::Tensor> run(in.begin() + begin, in.begin() + end);
    std::vector<int32_t> indices(end - begin);
    for (size_t t = begin; t < end; ++t) indices[t - begin] = static_cast<int32_t>(t);
    with_type(run[0].scalar_type(), [&](auto type) {
      launch<1>({run}, {}, indices, SumOfSquaresFunctor<decltype(type)>{partials.data_ptr<float>() + offsets[begin]});
    });
    begin = end;
  }
  at::Tensor offsets_device =
      at::tensor(offsets, at::dtype(at::kLong)).to(at::TensorOptions().device(device), /*non_blocking=*/true);
  at::Tensor sums = at::empty({static_cast<int64_t>(in.size())}, at::dtype(at::kDouble).device(device));
  sum_partials_kernel<<<in.size(), kBlockSize, 0, at::cuda::getCurrentCUDAStream()>>>(
      partials.data_ptr<float>(), offsets_device.data_ptr<int64_t>(), sums.data_ptr<double>());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  at::Tensor total = sums.sum().sqrt().to(at::kFloat).reshape({1});
  at::Tensor norms = per_tensor ? sums.sqrt().to(at::kFloat) : at::empty({0}, at::dtype(at::kFloat).device(device));
  return {total, norms};
}

void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& hysteresis_tracker,
                   const at::Tensor& overflow_count, const at::Tensor& found_inf, double growth_factor,
                   double backoff_factor, int64_t growth_interval, int64_t hysteresis, double min_scale,
                   double max_scale) {
  const at::Device device = scale.device();
  const c10::cuda::CUDAGuard guard(device);
  check_flag("update_scale_", "scale", scale, device);
  check_flag("update_scale_", "found_inf", found_inf, device);
  TORCH_CHECK(growth_tracker.numel() == 1 && growth_tracker.scalar_type() == at::kInt &&
                  growth_tracker.device() == device && hysteresis_tracker.numel() == 1 &&
                  hysteresis_tracker.scalar_type() == at::kInt && hysteresis_tracker.device() == device &&
                  overflow_count.numel() == 1 && overflow_count.scalar_type() == at::kLong &&
                  overflow_count.device() == device,
              "ampinit.update_scale_: growth_tracker and hysteresis_tracker must be 1-element int32 tensors "
              "and overflow_count a 1-element int64 tensor, all on the scale's device");
  update_scale_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(
      scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(), hysteresis_tracker.data_ptr<int32_t>(),
      overflow_count.data_ptr<int64_t>(), found_inf.data_ptr<float>(), static_cast<float>(growth_factor),
      static_cast<float>(backoff_factor), growth_interval, static_cast<int32_t>(hysteresis),
      static_cast<float>(min_scale), static_cast<float>(max_scale));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// steps[i] += 1 unless found_inf, on the device.
void advance_steps(at::TensorList steps, const at::Tensor& found_inf) {
  std::vector<int32_t> indices(steps.size());
  for (size_t i = 0; i < steps.size(); ++i) indices[i] = static_cast<int32_t>(i);
  launch<1>({steps.vec()}, {}, indices, IncrementStepFunctor{found_inf.data_ptr<float>()});
}

std::vector<const float*> step_pointers(const std::vector<at::Tensor>& steps) {
  std::vector<const float*> pointers;
  for (const auto& step : steps) pointers.push_back(step.data_ptr<float>());
  return pointers;
}

void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList steps, at::TensorList models, double lr, double beta1, double beta2, double eps,
                 double weight_decay, bool decoupled_weight_decay, bool bias_correction,
                 const at::Tensor& inv_scale, const at::Tensor& found_inf) {
  const at::Device device = found_inf.device();
  const c10::cuda::CUDAGuard guard(device);
  check_flag("fused_adam_", "inv_scale", inv_scale, device);
  check_flag("fused_adam_", "found_inf", found_inf, device);
  check_optimizer_lists("fused_adam_", params, grads, {exp_avgs, exp_avg_sqs}, steps, models, device);
  if (params.empty()) return;
  advance_steps(steps, found_inf);
  std::vector<std::vector<at::Tensor>> lists = {params.vec(), grads.vec(), exp_avgs.vec(), exp_avg_sqs.vec()};
  std::vector<bool> written = {true, false, true, true};
  if (!models.empty()) {
    lists.push_back(models.vec());
    written.push_back(true);
  }
  DenseRows rows(lists, written);
  std::vector<std::vector<at::Tensor>> dense;
  for (size_t l = 0; l < lists.size(); ++l) dense.push_back(rows.list(l));
  dense.push_back(steps.vec());  // grouped along, for the step pointers
  const AdamHyper h{lr, beta1, beta2, static_cast<float>(eps), static_cast<float>(weight_decay),
                    static_cast<float>(1.0 - beta1), static_cast<float>(1.0 - beta2),
                    static_cast<float>(1.0 - lr * weight_decay), static_cast<float>(beta2),
                    decoupled_weight_decay, bias_correction};
  for (const auto& group : group_by_dtypes(dense)) {
    auto sub = select(dense, group);
    const auto step_ptrs = step_pointers(sub.back());
    sub.pop_back();
    with_type(sub[1][0].scalar_type(), [&](auto grad) {
      using G = decltype(grad);
      if (models.empty()) {
        launch<4>(sub, step_ptrs, as_indices(group),
                  AdamFunctor<G, float, 4>{h, inv_scale.data_ptr<float>(), found_inf.data_ptr<float>()});
      } else {
        with_type(sub[4][0].scalar_type(), [&](auto model) {
          launch<5>(sub, step_ptrs, as_indices(group),
                    AdamFunctor<G, decltype(model), 5>{h, inv_scale.data_ptr<float>(), found_inf.data_ptr<float>()});
        });
      }
    });
  }
  rows.finish();
}

void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, at::TensorList steps,
                at::TensorList models, double lr, double momentum, double dampening, double weight_decay,
                bool nesterov, const at::Tensor& inv_scale, const at::Tensor& found_inf) {
  const at::Device device = found_inf.device();
  const c10::cuda::CUDAGuard guard(device);
  check_flag("fused_sgd_", "inv_scale", inv_scale, device);
  check_flag("fused_sgd_", "found_inf", found_inf, device);
  const bool has_momentum = !momentum_buffers.empty();
  TORCH_CHECK(has_momentum == (momentum != 0.0), "ampinit.fused_sgd_: pass one momentum buffer per param exactly "
              "when momentum is nonzero");
  std::vector<at::TensorList> states;
  if (has_momentum) states.push_back(momentum_buffers);
  check_optimizer_lists("fused_sgd_", params, grads, states, steps, models, device);
  if (params.empty()) return;
  advance_steps(steps, found_inf);
  std::vector<std::vector<at::Tensor>> lists = {params.vec(), grads.vec()};
  std::vector<bool> written = {true, false};
  if (has_momentum) {
    lists.push_back(momentum_buffers.vec());
    written.push_back(true);
  }
  if (!models.empty()) {
    lists.push_back(models.vec());
    written.push_back(true);
  }
  DenseRows rows(lists, written);
  std::vector<std::vector<at::Tensor>> dense;
  for (size_t l = 0; l < lists.size(); ++l) dense.push_back(rows.list(l));
  dense.push_back(steps.vec());
  const SgdHyper h{static_cast<float>(lr), static_cast<float>(momentum), static_cast<float>(1.0 - dampening),
                   static_cast<float>(weight_decay), nesterov};
  const float* inv = inv_scale.data_ptr<float>();
  const float* found = found_inf.data_ptr<float>();
  for (const auto& group : group_by_dtypes(dense)) {
    auto sub = select(dense, group);
    const auto step_ptrs = step_pointers(sub.back());
    sub.pop_back();
    const auto indices = as_indices(group);
    with_type(sub[1][0].scalar_type(), [&](auto grad) {
      using G = decltype(grad);
      if (models.empty()) {
        if (has_momentum) {
          launch<3>(sub, step_ptrs, indices, SgdFunctor<G, float, true, 3>{h, inv, found});
        } else {
          launch<2>(sub, step_ptrs, indices, SgdFunctor<G, float, false, 2>{h, inv, found});
        }
      } else {
        with_type(sub.back()[0].scalar_type(), [&](auto model) {
          using M = decltype(model);
          if (has_momentum) {
            launch<4>(sub, step_ptrs, indices, SgdFunctor<G, M, true, 4>{h, inv, found});
          } else {
            launch<3>(sub, step_ptrs, indices, SgdFunctor<G, M, false, 3>{h, inv, found});
          }
        });
      }
    });
  }
  rows.finish();
}

}  // namespace

TORCH_LIBRARY_IMPL(ampinit, CUDA, m) {
  m.impl("unscale_", &unscale_);
  m.impl("accumulate_", &accumulate_);
  m.impl("copy_", &copy_);
  m.impl("check_finite_", &check_finite_);
  m.impl("l2norm", &l2norm);
  m.impl("update_scale_", &update_scale_);
  m.impl("fused_adam_", &fused_adam_);
  m.impl("fused_sgd_", &fused_sgd_);
}

}  // namespace ampinit::cuda

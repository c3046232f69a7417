// CUDA implementations of the elementwise ampinit ops (unscale, accumulate, copy, adopt, check),
// the L2 norm, the fingerprint and the loss-scale update, all on the multi-tensor launcher.  The
// optimizers are in optim_cuda.cu.
//
// The scale and found_inf are read from device memory inside the kernels: no op reads a device
// value on the host or copies host memory to the device, so none synchronises, and every
// launch is safe to capture in a CUDA graph.  A flag is written by one thread per block that
// saw a non-finite value (__syncthreads_or), not by every such thread.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "../master_bits.h"
#include "common.cuh"
#include "multi_tensor.cuh"

namespace ampinit::cuda {
namespace {

__device__ __forceinline__ void flag(float* found_inf, float* per_tensor, int32_t index) {
  *found_inf = 1.0f;  // every writer writes the same value
  if (per_tensor != nullptr) per_tensor[index] = 1.0f;
}

// The block reports a non-finite value once: thread 0 writes the flags if any thread saw one.
// Every thread of the block must reach it.
__device__ __forceinline__ void report(bool bad, float* found_inf, float* per_tensor, int32_t index) {
  if (__syncthreads_or(bad) && threadIdx.x == 0) flag(found_inf, per_tensor, index);
}

// The chunk's vector alignment follows its widest array (the most bytes move in vectors).
template <typename A, typename B>
__device__ __forceinline__ int head_for(const A* a, const B* b) {
  return sizeof(A) >= sizeof(B) ? head_to_align(a) : head_to_align(b);
}

// -- functors -------------------------------------------------------------------------------------

// y = x * inv_scale, flagging what is written (a finite product overflowing Out included).
template <typename In, typename Out>
struct UnscaleFunctor {
  const float* inv_scale;
  float* found_inf;
  float* per_tensor;
  template <typename Meta>
  __device__ void operator()(const Meta& meta, int t, int64_t chunk) const {
    const ChunkRange range(meta.sizes[t], chunk);
    const In* x_ptr = static_cast<const In*>(meta.addresses[0][t]) + range.start;
    Out* y_ptr = static_cast<Out*>(meta.addresses[1][t]) + range.start;
    const int head = head_for(x_ptr, y_ptr);
    const ArrayRef<const In> x(x_ptr, head);
    const ArrayRef<Out> y(y_ptr, head);
    const float inv = *inv_scale;
    bool bad = false;
    float v[kUnroll][kILP];
    for_each_pack(
        Split(range.length, head), [&](int u, int64_t i, int count) { load(v[u], x, i, count); },
        [&](int u, int64_t i, int count) {
#pragma unroll
          for (int k = 0; k < kILP; ++k) {
            if (k < count) {
              v[u][k] *= inv;
              bad |= stores_nonfinite<Out>(v[u][k]);
            }
          }
          store(y, i, v[u], count);
        });
    report(bad, found_inf, per_tensor, meta.tensor_index[t]);
  }
};

// y = out_weight * y + x * inv_scale, flagging what this call brings: a non-finite contribution,
// or a finite y that the sum pushes past Out (an inf/NaN already in y was flagged when written).
template <typename In, typename Out>
struct AccumulateFunctor {
  const float* inv_scale;
  float* found_inf;
  float out_weight;
  template <typename Meta>
  __device__ void operator()(const Meta& meta, int t, int64_t chunk) const {
    const ChunkRange range(meta.sizes[t], chunk);
    const In* x_ptr = static_cast<const In*>(meta.addresses[0][t]) + range.start;
    Out* y_ptr = static_cast<Out*>(meta.addresses[1][t]) + range.start;
    const int head = head_for(x_ptr, y_ptr);
    const ArrayRef<const In> x(x_ptr, head);
    const ArrayRef<Out> y(y_ptr, head);
    const float inv = *inv_scale;
    bool bad = false;
    float v[kUnroll][kILP], acc[kUnroll][kILP];
    for_each_pack(
        Split(range.length, head),
        [&](int u, int64_t i, int count) {
          load(v[u], x, i, count);
          load(acc[u], y, i, count);
        },
        [&](int u, int64_t i, int count) {
#pragma unroll
          for (int k = 0; k < kILP; ++k) {
            if (k < count) {
              const float contribution = v[u][k] * inv;
              const bool was_finite = isfinite(acc[u][k]);
              // rounded apart, as the fallback's two ops: nvcc would contract them into one FMA
              acc[u][k] = __fadd_rn(__fmul_rn(acc[u][k], out_weight), contribution);
              bad |= !isfinite(contribution) || (was_finite && stores_nonfinite<Out>(acc[u][k]));
            }
          }
          store(y, i, acc[u], count);
        });
    report(bad, found_inf, nullptr, 0);
  }
};

template <typename In, typename Out>
struct CopyFunctor {
  template <typename Meta>
  __device__ void operator()(const Meta& meta, int t, int64_t chunk) const {
    const ChunkRange range(meta.sizes[t], chunk);
    const In* x_ptr = static_cast<const In*>(meta.addresses[0][t]) + range.start;
    Out* y_ptr = static_cast<Out*>(meta.addresses[1][t]) + range.start;
    const int head = head_for(x_ptr, y_ptr);
    const ArrayRef<const In> x(x_ptr, head);
    const ArrayRef<Out> y(y_ptr, head);
    float v[kUnroll][kILP];
    for_each_pack(
        Split(range.length, head), [&](int u, int64_t i, int count) { load(v[u], x, i, count); },
        [&](int u, int64_t i, int count) { store(y, i, v[u], count); });
  }
};

// master = model wherever model differs from master rounded to Model (a write to the model from
// outside ampinit, adopted); NaN differs from everything.  Master is float32 (checked on the host).
template <typename Model, typename Master>
struct AdoptFunctor {
  const float* only;  // per-tensor: 0 skips the tensor (may be null: every tensor)
  template <typename Meta>
  __device__ void operator()(const Meta& meta, int t, int64_t chunk) const {
    if (only != nullptr && only[meta.tensor_index[t]] == 0.0f) return;  // uniform over the block
    const ChunkRange range(meta.sizes[t], chunk);
    const Model* model_ptr = static_cast<const Model*>(meta.addresses[0][t]) + range.start;
    Master* master_ptr = static_cast<Master*>(meta.addresses[1][t]) + range.start;
    const int head = head_for(model_ptr, master_ptr);
    const ArrayRef<const Model> model(model_ptr, head);
    const ArrayRef<Master> master(master_ptr, head);
    float v[kUnroll][kILP], w[kUnroll][kILP];
    for_each_pack(
        Split(range.length, head),
        [&](int u, int64_t i, int count) {
          load(v[u], model, i, count);
          load(w[u], master, i, count);
        },
        [&](int u, int64_t i, int count) {
#pragma unroll
          for (int k = 0; k < kILP; ++k) {
            if (k < count && v[u][k] != static_cast<float>(static_cast<Model>(w[u][k]))) w[u][k] = v[u][k];
          }
          store(master, i, w[u], count);
        });
  }
};

template <typename In>
struct CheckFunctor {
  float* found_inf;
  float* per_tensor;
  template <typename Meta>
  __device__ void operator()(const Meta& meta, int t, int64_t chunk) const {
    const ChunkRange range(meta.sizes[t], chunk);
    const In* x_ptr = static_cast<const In*>(meta.addresses[0][t]) + range.start;
    const int head = head_to_align(x_ptr);
    const ArrayRef<const In> x(x_ptr, head);
    bool bad = false;
    float v[kUnroll][kILP];
    for_each_pack(
        Split(range.length, head), [&](int u, int64_t i, int count) { load(v[u], x, i, count); },
        [&](int u, int64_t, int count) {
#pragma unroll
          for (int k = 0; k < kILP; ++k) {
            if (k < count) bad |= stores_nonfinite<float>(v[u][k]);
          }
        });
    report(bad, found_inf, per_tensor, meta.tensor_index[t]);
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

// Each block's share of its tensor's fingerprint (see ops.fingerprint): the sum over its chunk
// of fingerprint_bits::term(bits, index) in uint32 arithmetic, which wraps mod 2**32 as the
// contract does, added to the tensor's sum with a wrapping atomicAdd: integer sums in any order
// agree, so the result is deterministic.  The elements are read as raw bits, never converted.
template <typename In>
struct FingerprintFunctor {
  uint32_t* sums;
  template <typename Meta>
  __device__ void operator()(const Meta& meta, int t, int64_t chunk) const {
    using Bits = std::conditional_t<sizeof(In) == 2, uint16_t, uint32_t>;
    const ChunkRange range(meta.sizes[t], chunk);
    const Bits* x_ptr = static_cast<const Bits*>(meta.addresses[0][t]) + range.start;
    const int head = head_to_align(x_ptr);
    const ArrayRef<const Bits> x(x_ptr, head);
    const uint32_t first = static_cast<uint32_t>(range.start);
    uint32_t sum = 0;
    Bits v[kUnroll][kILP];
    for_each_pack(
        Split(range.length, head),
        [&](int u, int64_t i, int count) {
          if (count == kILP && x.vectors) {
            const Pack<Bits, kILP> pack = *reinterpret_cast<const Pack<Bits, kILP>*>(x.p + i);
#pragma unroll
            for (int k = 0; k < kILP; ++k) v[u][k] = pack.values[k];
          } else {
            for (int k = 0; k < count; ++k) v[u][k] = x.p[i + k];
          }
        },
        [&](int u, int64_t i, int count) {
#pragma unroll
          for (int k = 0; k < kILP; ++k) {
            if (k < count) {
              sum += fingerprint_bits::term(v[u][k], first + static_cast<uint32_t>(i + k));
            }
          }
        });
    sum = block_sum(sum);
    if (threadIdx.x == 0) atomicAdd(sums + meta.tensor_index[t], sum);
  }
};

// Each block's sum of squares, every square and sum in double (a float square overflows for
// |x| > ~1.8e19 and underflows below ~1e-23): partials[block_offset + block], the blocks of one
// tensor consecutive.  The GPU is bandwidth-bound here, double arithmetic included.
template <typename In>
struct SumOfSquaresFunctor {
  double* partials;
  template <typename Meta>
  __device__ void operator()(const Meta& meta, int t, int64_t chunk) const {
    const ChunkRange range(meta.sizes[t], chunk);
    const In* x_ptr = static_cast<const In*>(meta.addresses[0][t]) + range.start;
    const int head = head_to_align(x_ptr);
    const ArrayRef<const In> x(x_ptr, head);
    double sum = 0.0;
    float v[kUnroll][kILP];
    for_each_pack(
        Split(range.length, head), [&](int u, int64_t i, int count) { load(v[u], x, i, count); },
        [&](int u, int64_t, int count) {
#pragma unroll
          for (int k = 0; k < kILP; ++k) {
            if (k < count) sum += static_cast<double>(v[u][k]) * static_cast<double>(v[u][k]);
          }
        });
    sum = block_sum(sum);
    if (threadIdx.x == 0) partials[meta.block_offset + blockIdx.x] = sum;
  }
};

// Where each tensor's partial sums are, for one launch of sum_partials_kernel: in the kernel
// parameters, so the second stage needs no host-to-device copy either.
constexpr int kRangesPerLaunch = 240;
struct PartialRanges {
  int64_t begin[kRangesPerLaunch];
  int32_t count[kRangesPerLaunch];
  int32_t first_tensor;
};
static_assert(sizeof(PartialRanges) + 2 * sizeof(void*) <= 4096, "sum_partials_kernel's parameters exceed 4 KiB");

// per_tensor[first + b] = the sum of tensor (first + b)'s partials, in a fixed order.
__global__ void __launch_bounds__(kBlockSize)
    sum_partials_kernel(const double* partials, const PartialRanges ranges, double* per_tensor) {
  double sum = 0.0;
  const int64_t begin = ranges.begin[blockIdx.x];
  for (int64_t i = threadIdx.x; i < ranges.count[blockIdx.x]; i += blockDim.x) sum += partials[begin + i];
  sum = block_sum(sum);
  if (threadIdx.x == 0) per_tensor[ranges.first_tensor + blockIdx.x] = sum;
}

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
  } else {
    *hysteresis_tracker = hysteresis;  // a clean backward ends a run of overflows (apex)
    if (++*growth_tracker >= growth_interval) {
      *scale = fminf(*scale * growth_factor, max_scale);
      *growth_tracker = 0;
    }
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

// Runs Functor<In, Out> over (inputs, outputs), one set of launches per pair of dtypes.
template <template <typename, typename> class Functor, typename... Args>
void launch_pairs(const std::vector<std::vector<at::Tensor>>& lists, Args... args) {
  for (const auto& group : group_by_dtypes(lists)) {
    const auto sub = select(lists, group);
    with_type(sub[0][0].scalar_type(), [&](auto in) {
      with_type(sub[1][0].scalar_type(), [&](auto out) {
        launch<2>(sub, {}, as_indices(group), Functor<decltype(in), decltype(out)>{args...});
      });
    });
  }
}

void unscale_(at::TensorList inputs, at::TensorList outputs, const at::Tensor& inv_scale, const at::Tensor& found_inf,
              const std::optional<at::Tensor>& per_tensor) {
  const at::Device device = cuda_device_of("unscale_", {inputs, outputs}, {&found_inf, &inv_scale});
  check_same_length("unscale_", "inputs", inputs.size(), "outputs", outputs.size());
  check_flag("unscale_", "inv_scale", inv_scale, device);
  check_flag("unscale_", "found_inf", found_inf, device);
  float* flags = optional_flags("unscale_", per_tensor, inputs.size(), device);
  for (size_t i = 0; i < inputs.size(); ++i) check_row("unscale_", i, {inputs[i], outputs[i]}, device);
  const c10::cuda::CUDAGuard guard(device);
  DenseRows rows("unscale_", {inputs.vec(), outputs.vec()}, {false, true});
  launch_pairs<UnscaleFunctor>({rows.list(0), rows.list(1)}, inv_scale.data_ptr<float>(),
                               found_inf.data_ptr<float>(), flags);
  rows.finish();
}

void accumulate_(at::TensorList inputs, at::TensorList outputs, const at::Tensor& inv_scale,
                 const at::Tensor& found_inf, double out_weight) {
  const at::Device device = cuda_device_of("accumulate_", {inputs, outputs}, {&found_inf, &inv_scale});
  check_same_length("accumulate_", "inputs", inputs.size(), "outputs", outputs.size());
  check_flag("accumulate_", "inv_scale", inv_scale, device);
  check_flag("accumulate_", "found_inf", found_inf, device);
  for (size_t i = 0; i < inputs.size(); ++i) check_row("accumulate_", i, {inputs[i], outputs[i]}, device);
  const c10::cuda::CUDAGuard guard(device);
  DenseRows rows("accumulate_", {inputs.vec(), outputs.vec()}, {false, true});
  launch_pairs<AccumulateFunctor>({rows.list(0), rows.list(1)}, inv_scale.data_ptr<float>(),
                                  found_inf.data_ptr<float>(), static_cast<float>(out_weight));
  rows.finish();
}

void copy_(at::TensorList outputs, at::TensorList inputs) {
  check_same_length("copy_", "outputs", outputs.size(), "inputs", inputs.size());
  if (inputs.empty()) return;
  const at::Device device = cuda_device_of("copy_", {inputs, outputs});
  for (size_t i = 0; i < inputs.size(); ++i) check_row("copy_", i, {inputs[i], outputs[i]}, device);
  const c10::cuda::CUDAGuard guard(device);
  DenseRows rows("copy_", {inputs.vec(), outputs.vec()}, {false, true});
  launch_pairs<CopyFunctor>({rows.list(0), rows.list(1)});
  rows.finish();
}

void adopt_changes_(at::TensorList masters, at::TensorList models, const std::optional<at::Tensor>& only) {
  check_same_length("adopt_changes_", "masters", masters.size(), "models", models.size());
  if (models.empty()) return;
  const at::Device device = cuda_device_of("adopt_changes_", {models, masters});
  const float* selected = optional_flags("adopt_changes_", only, models.size(), device);
  for (size_t i = 0; i < models.size(); ++i) check_master_row("adopt_changes_", i, models[i], masters[i], device);
  const c10::cuda::CUDAGuard guard(device);
  DenseRows rows("adopt_changes_", {models.vec(), masters.vec()}, {false, true});
  launch_pairs<AdoptFunctor>({rows.list(0), rows.list(1)}, selected);
  rows.finish();
}

void check_finite_(at::TensorList inputs, const at::Tensor& found_inf, const std::optional<at::Tensor>& per_tensor) {
  const at::Device device = cuda_device_of("check_finite_", {inputs}, {&found_inf});
  check_flag("check_finite_", "found_inf", found_inf, device);
  float* flags = optional_flags("check_finite_", per_tensor, inputs.size(), device);
  for (size_t i = 0; i < inputs.size(); ++i) check_row("check_finite_", i, {inputs[i]}, device);
  const c10::cuda::CUDAGuard guard(device);
  DenseRows rows("check_finite_", {inputs.vec()}, {false});
  const std::vector<std::vector<at::Tensor>> lists = {rows.list(0)};
  for (const auto& group : group_by_dtypes(lists)) {
    const auto sub = select(lists, group);
    with_type(sub[0][0].scalar_type(), [&](auto in) {
      launch<1>(sub, {}, as_indices(group), CheckFunctor<decltype(in)>{found_inf.data_ptr<float>(), flags});
    });
  }
}

at::Tensor fingerprint(at::TensorList inputs) {
  TORCH_CHECK(!inputs.empty(), "ampinit.fingerprint: on CUDA, pass at least one tensor (the device comes from it)");
  const at::Device device = cuda_device_of("fingerprint", {inputs});
  for (size_t i = 0; i < inputs.size(); ++i) check_row("fingerprint", i, {inputs[i]}, device);
  const c10::cuda::CUDAGuard guard(device);
  DenseRows rows("fingerprint", {inputs.vec()}, {false});  // dense tensors in memory order, others as their copy
  const std::vector<std::vector<at::Tensor>> lists = {rows.list(0)};
  const auto options = at::TensorOptions().dtype(at::kInt).device(device);
  at::Tensor sums = at::zeros({static_cast<int64_t>(inputs.size())}, options);
  auto* out = reinterpret_cast<uint32_t*>(sums.data_ptr<int32_t>());
  for (const auto& group : group_by_dtypes(lists)) {
    const auto sub = select(lists, group);
    with_type(sub[0][0].scalar_type(), [&](auto in) {
      launch<1>(sub, {}, as_indices(group), FingerprintFunctor<decltype(in)>{out});
    });
  }
  return sums.to(at::kLong).bitwise_and(0xFFFFFFFFLL);  // the uint32 sums, as int64
}

std::tuple<at::Tensor, at::Tensor> l2norm(at::TensorList inputs, bool per_tensor) {
  TORCH_CHECK(!inputs.empty(), "ampinit.l2norm: on CUDA, pass at least one tensor (the device comes from it)");
  const at::Device device = cuda_device_of("l2norm", {inputs});
  for (size_t i = 0; i < inputs.size(); ++i) check_row("l2norm", i, {inputs[i]}, device);
  const c10::cuda::CUDAGuard guard(device);
  DenseRows rows("l2norm", {inputs.vec()}, {false});
  const std::vector<std::vector<at::Tensor>> lists = {rows.list(0)};
  const auto& in = lists[0];
  // Partial sums are laid out group by group, tensor by tensor within a group, in launch
  // order: begin[t] is tensor t's first, count[t] how many (its chunks; empty tensors have none).
  const auto groups = group_by_dtypes(lists);
  std::vector<int64_t> begin(in.size(), 0);
  std::vector<int32_t> count(in.size(), 0);
  int64_t total_chunks = 0;
  for (const auto& group : groups) {
    for (size_t t : group) {
      begin[t] = total_chunks;
      count[t] = static_cast<int32_t>((in[t].numel() + kChunkSize - 1) / kChunkSize);
      total_chunks += count[t];
    }
  }
  const auto options = at::TensorOptions().dtype(at::kDouble).device(device);
  at::Tensor partials = at::empty({std::max<int64_t>(total_chunks, 1)}, options);
  for (const auto& group : groups) {
    const auto sub = select(lists, group);
    with_type(sub[0][0].scalar_type(), [&](auto type) {
      launch<1>(sub, {}, as_indices(group),
                SumOfSquaresFunctor<decltype(type)>{partials.data_ptr<double>() + begin[group[0]]});
    });
  }
  at::Tensor sums = at::empty({static_cast<int64_t>(in.size())}, options);
  const auto stream = at::cuda::getCurrentCUDAStream();
  for (size_t first = 0; first < in.size(); first += kRangesPerLaunch) {
    const size_t n = std::min<size_t>(kRangesPerLaunch, in.size() - first);
    PartialRanges ranges{};
    ranges.first_tensor = static_cast<int32_t>(first);
    for (size_t b = 0; b < n; ++b) {
      ranges.begin[b] = begin[first + b];
      ranges.count[b] = count[first + b];
    }
    sum_partials_kernel<<<n, kBlockSize, 0, stream>>>(partials.data_ptr<double>(), ranges, sums.data_ptr<double>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
  at::Tensor total = sums.sum().sqrt().to(at::kFloat).reshape({1});
  at::Tensor norms = per_tensor ? sums.sqrt().to(at::kFloat) : at::empty({0}, at::dtype(at::kFloat).device(device));
  return {total, norms};
}

void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& hysteresis_tracker,
                   const at::Tensor& overflow_count, const at::Tensor& found_inf, double growth_factor,
                   double backoff_factor, int64_t growth_interval, int64_t hysteresis, double min_scale,
                   double max_scale) {
  const at::Device device =
      cuda_device_of("update_scale_", {}, {&scale, &found_inf, &growth_tracker, &hysteresis_tracker, &overflow_count});
  check_flag("update_scale_", "scale", scale, device);
  check_flag("update_scale_", "found_inf", found_inf, device);
  TORCH_CHECK(growth_tracker.numel() == 1 && growth_tracker.scalar_type() == at::kInt &&
                  growth_tracker.device() == device && hysteresis_tracker.numel() == 1 &&
                  hysteresis_tracker.scalar_type() == at::kInt && hysteresis_tracker.device() == device &&
                  overflow_count.numel() == 1 && overflow_count.scalar_type() == at::kLong &&
                  overflow_count.device() == device,
              "ampinit.update_scale_: growth_tracker and hysteresis_tracker must be 1-element int32 tensors "
              "and overflow_count a 1-element int64 tensor, all on the scale's device");
  const c10::cuda::CUDAGuard guard(device);
  update_scale_kernel<<<1, 1, 0, at::cuda::getCurrentCUDAStream()>>>(
      scale.data_ptr<float>(), growth_tracker.data_ptr<int32_t>(), hysteresis_tracker.data_ptr<int32_t>(),
      overflow_count.data_ptr<int64_t>(), found_inf.data_ptr<float>(), static_cast<float>(growth_factor),
      static_cast<float>(backoff_factor), growth_interval, static_cast<int32_t>(hysteresis),
      static_cast<float>(min_scale), static_cast<float>(max_scale));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

TORCH_LIBRARY_IMPL(ampinit, CUDA, m) {
  m.impl("unscale_", &unscale_);
  m.impl("accumulate_", &accumulate_);
  m.impl("copy_", &copy_);
  m.impl("adopt_changes_", &adopt_changes_);
  m.impl("check_finite_", &check_finite_);
  m.impl("fingerprint", &fingerprint);
  m.impl("l2norm", &l2norm);
  m.impl("update_scale_", &update_scale_);
}

}  // namespace ampinit::cuda

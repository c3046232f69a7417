// CUDA implementations of the fused optimizers, on the multi-tensor launcher.
//
// Every block returns early when found_inf is set: a skipped step costs one read of a flag, not
// a sync.  The step counters (and SGD's new-buffer flags) are read by the update kernel and
// advanced by a small kernel launched after it, so that no block sees another's advance, and
// nothing is advanced unless the update was launched (a failed contiguous copy, say, raises
// before any launch).  With `hyper`, the hyper-parameters are read from device memory too: a
// replayed CUDA graph sees values changed in place (LR schedulers).
//
// The arithmetic is the CPU kernels' (cpu/kernels.h), in float32 with the same fused
// multiply-adds, so both follow torch.optim's fused kernels; each stored value is rounded once.
#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#include <torch/library.h>

#include <algorithm>
#include <optional>
#include <type_traits>
#include <vector>

#include "common.cuh"
#include "multi_tensor.cuh"

namespace ampinit::cuda {
namespace {

struct NoModel {};  // the model-copy type of a call without model copies

// The optimizers' type combinations: float params with any grad and an optional 16-bit model
// copy; 16-bit params (16-bit state) with any grad and no model copy.  fn(P{}, G{}, M{}).
template <typename Fn>
void with_optimizer_types(c10::ScalarType param, c10::ScalarType grad, std::optional<c10::ScalarType> model,
                          const Fn& fn) {
  with_type(grad, [&](auto g) {
    if (param == at::kFloat) {
      if (!model.has_value()) {
        fn(float{}, g, NoModel{});
      } else if (*model == at::kHalf) {
        fn(float{}, g, at::Half{});
      } else {
        fn(float{}, g, at::BFloat16{});
      }
    } else if (param == at::kHalf) {
      fn(at::Half{}, g, NoModel{});
    } else {
      fn(at::BFloat16{}, g, NoModel{});
    }
  });
}

// A call's hyper-parameters: the float arguments, or the device vector `hyper` when given.
template <int N>
struct Hyper {
  double values[N];
  const double* device;  // null unless capturable
  __device__ __forceinline__ double operator[](int i) const { return device != nullptr ? device[i] : values[i]; }
};

// torch's lerp: self + weight * (end - self), or end + (weight - 1) * (end - self) from 0.5.
__device__ __forceinline__ float lerp(float self, float end, float weight) {
  return fabsf(weight) < 0.5f ? fmaf(weight, end - self, self) : fmaf(weight - 1.0f, end - self, end);
}

// Lists: param, grad, exp_avg, exp_avg_sq[, model]; meta.scalars[0]: the step counters (not yet
// advanced for this step).
template <typename P, typename G, typename M>
struct AdamFunctor {
  static constexpr bool kModel = !std::is_same_v<M, NoModel>;
  Hyper<5> h;  // lr, beta1, beta2, eps, weight_decay
  bool decoupled_weight_decay, bias_correction;
  const float* inv_scale;
  const float* found_inf;

  template <typename Meta>
  __device__ void operator()(const Meta& meta, int t, int64_t chunk) const {
    if (*found_inf != 0.0f) return;  // the skipped step leaves everything as it was
    // The scalars as torch.optim computes them on the host: in double, rounded to float once.
    const double lr = h[0], beta1 = h[1], beta2 = h[2], weight_decay = h[4];
    const double step = static_cast<double>(*meta.scalars[0][t]) + 1.0;
    const double bc1 = bias_correction ? 1.0 - pow(beta1, step) : 1.0;
    const double bc2 = bias_correction ? 1.0 - pow(beta2, step) : 1.0;
    const float neg_step_size = static_cast<float>(-(lr / bc1));
    const float bc2_sqrt = static_cast<float>(sqrt(bc2));
    const float one_minus_beta1 = static_cast<float>(1.0 - beta1);
    const float beta2_f = static_cast<float>(beta2), one_minus_beta2 = static_cast<float>(1.0 - beta2);
    const float eps = static_cast<float>(h[3]), wd = static_cast<float>(weight_decay);
    const float decay = static_cast<float>(1.0 - lr * weight_decay);
    const bool coupled = wd != 0.0f && !decoupled_weight_decay, decoupled = wd != 0.0f && decoupled_weight_decay;
    const float inv = *inv_scale;

    const ChunkRange range(meta.sizes[t], chunk);
    P* param_ptr = static_cast<P*>(meta.addresses[0][t]) + range.start;
    const int head = head_to_align(param_ptr);  // three of the four or five arrays are P
    const ArrayRef<P> param(param_ptr, head);
    const ArrayRef<const G> grad(static_cast<const G*>(meta.addresses[1][t]) + range.start, head);
    const ArrayRef<P> exp_avg(static_cast<P*>(meta.addresses[2][t]) + range.start, head);
    const ArrayRef<P> exp_avg_sq(static_cast<P*>(meta.addresses[3][t]) + range.start, head);
    using ModelT = std::conditional_t<kModel, M, float>;
    ModelT* model_ptr = nullptr;
    if constexpr (kModel) model_ptr = static_cast<ModelT*>(meta.addresses[4][t]) + range.start;
    const ArrayRef<ModelT> model(model_ptr, head);

    float g[kUnroll][kILP], w[kUnroll][kILP], m[kUnroll][kILP], v[kUnroll][kILP];
    for_each_pack(
        Split(range.length, head),
        [&](int u, int64_t i, int count) {
          load(g[u], grad, i, count);
          load(w[u], param, i, count);
          load(m[u], exp_avg, i, count);
          load(v[u], exp_avg_sq, i, count);
        },
        [&](int u, int64_t i, int count) {
#pragma unroll
          for (int k = 0; k < kILP; ++k) {
            if (k >= count) break;
            float gk = g[u][k] * inv;
            if (coupled) gk = fmaf(w[u][k], wd, gk);
            if (decoupled) w[u][k] *= decay;
            m[u][k] = lerp(m[u][k], gk, one_minus_beta1);
            v[u][k] = fmaf(one_minus_beta2 * gk, gk, v[u][k] * beta2_f);
            const float denom = sqrtf(v[u][k]) / bc2_sqrt + eps;
            w[u][k] = w[u][k] + neg_step_size * m[u][k] / denom;
          }
          store(param, i, w[u], count);
          store(exp_avg, i, m[u], count);
          store(exp_avg_sq, i, v[u], count);
          if constexpr (kModel) store(model, i, w[u], count);
        });
  }
};

// Lists: param, grad[, momentum_buffer][, model]; meta.scalars[0]: steps, [1]: new-buffer flags.
template <typename P, typename G, typename M, bool HasMomentum>
struct SgdFunctor {
  static constexpr bool kModel = !std::is_same_v<M, NoModel>;
  Hyper<4> h;  // lr, momentum, dampening, weight_decay
  bool nesterov;
  const float* inv_scale;
  const float* found_inf;

  template <typename Meta>
  __device__ void operator()(const Meta& meta, int t, int64_t chunk) const {
    if (*found_inf != 0.0f) return;
    const float lr = static_cast<float>(h[0]), momentum = static_cast<float>(h[1]);
    const float one_minus_dampening = static_cast<float>(1.0 - h[2]), wd = static_cast<float>(h[3]);
    // torch's rule: a buffer that was never applied becomes the gradient.
    const bool new_buffer = HasMomentum && *meta.scalars[1][t] != 0.0f;
    const float inv = *inv_scale;

    const ChunkRange range(meta.sizes[t], chunk);
    P* param_ptr = static_cast<P*>(meta.addresses[0][t]) + range.start;
    const int head = head_to_align(param_ptr);
    const ArrayRef<P> param(param_ptr, head);
    const ArrayRef<const G> grad(static_cast<const G*>(meta.addresses[1][t]) + range.start, head);
    P* buffer_ptr = nullptr;
    if constexpr (HasMomentum) buffer_ptr = static_cast<P*>(meta.addresses[2][t]) + range.start;
    const ArrayRef<P> buffer(buffer_ptr, head);
    using ModelT = std::conditional_t<kModel, M, float>;
    ModelT* model_ptr = nullptr;
    if constexpr (kModel) model_ptr = static_cast<ModelT*>(meta.addresses[HasMomentum ? 3 : 2][t]) + range.start;
    const ArrayRef<ModelT> model(model_ptr, head);

    float g[kUnroll][kILP], w[kUnroll][kILP], b[kUnroll][kILP];
    for_each_pack(
        Split(range.length, head),
        [&](int u, int64_t i, int count) {
          load(g[u], grad, i, count);
          load(w[u], param, i, count);
          if constexpr (HasMomentum) {
            if (!new_buffer) load(b[u], buffer, i, count);
          }
        },
        [&](int u, int64_t i, int count) {
#pragma unroll
          for (int k = 0; k < kILP; ++k) {
            if (k >= count) break;
            float gk = g[u][k] * inv;
            if (wd != 0.0f) gk = fmaf(w[u][k], wd, gk);
            if constexpr (HasMomentum) {
              b[u][k] = new_buffer ? gk : fmaf(one_minus_dampening, gk, b[u][k] * momentum);
              gk = nesterov ? fmaf(b[u][k], momentum, gk) : b[u][k];
            }
            w[u][k] = fmaf(gk, -lr, w[u][k]);
          }
          store(param, i, w[u], count);
          if constexpr (HasMomentum) store(buffer, i, b[u], count);
          if constexpr (kModel) store(model, i, w[u], count);
        });
  }
};

// After the update: steps += 1 and new-buffer flags = 0, unless found_inf.  The pointers travel
// in the kernel parameters, kStepsPerLaunch rows per launch.
constexpr int kStepsPerLaunch = 240;
struct StepList {
  float* steps[kStepsPerLaunch];
  float* new_buffer[kStepsPerLaunch];
  int32_t count;
};
static_assert(sizeof(StepList) + sizeof(void*) <= 4096, "finish_step_kernel's parameters exceed 4 KiB");

__global__ void finish_step_kernel(const StepList list, const float* found_inf) {
  const int i = static_cast<int>(threadIdx.x);
  if (i >= list.count || *found_inf != 0.0f) return;
  *list.steps[i] += 1.0f;
  if (list.new_buffer[i] != nullptr) *list.new_buffer[i] = 0.0f;
}

void finish_step(at::TensorList steps, at::TensorList new_buffer_flags, const at::Tensor& found_inf) {
  const auto stream = at::cuda::getCurrentCUDAStream();
  for (size_t first = 0; first < steps.size(); first += kStepsPerLaunch) {
    StepList list{};
    list.count = static_cast<int32_t>(std::min<size_t>(kStepsPerLaunch, steps.size() - first));
    for (int32_t i = 0; i < list.count; ++i) {
      list.steps[i] = steps[first + i].data_ptr<float>();
      list.new_buffer[i] = new_buffer_flags.empty() ? nullptr : new_buffer_flags[first + i].data_ptr<float>();
    }
    finish_step_kernel<<<1, 256, 0, stream>>>(list, found_inf.data_ptr<float>());
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  }
}

// The call's dense lists with the per-row scalars (step, new-buffer flag) beside them, grouped
// by the dtypes of (param, grad[, model]).
struct Prepared {
  std::vector<std::vector<at::Tensor>> lists;
  std::vector<RowScalars> scalars;
};

template <typename Launch>
void for_each_dtype_group(const Prepared& call, const Launch& launch_group) {
  for (const auto& group : group_by_dtypes(call.lists)) {
    std::vector<RowScalars> scalars;
    for (size_t r : group) scalars.push_back(call.scalars[r]);
    launch_group(select(call.lists, group), scalars, as_indices(group));
  }
}

template <int N>
Hyper<N> make_hyper(std::initializer_list<double> values, const std::optional<at::Tensor>& hyper) {
  Hyper<N> h{};
  std::copy(values.begin(), values.end(), h.values);
  h.device = hyper.has_value() ? hyper->data_ptr<double>() : nullptr;
  return h;
}

void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList steps, at::TensorList models, double lr, double beta1, double beta2, double eps,
                 double weight_decay, bool decoupled_weight_decay, bool bias_correction,
                 const at::Tensor& inv_scale, const at::Tensor& found_inf, const std::optional<at::Tensor>& hyper) {
  const at::Device device = cuda_device_of("fused_adam_", {params, grads}, {&found_inf, &inv_scale});
  check_flag("fused_adam_", "inv_scale", inv_scale, device);
  check_flag("fused_adam_", "found_inf", found_inf, device);
  check_hyper("fused_adam_", hyper, 5, "[lr, beta1, beta2, eps, weight_decay]", device);
  check_optimizer_lists("fused_adam_", params, grads, {exp_avgs, exp_avg_sqs}, steps, models, device);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(device);
  std::vector<std::vector<at::Tensor>> lists = {params.vec(), grads.vec(), exp_avgs.vec(), exp_avg_sqs.vec()};
  std::vector<bool> written = {true, false, true, true};
  if (!models.empty()) {
    lists.push_back(models.vec());
    written.push_back(true);
  }
  DenseRows rows(lists, written);  // may copy (and raise) before anything is launched
  Prepared call;
  for (size_t l = 0; l < lists.size(); ++l) call.lists.push_back(rows.list(l));
  for (const auto& step : steps) call.scalars.push_back({step.data_ptr<float>(), nullptr});
  const auto h = make_hyper<5>({lr, beta1, beta2, eps, weight_decay}, hyper);
  for_each_dtype_group(call, [&](const auto& sub, const auto& scalars, const auto& indices) {
    const auto model_type = models.empty() ? std::nullopt : std::optional(sub[4][0].scalar_type());
    with_optimizer_types(sub[0][0].scalar_type(), sub[1][0].scalar_type(), model_type, [&](auto p, auto g, auto m) {
      using Functor = AdamFunctor<decltype(p), decltype(g), decltype(m)>;
      const Functor functor{h, decoupled_weight_decay, bias_correction, inv_scale.data_ptr<float>(),
                            found_inf.data_ptr<float>()};
      if constexpr (Functor::kModel) {
        launch<5>(sub, scalars, indices, functor);
      } else {
        launch<4>(sub, scalars, indices, functor);
      }
    });
  });
  finish_step(steps, {}, found_inf);
  rows.finish();
}

void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, at::TensorList steps,
                at::TensorList models, double lr, double momentum, double dampening, double weight_decay,
                bool nesterov, const at::Tensor& inv_scale, const at::Tensor& found_inf,
                at::TensorList new_buffer_flags, const std::optional<at::Tensor>& hyper) {
  const at::Device device = cuda_device_of("fused_sgd_", {params, grads}, {&found_inf, &inv_scale});
  check_flag("fused_sgd_", "inv_scale", inv_scale, device);
  check_flag("fused_sgd_", "found_inf", found_inf, device);
  check_hyper("fused_sgd_", hyper, 4, "[lr, momentum, dampening, weight_decay]", device);
  const bool has_momentum = !momentum_buffers.empty();
  // With `hyper` the momentum may change between steps (a scheduler cycling it); the buffers
  // decide the structure then.
  TORCH_CHECK(hyper.has_value() || has_momentum == (momentum != 0.0) || params.empty(),
              "ampinit.fused_sgd_: pass one momentum buffer per param exactly when momentum is nonzero");
  std::vector<at::TensorList> states;
  if (has_momentum) states.push_back(momentum_buffers);
  check_optimizer_lists("fused_sgd_", params, grads, states, steps, models, device);
  check_new_buffer_flags("fused_sgd_", new_buffer_flags, momentum_buffers.size(), device);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(device);
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
  Prepared call;
  for (size_t l = 0; l < lists.size(); ++l) call.lists.push_back(rows.list(l));
  for (size_t i = 0; i < steps.size(); ++i) {
    call.scalars.push_back({steps[i].data_ptr<float>(), has_momentum ? new_buffer_flags[i].data_ptr<float>() : nullptr});
  }
  const auto h = make_hyper<4>({lr, momentum, dampening, weight_decay}, hyper);
  for_each_dtype_group(call, [&](const auto& sub, const auto& scalars, const auto& indices) {
    const auto model_type = models.empty() ? std::nullopt : std::optional(sub.back()[0].scalar_type());
    with_optimizer_types(sub[0][0].scalar_type(), sub[1][0].scalar_type(), model_type, [&](auto p, auto g, auto m) {
      using P = decltype(p);
      using G = decltype(g);
      using M = decltype(m);
      constexpr bool kModel = !std::is_same_v<M, NoModel>;
      const float* inv = inv_scale.data_ptr<float>();
      const float* found = found_inf.data_ptr<float>();
      if (has_momentum) {
        launch<kModel ? 4 : 3>(sub, scalars, indices, SgdFunctor<P, G, M, true>{h, nesterov, inv, found});
      } else {
        launch<kModel ? 3 : 2>(sub, scalars, indices, SgdFunctor<P, G, M, false>{h, nesterov, inv, found});
      }
    });
  });
  finish_step(steps, new_buffer_flags, found_inf);
  rows.finish();
}

}  // namespace

TORCH_LIBRARY_IMPL(ampinit, CUDA, m) {
  m.impl("fused_adam_", &fused_adam_);
  m.impl("fused_sgd_", &fused_sgd_);
}

}  // namespace ampinit::cuda

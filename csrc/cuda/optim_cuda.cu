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
// The optimizer state has a dtype of its own (the param's, float32, or bfloat16 beside float32
// params), and bfloat16 params may keep remainders: their FP32 masters, joined before the
// update and split after it as cpu/kernels.h does.
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

struct NoModel {};  // the model-copy type of a call without model copies

// The optimizers' type combinations, fn(P{}, G{}, S{}, M{}, std::bool_constant<Remainder>{}):
// float params with float32 or bfloat16 state and an optional 16-bit model copy; float16 params
// with float16 or float32 state; bfloat16 params with bfloat16 or float32 state, with or without
// remainders; any grad.  16-bit params have no model copy.  check_optimizer_lists admits no
// other state dtype, so each branch instantiates only the two states its param allows.
template <typename Fn>
void with_optimizer_types(c10::ScalarType param, c10::ScalarType grad, c10::ScalarType state,
                          std::optional<c10::ScalarType> model, bool remainder, const Fn& fn) {
  with_type(grad, [&](auto g) {
    if (param == at::kFloat) {
      auto with_model = [&](auto s) {
        if (!model.has_value()) {
          fn(float{}, g, s, NoModel{}, std::false_type{});
        } else if (*model == at::kHalf) {
          fn(float{}, g, s, at::Half{}, std::false_type{});
        } else {
          fn(float{}, g, s, at::BFloat16{}, std::false_type{});
        }
      };
      if (state == at::kBFloat16) {
        with_model(at::BFloat16{});
      } else {
        with_model(float{});
      }
    } else if (param == at::kHalf) {
      if (state == at::kFloat) {
        fn(at::Half{}, g, float{}, NoModel{}, std::false_type{});
      } else {
        fn(at::Half{}, g, at::Half{}, NoModel{}, std::false_type{});
      }
    } else {
      auto with_remainder = [&](auto s) {
        if (remainder) {
          fn(at::BFloat16{}, g, s, NoModel{}, std::true_type{});
        } else {
          fn(at::BFloat16{}, g, s, NoModel{}, std::false_type{});
        }
      };
      if (state == at::kFloat) {
        with_remainder(float{});
      } else {
        with_remainder(at::BFloat16{});
      }
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

// The scalar head of a chunk aligns its widest array: the param or the state (float32 state
// beside 16-bit params).  `state` is null for SGD without momentum.
template <typename P, typename S>
__device__ __forceinline__ int head_for(const P* param, const S* state) {
  if constexpr (sizeof(S) > sizeof(P)) {
    if (state != nullptr) return head_to_align(state);
  }
  return head_to_align(param);
}

// -- remainder masters (the format: master_bits.h): a bfloat16 weight, an int16 remainder, a tie bit
//
// bits(master) = (bits(weight) << 16) + remainder (+ 0x10000 when the tie bit is set), mod 2^32.
// The tie bit of element j is bit j % 32 of word j / 32; it is read and written only where the
// remainder is -32768.  One thread owns an element, so only it changes the element's bit, but
// the word's other bits belong to other threads of the block (a chunk, 65536 elements, never
// splits a word): a write is an atomicOr / atomicAnd of the one bit, and a read is volatile, as
// the word changes under those atomics during the kernel.

__device__ __forceinline__ bool tie_bit(const uint32_t* ties, int64_t j) {
  return (*reinterpret_cast<const volatile uint32_t*>(ties + (j >> 5)) >> (j & 31)) & 1u;
}

__device__ __forceinline__ void set_tie_bit(uint32_t* ties, int64_t j, bool value) {
  if (tie_bit(ties, j) == value) return;  // the common case writes nothing
  const uint32_t mask = 1u << (j & 31);
  if (value) {
    atomicOr(reinterpret_cast<unsigned int*>(ties + (j >> 5)), mask);
  } else {
    atomicAnd(reinterpret_cast<unsigned int*>(ties + (j >> 5)), ~mask);
  }
}

// join, split and stochastic rounding: master_bits.h, shared with the CPU kernels.
__device__ __forceinline__ float join_master(uint16_t weight, int16_t remainder, bool tie) {
  return __uint_as_float(bf16_bits::joined(weight, remainder, tie));
}

__device__ __forceinline__ void split_master(float master, uint16_t& weight, int16_t& remainder, bool& tie) {
  bf16_bits::split(__float_as_uint(master), weight, remainder, tie);
}

// Raw elements of an array, in vectors where aligned (the weights' and remainders' bits).
template <typename T>
__device__ __forceinline__ void load_bits(T (&out)[kILP], const ArrayRef<T>& a, int64_t i, int count) {
  if (count == kILP && a.vectors) {
    const Pack<T, kILP> pack = *reinterpret_cast<const Pack<T, kILP>*>(a.p + i);
#pragma unroll
    for (int k = 0; k < kILP; ++k) out[k] = pack.values[k];
  } else {
#pragma unroll
    for (int k = 0; k < kILP; ++k) {
      if (k >= count) break;
      out[k] = a.p[i + k];
    }
  }
}

template <typename T>
__device__ __forceinline__ void store_bits(const ArrayRef<T>& a, int64_t i, const T (&in)[kILP], int count) {
  if (count == kILP && a.vectors) {
    Pack<T, kILP> pack;
#pragma unroll
    for (int k = 0; k < kILP; ++k) pack.values[k] = in[k];
    *reinterpret_cast<Pack<T, kILP>*>(a.p + i) = pack;
  } else {
#pragma unroll
    for (int k = 0; k < kILP; ++k) {
      if (k >= count) break;
      a.p[i + k] = in[k];
    }
  }
}

// Stores optimizer state: rounded to nearest even, or (bfloat16 state, `stochastic`) with the
// noise of `key` and each element's index in the tensor (`first` + i + k).  Only the rounding
// is per element; the store is still a vector where aligned.
template <typename S>
__device__ __forceinline__ void store_state(const ArrayRef<S>& a, int64_t i, const float (&in)[kILP], int count,
                                            bool stochastic, uint32_t key, int64_t first) {
  if constexpr (std::is_same_v<S, at::BFloat16>) {
    if (stochastic) {
      at::BFloat16 out[kILP];
#pragma unroll
      for (int k = 0; k < kILP; ++k) {
        if (k >= count) break;
        out[k] = at::BFloat16(bf16_bits::stochastic_at(__float_as_uint(in[k]), key, first + i + k), at::BFloat16::from_bits());
      }
      store_bits(a, i, out, count);
      return;
    }
  }
  store(a, i, in, count);
}

// The params of one chunk as the update sees them, in float32: the P values, or with Remainder
// (P = bfloat16) the FP32 masters joined from the weights, the remainders (list `list`) and the
// tie words (list `list + 1`, whose address is the tensor's first word: chunk element i is
// element range.start + i of the tensor).  The weights and remainders move in vectors where
// aligned; the join and the split are per element.
template <typename P, bool Remainder>
struct ChunkParams {
  ArrayRef<P> param;

  template <typename Meta>
  __device__ ChunkParams(const Meta&, int, const ChunkRange&, P* param_ptr, int head, int)
      : param(param_ptr, head) {}
  __device__ __forceinline__ void load(float (&out)[kILP], int64_t i, int count) const {
    ::ampinit::cuda::load(out, param, i, count);
  }
  __device__ __forceinline__ void store(int64_t i, const float (&in)[kILP], int count) const {
    ::ampinit::cuda::store(param, i, in, count);
  }
};

template <>
struct ChunkParams<at::BFloat16, true> {
  ArrayRef<uint16_t> weight;     // the bfloat16 params' bits
  ArrayRef<int16_t> remainder;
  uint32_t* ties;                // the tensor's tie words
  int64_t first;                 // the chunk's first element's index in the tensor

  template <typename Meta>
  __device__ ChunkParams(const Meta& meta, int t, const ChunkRange& range, at::BFloat16* param_ptr, int head,
                         int list)
      : weight(reinterpret_cast<uint16_t*>(param_ptr), head),
        remainder(static_cast<int16_t*>(meta.addresses[list][t]) + range.start, head),
        ties(static_cast<uint32_t*>(meta.addresses[list + 1][t])),
        first(range.start) {}

  __device__ __forceinline__ void load(float (&out)[kILP], int64_t i, int count) const {
    uint16_t w[kILP];
    int16_t r[kILP];
    load_bits(w, weight, i, count);
    load_bits(r, remainder, i, count);
#pragma unroll
    for (int k = 0; k < kILP; ++k) {
      if (k >= count) break;
      const bool tie = r[k] == -32768 && tie_bit(ties, first + i + k);
      out[k] = join_master(w[k], r[k], tie);
    }
  }

  __device__ __forceinline__ void store(int64_t i, const float (&in)[kILP], int count) const {
    uint16_t w[kILP];
    int16_t r[kILP];
#pragma unroll
    for (int k = 0; k < kILP; ++k) {
      if (k >= count) break;
      bool tie;
      split_master(in[k], w[k], r[k], tie);
      if (r[k] == -32768) set_tie_bit(ties, first + i + k, tie);
    }
    store_bits(weight, i, w, count);
    store_bits(remainder, i, r, count);
  }
};

// The join or the split alone (ops.join_masters / split_masters_). Lists: weight (bfloat16),
// remainder, ties, master (float32); the optimizers' ChunkParams does the bits.
template <bool Join>
struct RemainderMastersFunctor {
  template <typename Meta>
  __device__ void operator()(const Meta& meta, int t, int64_t chunk) const {
    const ChunkRange range(meta.sizes[t], chunk);
    at::BFloat16* weight_ptr = static_cast<at::BFloat16*>(meta.addresses[0][t]) + range.start;
    float* master_ptr = static_cast<float*>(meta.addresses[3][t]) + range.start;
    const int head = head_for(weight_ptr, master_ptr);  // aligns the float32 masters
    const ChunkParams<at::BFloat16, true> weight(meta, t, range, weight_ptr, head, 1);
    const ArrayRef<float> master(master_ptr, head);
    float v[kUnroll][kILP];
    for_each_pack(
        Split(range.length, head),
        [&](int u, int64_t i, int count) {
          if constexpr (Join) {
            weight.load(v[u], i, count);
          } else {
            load(v[u], master, i, count);
          }
        },
        [&](int u, int64_t i, int count) {
          if constexpr (Join) {
            store(master, i, v[u], count);
          } else {
            weight.store(i, v[u], count);
          }
        });
  }
};

// Lists: param, grad, exp_avg, exp_avg_sq[, model][, remainder, ties] (a model copy and
// remainders never come together); meta.scalars[0]: the step counters (not yet advanced for
// this step).  With stochastic_state (and bfloat16 state) the moments are rounded
// stochastically (store_state).
template <typename P, typename G, typename S, typename M, bool Remainder>
struct AdamFunctor {
  static constexpr bool kModel = !std::is_same_v<M, NoModel>;
  static constexpr int kDepth = 4 + (kModel ? 1 : 0) + (Remainder ? 2 : 0);
  Hyper<5> h;  // lr, beta1, beta2, eps, weight_decay
  bool decoupled_weight_decay, bias_correction;
  const float* inv_scale;
  const float* found_inf;
  bool stochastic_state;

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
    // The seed is the counter as finish_step leaves it (a float increment, as on the CPU), not
    // `step` above: the two differ past 2^24 steps.
    const uint32_t seed = static_cast<uint32_t>(*meta.scalars[0][t] + 1.0f);
    const uint32_t key_m = bf16_bits::rounding_key(seed, 1), key_v = bf16_bits::rounding_key(seed, 2);

    const ChunkRange range(meta.sizes[t], chunk);
    P* param_ptr = static_cast<P*>(meta.addresses[0][t]) + range.start;
    S* exp_avg_ptr = static_cast<S*>(meta.addresses[2][t]) + range.start;
    const int head = head_for(param_ptr, exp_avg_ptr);
    const ChunkParams<P, Remainder> param(meta, t, range, param_ptr, head, 4);
    const ArrayRef<const G> grad(static_cast<const G*>(meta.addresses[1][t]) + range.start, head);
    const ArrayRef<S> exp_avg(exp_avg_ptr, head);
    const ArrayRef<S> exp_avg_sq(static_cast<S*>(meta.addresses[3][t]) + range.start, head);
    using ModelT = std::conditional_t<kModel, M, float>;
    ModelT* model_ptr = nullptr;
    if constexpr (kModel) model_ptr = static_cast<ModelT*>(meta.addresses[4][t]) + range.start;
    const ArrayRef<ModelT> model(model_ptr, head);

    float g[kUnroll][kILP], w[kUnroll][kILP], m[kUnroll][kILP], v[kUnroll][kILP];
    for_each_pack(
        Split(range.length, head),
        [&](int u, int64_t i, int count) {
          load(g[u], grad, i, count);
          param.load(w[u], i, count);
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
          param.store(i, w[u], count);
          store_state(exp_avg, i, m[u], count, stochastic_state, key_m, range.start);
          store_state(exp_avg_sq, i, v[u], count, stochastic_state, key_v, range.start);
          if constexpr (kModel) store(model, i, w[u], count);
        });
  }
};

// Lists: param, grad[, momentum_buffer][, model][, remainder, ties]; meta.scalars[0]: steps,
// [1]: new-buffer flags.  Without momentum S is P, and unused.
template <typename P, typename G, typename S, typename M, bool Remainder, bool HasMomentum>
struct SgdFunctor {
  static constexpr bool kModel = !std::is_same_v<M, NoModel>;
  static constexpr int kRemainderList = HasMomentum ? 3 : 2;  // no model beside remainders
  static constexpr int kDepth = kRemainderList + (kModel ? 1 : 0) + (Remainder ? 2 : 0);
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
    S* buffer_ptr = nullptr;
    if constexpr (HasMomentum) buffer_ptr = static_cast<S*>(meta.addresses[2][t]) + range.start;
    const int head = head_for(param_ptr, buffer_ptr);
    const ChunkParams<P, Remainder> param(meta, t, range, param_ptr, head, kRemainderList);
    const ArrayRef<const G> grad(static_cast<const G*>(meta.addresses[1][t]) + range.start, head);
    const ArrayRef<S> buffer(buffer_ptr, head);
    using ModelT = std::conditional_t<kModel, M, float>;
    ModelT* model_ptr = nullptr;
    if constexpr (kModel) model_ptr = static_cast<ModelT*>(meta.addresses[HasMomentum ? 3 : 2][t]) + range.start;
    const ArrayRef<ModelT> model(model_ptr, head);

    float g[kUnroll][kILP], w[kUnroll][kILP], b[kUnroll][kILP];
    for_each_pack(
        Split(range.length, head),
        [&](int u, int64_t i, int count) {
          load(g[u], grad, i, count);
          param.load(w[u], i, count);
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
          param.store(i, w[u], count);
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
// by the dtypes of all the lists (param, grad, state[, model]).
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

// The rows' remainders and tie words as two more lists, beside the dense ones: params with
// remainders are contiguous (check_remainders), so DenseRows used them in place, and the
// remainders, contiguous too, line up with them element by element.  The tie words' list only
// lends each row its base address (the launcher reads no list's size but the first's).
void append_remainders(Prepared& call, at::TensorList remainders, at::TensorList ties) {
  if (remainders.empty()) return;
  call.lists.push_back(remainders.vec());
  call.lists.push_back(ties.vec());
}

void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList steps, at::TensorList models, at::TensorList remainders, at::TensorList ties,
                 double lr, double beta1, double beta2, double eps, double weight_decay, bool decoupled_weight_decay,
                 bool bias_correction, const at::Tensor& inv_scale, const at::Tensor& found_inf,
                 const std::optional<at::Tensor>& hyper, bool stochastic_state_rounding) {
  const at::Device device = cuda_device_of("fused_adam_", {params, grads}, {&found_inf, &inv_scale});
  check_flag("fused_adam_", "inv_scale", inv_scale, device);
  check_flag("fused_adam_", "found_inf", found_inf, device);
  check_hyper("fused_adam_", hyper, 5, "[lr, beta1, beta2, eps, weight_decay]", device);
  check_optimizer_lists("fused_adam_", params, grads, {exp_avgs, exp_avg_sqs}, steps, models, device);
  check_remainders("fused_adam_", params, remainders, ties, models);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(device);
  std::vector<std::vector<at::Tensor>> lists = {params.vec(), grads.vec(), exp_avgs.vec(), exp_avg_sqs.vec()};
  std::vector<bool> written = {true, false, true, true};
  if (!models.empty()) {
    lists.push_back(models.vec());
    written.push_back(true);
  }
  DenseRows rows("fused_adam_", lists, written);  // may copy (and raise) before anything is launched
  Prepared call;
  for (size_t l = 0; l < lists.size(); ++l) call.lists.push_back(rows.list(l));
  append_remainders(call, remainders, ties);
  for (const auto& step : steps) call.scalars.push_back({step.data_ptr<float>(), nullptr});
  const auto h = make_hyper<5>({lr, beta1, beta2, eps, weight_decay}, hyper);
  for_each_dtype_group(call, [&](const auto& sub, const auto& scalars, const auto& indices) {
    const auto model_type = models.empty() ? std::nullopt : std::optional(sub[4][0].scalar_type());
    with_optimizer_types(sub[0][0].scalar_type(), sub[1][0].scalar_type(), sub[2][0].scalar_type(), model_type,
                         !remainders.empty(), [&](auto p, auto g, auto s, auto m, auto remainder) {
      using Functor = AdamFunctor<decltype(p), decltype(g), decltype(s), decltype(m), decltype(remainder)::value>;
      const Functor functor{h, decoupled_weight_decay, bias_correction, inv_scale.data_ptr<float>(),
                            found_inf.data_ptr<float>(), stochastic_state_rounding};
      launch<Functor::kDepth>(sub, scalars, indices, functor);
    });
  });
  finish_step(steps, {}, found_inf);
  rows.finish();
}

void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, at::TensorList steps,
                at::TensorList models, at::TensorList remainders, at::TensorList ties, double lr, double momentum,
                double dampening, double weight_decay, bool nesterov, const at::Tensor& inv_scale,
                const at::Tensor& found_inf, at::TensorList new_buffer_flags, const std::optional<at::Tensor>& hyper) {
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
  check_remainders("fused_sgd_", params, remainders, ties, models);
  if (params.empty()) return;
  const c10::cuda::CUDAGuard guard(device);
  std::vector<std::vector<at::Tensor>> lists = {params.vec(), grads.vec()};
  std::vector<bool> written = {true, false};
  if (has_momentum) {
    lists.push_back(momentum_buffers.vec());
    written.push_back(true);
  }
  const size_t model_list = lists.size();
  if (!models.empty()) {
    lists.push_back(models.vec());
    written.push_back(true);
  }
  DenseRows rows("fused_sgd_", lists, written);
  Prepared call;
  for (size_t l = 0; l < lists.size(); ++l) call.lists.push_back(rows.list(l));
  append_remainders(call, remainders, ties);
  for (size_t i = 0; i < steps.size(); ++i) {
    call.scalars.push_back({steps[i].data_ptr<float>(), has_momentum ? new_buffer_flags[i].data_ptr<float>() : nullptr});
  }
  const auto h = make_hyper<4>({lr, momentum, dampening, weight_decay}, hyper);
  for_each_dtype_group(call, [&](const auto& sub, const auto& scalars, const auto& indices) {
    const auto model_type = models.empty() ? std::nullopt : std::optional(sub[model_list][0].scalar_type());
    // Without momentum there is no state: S = P, one instantiation per param dtype.
    const auto state_type = has_momentum ? sub[2][0].scalar_type() : sub[0][0].scalar_type();
    with_optimizer_types(sub[0][0].scalar_type(), sub[1][0].scalar_type(), state_type, model_type,
                         !remainders.empty(), [&](auto p, auto g, auto s, auto m, auto remainder) {
      using P = decltype(p);
      using G = decltype(g);
      using S = decltype(s);
      using M = decltype(m);
      constexpr bool kRemainder = decltype(remainder)::value;
      const float* inv = inv_scale.data_ptr<float>();
      const float* found = found_inf.data_ptr<float>();
      if (has_momentum) {
        using Functor = SgdFunctor<P, G, S, M, kRemainder, true>;
        launch<Functor::kDepth>(sub, scalars, indices, Functor{h, nesterov, inv, found});
      } else if constexpr (std::is_same_v<S, P>) {
        using Functor = SgdFunctor<P, G, P, M, kRemainder, false>;
        launch<Functor::kDepth>(sub, scalars, indices, Functor{h, nesterov, inv, found});
      }
    });
  });
  finish_step(steps, new_buffer_flags, found_inf);
  rows.finish();
}

template <bool Join>
void launch_remainder_masters(at::TensorList weights, at::TensorList remainders, at::TensorList ties,
                              at::TensorList masters) {
  const c10::cuda::CUDAGuard guard(weights[0].device());
  const std::vector<std::vector<at::Tensor>> lists = {weights.vec(), remainders.vec(), ties.vec(), masters.vec()};
  std::vector<int32_t> indices(weights.size());
  for (size_t i = 0; i < weights.size(); ++i) indices[i] = static_cast<int32_t>(i);
  launch<4>(lists, {}, indices, RemainderMastersFunctor<Join>{});
}

std::vector<at::Tensor> join_masters(at::TensorList weights, at::TensorList remainders, at::TensorList ties) {
  std::vector<at::Tensor> masters;
  if (weights.empty()) return masters;
  const at::Device device = cuda_device_of("join_masters", {weights});
  check_remainder_masters("join_masters", weights, remainders, ties, nullptr, device);
  masters.reserve(weights.size());
  for (const auto& weight : weights) masters.push_back(at::empty(weight.sizes(), weight.options().dtype(at::kFloat)));
  launch_remainder_masters<true>(weights, remainders, ties, masters);
  return masters;
}

void split_masters_(at::TensorList weights, at::TensorList remainders, at::TensorList ties, at::TensorList masters) {
  if (weights.empty()) return;
  const at::Device device = cuda_device_of("split_masters_", {weights});
  check_remainder_masters("split_masters_", weights, remainders, ties, &masters, device);
  launch_remainder_masters<false>(weights, remainders, ties, masters);
}

}  // namespace

TORCH_LIBRARY_IMPL(ampinit, CUDA, m) {
  m.impl("fused_adam_", &fused_adam_);
  m.impl("fused_sgd_", &fused_sgd_);
  m.impl("join_masters", &join_masters);
  m.impl("split_masters_", &split_masters_);
}

}  // namespace ampinit::cuda

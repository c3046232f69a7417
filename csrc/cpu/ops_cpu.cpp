// CPU implementations of the ampinit ops: argument checks, the split of many tensors into
// chunks that at::parallel_for spreads over the threads, and the choice of kernel table.
//
// On the CPU the flags live in host memory, so "skip inside the kernel" is a read of
// found_inf before the update; nothing here waits on anything.
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <ATen/Version.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include "../common.h"
#include "kernel_table.h"

namespace ampinit::cpu {
namespace {

// ATen's own detection (it honours ATEN_CPU_CAPABILITY), read once.
const KernelTable& kernels() {
  static const KernelTable& table = [] () -> const KernelTable& {
#ifdef AMPINIT_AVX2_KERNELS
    const std::string capability = at::get_cpu_capability();
    if (capability == "AVX2" || capability == "AVX512") return avx2_kernels();
#endif
    return default_kernels();
  }();
  return table;
}

constexpr int64_t kChunk = 32768;

struct Chunk {
  size_t tensor;
  int64_t begin, size;
};

std::vector<Chunk> chunks_of(const std::vector<at::Tensor>& tensors) {
  std::vector<Chunk> chunks;
  for (size_t t = 0; t < tensors.size(); ++t) {
    const int64_t n = tensors[t].numel();
    for (int64_t begin = 0; begin < n; begin += kChunk) chunks.push_back({t, begin, std::min(kChunk, n - begin)});
  }
  return chunks;
}

// Runs fn(chunk) for every chunk, in parallel; fn returns whether the chunk held inf/NaN.
// Returns, per tensor, whether any of its chunks did.
template <typename Fn>
std::vector<char> for_each_chunk(const std::vector<at::Tensor>& tensors, const Fn& fn) {
  const auto chunks = chunks_of(tensors);
  std::vector<std::atomic<char>> bad(tensors.size());
  for (auto& flag : bad) flag.store(0, std::memory_order_relaxed);
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      if (fn(chunks[c])) bad[chunks[c].tensor].store(1, std::memory_order_relaxed);
    }
  });
  std::vector<char> result(tensors.size());
  for (size_t t = 0; t < tensors.size(); ++t) result[t] = bad[t].load(std::memory_order_relaxed);
  return result;
}

template <typename T = char>
T* at_offset(const at::Tensor& tensor, int64_t offset) {
  return reinterpret_cast<T*>(static_cast<char*>(tensor.data_ptr()) + offset * tensor.element_size());
}

void record_flags(const std::vector<char>& bad, const at::Tensor& found_inf,
                  const std::optional<at::Tensor>& per_tensor) {
  const bool any = std::any_of(bad.begin(), bad.end(), [](char b) { return b != 0; });
  if (any) found_inf.data_ptr<float>()[0] = 1.0f;
  if (per_tensor.has_value()) {
    float* flags = per_tensor->data_ptr<float>();
    for (size_t t = 0; t < bad.size(); ++t) {
      if (bad[t]) flags[t] = 1.0f;
    }
  }
}

void check_per_tensor(const char* op, const std::optional<at::Tensor>& per_tensor, size_t n) {
  if (!per_tensor.has_value()) return;
  TORCH_CHECK(per_tensor->scalar_type() == at::kFloat && per_tensor->is_contiguous() &&
                  per_tensor->numel() == static_cast<int64_t>(n) && per_tensor->device().is_cpu(),
              "ampinit.", op, ": per_tensor_found_inf must be a contiguous float32 tensor with one element "
              "per input on the inputs' device");
}

void unscale_(at::TensorList inputs, at::TensorList outputs, const at::Tensor& inv_scale,
              const at::Tensor& found_inf, const std::optional<at::Tensor>& per_tensor) {
  check_same_length("unscale_", "inputs", inputs.size(), "outputs", outputs.size());
  check_flag("unscale_", "inv_scale", inv_scale, at::kCPU);
  check_flag("unscale_", "found_inf", found_inf, at::kCPU);
  check_per_tensor("unscale_", per_tensor, inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) check_row("unscale_", i, {inputs[i], outputs[i]}, at::kCPU);
  DenseRows rows("unscale_", {inputs.vec(), outputs.vec()}, {false, true});
  const auto& in = rows.list(0);
  const auto& out = rows.list(1);
  const float inv = inv_scale.data_ptr<float>()[0];
  const auto& k = kernels();
  const auto bad = for_each_chunk(in, [&](const Chunk& c) {
    return k.unscale(in[c.tensor].scalar_type(), out[c.tensor].scalar_type(), at_offset(in[c.tensor], c.begin),
                     at_offset(out[c.tensor], c.begin), c.size, inv);
  });
  rows.finish();
  record_flags(bad, found_inf, per_tensor);
}

void accumulate_(at::TensorList inputs, at::TensorList outputs, const at::Tensor& inv_scale,
                 const at::Tensor& found_inf, double out_weight) {
  check_same_length("accumulate_", "inputs", inputs.size(), "outputs", outputs.size());
  check_flag("accumulate_", "inv_scale", inv_scale, at::kCPU);
  check_flag("accumulate_", "found_inf", found_inf, at::kCPU);
  for (size_t i = 0; i < inputs.size(); ++i) check_row("accumulate_", i, {inputs[i], outputs[i]}, at::kCPU);
  DenseRows rows("accumulate_", {inputs.vec(), outputs.vec()}, {false, true});
  const auto& in = rows.list(0);
  const auto& out = rows.list(1);
  const float inv = inv_scale.data_ptr<float>()[0];
  const auto& k = kernels();
  const auto bad = for_each_chunk(in, [&](const Chunk& c) {
    return k.accumulate(in[c.tensor].scalar_type(), out[c.tensor].scalar_type(), at_offset(in[c.tensor], c.begin),
                        at_offset(out[c.tensor], c.begin), c.size, inv, static_cast<float>(out_weight));
  });
  rows.finish();
  record_flags(bad, found_inf, std::nullopt);
}

void copy_(at::TensorList outputs, at::TensorList inputs) {
  check_same_length("copy_", "outputs", outputs.size(), "inputs", inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) check_row("copy_", i, {inputs[i], outputs[i]}, at::kCPU);
  DenseRows rows("copy_", {inputs.vec(), outputs.vec()}, {false, true});
  const auto& in = rows.list(0);
  const auto& out = rows.list(1);
  const auto& k = kernels();
  for_each_chunk(in, [&](const Chunk& c) {
    k.copy(in[c.tensor].scalar_type(), out[c.tensor].scalar_type(), at_offset(in[c.tensor], c.begin),
           at_offset(out[c.tensor], c.begin), c.size);
    return false;
  });
  rows.finish();
}

void adopt_changes_(at::TensorList masters, at::TensorList models, const std::optional<at::Tensor>& only) {
  check_same_length("adopt_changes_", "masters", masters.size(), "models", models.size());
  check_per_tensor("adopt_changes_", only, models.size());
  for (size_t i = 0; i < models.size(); ++i) check_master_row("adopt_changes_", i, models[i], masters[i], at::kCPU);
  DenseRows rows("adopt_changes_", {models.vec(), masters.vec()}, {false, true});
  const auto& model = rows.list(0);
  const auto& master = rows.list(1);
  const float* selected = only ? only->data_ptr<float>() : nullptr;
  const auto& k = kernels();
  for_each_chunk(model, [&](const Chunk& c) {
    if (selected == nullptr || selected[c.tensor] != 0.0f) {
      k.adopt(model[c.tensor].scalar_type(), at_offset(model[c.tensor], c.begin),
              at_offset<float>(master[c.tensor], c.begin), c.size);
    }
    return false;
  });
  rows.finish();
}

at::Tensor fingerprint(at::TensorList inputs) {
  for (size_t i = 0; i < inputs.size(); ++i) check_row("fingerprint", i, {inputs[i]}, at::kCPU);
  std::vector<at::Tensor> in;  // dense tensors in memory order (no copy), others as their copy
  in.reserve(inputs.size());
  for (const auto& tensor : inputs) in.push_back(tensor.is_non_overlapping_and_dense() ? tensor : tensor.contiguous());
  std::vector<std::atomic<uint32_t>> sums(in.size());
  for (auto& sum : sums) sum.store(0, std::memory_order_relaxed);
  const auto& k = kernels();
  for_each_chunk(in, [&](const Chunk& c) {
    sums[c.tensor].fetch_add(k.fingerprint(in[c.tensor].element_size(), at_offset(in[c.tensor], c.begin), c.size,
                                           c.begin),
                             std::memory_order_relaxed);  // wrapping: the chunks' order does not matter
    return false;
  });
  auto out = at::empty({static_cast<int64_t>(in.size())}, at::kLong);
  auto* values = out.data_ptr<int64_t>();
  for (size_t t = 0; t < in.size(); ++t) values[t] = sums[t].load(std::memory_order_relaxed);
  return out;
}

void check_finite_(at::TensorList inputs, const at::Tensor& found_inf, const std::optional<at::Tensor>& per_tensor) {
  check_flag("check_finite_", "found_inf", found_inf, at::kCPU);
  check_per_tensor("check_finite_", per_tensor, inputs.size());
  for (size_t i = 0; i < inputs.size(); ++i) check_row("check_finite_", i, {inputs[i]}, at::kCPU);
  DenseRows rows("check_finite_", {inputs.vec()}, {false});
  const auto& in = rows.list(0);
  const auto& k = kernels();
  const auto bad = for_each_chunk(in, [&](const Chunk& c) {
    return k.check(in[c.tensor].scalar_type(), at_offset(in[c.tensor], c.begin), c.size);
  });
  record_flags(bad, found_inf, per_tensor);
}

std::tuple<at::Tensor, at::Tensor> l2norm(at::TensorList inputs, bool per_tensor) {
  for (size_t i = 0; i < inputs.size(); ++i) check_row("l2norm", i, {inputs[i]}, at::kCPU);
  DenseRows rows("l2norm", {inputs.vec()}, {false});
  const auto& in = rows.list(0);
  const auto chunks = chunks_of(in);
  std::vector<double> partial(chunks.size(), 0.0);
  const auto& k = kernels();
  at::parallel_for(0, static_cast<int64_t>(chunks.size()), 1, [&](int64_t first, int64_t last) {
    for (int64_t c = first; c < last; ++c) {
      const auto& chunk = chunks[c];
      partial[c] = k.sum_of_squares(in[chunk.tensor].scalar_type(), at_offset(in[chunk.tensor], chunk.begin),
                                    chunk.size);
    }
  });
  // Summed in chunk order: the result does not depend on the thread count.
  std::vector<double> per(in.size(), 0.0);
  for (size_t c = 0; c < chunks.size(); ++c) per[chunks[c].tensor] += partial[c];
  double total = 0.0;
  for (double value : per) total += value;
  at::Tensor total_norm = at::empty({1}, at::dtype(at::kFloat));
  total_norm.data_ptr<float>()[0] = static_cast<float>(std::sqrt(total));
  at::Tensor norms = at::empty({per_tensor ? static_cast<int64_t>(in.size()) : 0}, at::dtype(at::kFloat));
  for (int64_t t = 0; t < norms.numel(); ++t) norms.data_ptr<float>()[t] = static_cast<float>(std::sqrt(per[t]));
  return {total_norm, norms};
}

void update_scale_(const at::Tensor& scale, const at::Tensor& growth_tracker, const at::Tensor& hysteresis_tracker,
                   const at::Tensor& overflow_count, const at::Tensor& found_inf, double growth_factor,
                   double backoff_factor, int64_t growth_interval, int64_t hysteresis, double min_scale,
                   double max_scale) {
  check_flag("update_scale_", "scale", scale, at::kCPU);
  check_flag("update_scale_", "found_inf", found_inf, at::kCPU);
  TORCH_CHECK(growth_tracker.numel() == 1 && growth_tracker.scalar_type() == at::kInt &&
                  hysteresis_tracker.numel() == 1 && hysteresis_tracker.scalar_type() == at::kInt &&
                  overflow_count.numel() == 1 && overflow_count.scalar_type() == at::kLong,
              "ampinit.update_scale_: growth_tracker and hysteresis_tracker must be 1-element int32 tensors "
              "and overflow_count a 1-element int64 tensor");
  float& s = scale.data_ptr<float>()[0];
  int32_t& tracker = growth_tracker.data_ptr<int32_t>()[0];
  int32_t& credits = hysteresis_tracker.data_ptr<int32_t>()[0];
  if (found_inf.data_ptr<float>()[0] > 0.0f) {
    overflow_count.data_ptr<int64_t>()[0] += 1;
    tracker = 0;
    credits -= 1;
    // float32 arithmetic, as the torch fallback computes it.
    if (credits <= 0) s = std::max(s * static_cast<float>(backoff_factor), static_cast<float>(min_scale));
    credits = std::max(credits, 0);
  } else {
    credits = static_cast<int32_t>(hysteresis);  // a clean backward ends a run of overflows (apex)
    if (++tracker >= growth_interval) {
      s = std::min(s * static_cast<float>(growth_factor), static_cast<float>(max_scale));
      tracker = 0;
    }
  }
}

// The hyper-parameters of a call: the float arguments, or (capturable optimizers) the values
// in `hyper`, which on the CPU is host memory.
std::vector<double> hyper_values(const std::optional<at::Tensor>& hyper, std::vector<double> arguments) {
  if (!hyper.has_value()) return arguments;
  const double* values = hyper->data_ptr<double>();
  return std::vector<double>(values, values + hyper->numel());
}

at::ScalarType type_or_undefined(const std::vector<at::Tensor>* list, size_t t) {
  return list == nullptr ? at::ScalarType::Undefined : (*list)[t].scalar_type();
}

void* address_or_null(const std::vector<at::Tensor>* list, size_t t, int64_t offset) {
  return list == nullptr ? nullptr : at_offset((*list)[t], offset);
}

// The remainders of param t from element `offset` on (contiguous, so used in place), if any.
MasterRemainder remainder_at(at::TensorList remainders, at::TensorList ties, size_t t, int64_t offset) {
  if (remainders.empty()) return {nullptr, nullptr, 0};
  return {remainders[t].data_ptr<int16_t>() + offset, reinterpret_cast<uint32_t*>(ties[t].data_ptr<int32_t>()),
          offset};
}

void fused_adam_(at::TensorList params, at::TensorList grads, at::TensorList exp_avgs, at::TensorList exp_avg_sqs,
                 at::TensorList steps, at::TensorList models, at::TensorList remainders, at::TensorList ties,
                 double lr_arg, double beta1_arg, double beta2_arg,
                 double eps_arg, double weight_decay_arg, bool decoupled_weight_decay, bool bias_correction,
                 const at::Tensor& inv_scale, const at::Tensor& found_inf, const std::optional<at::Tensor>& hyper,
                 bool stochastic_state_rounding) {
  check_flag("fused_adam_", "inv_scale", inv_scale, at::kCPU);
  check_flag("fused_adam_", "found_inf", found_inf, at::kCPU);
  check_hyper("fused_adam_", hyper, 5, "[lr, beta1, beta2, eps, weight_decay]", at::kCPU);
  check_optimizer_lists("fused_adam_", params, grads, {exp_avgs, exp_avg_sqs}, steps, models, at::kCPU);
  check_remainders("fused_adam_", params, remainders, ties, models);
  if (found_inf.data_ptr<float>()[0] != 0.0f) return;  // the skipped step leaves everything as it was
  const auto h = hyper_values(hyper, {lr_arg, beta1_arg, beta2_arg, eps_arg, weight_decay_arg});
  const double lr = h[0], beta1 = h[1], beta2 = h[2], eps = h[3], weight_decay = h[4];
  std::vector<std::vector<at::Tensor>> lists = {params.vec(), grads.vec(), exp_avgs.vec(), exp_avg_sqs.vec()};
  std::vector<bool> written = {true, false, true, true};
  if (!models.empty()) {
    lists.push_back(models.vec());
    written.push_back(true);
  }
  DenseRows rows("fused_adam_", std::move(lists), std::move(written));
  std::vector<AdamParams> per_tensor(params.size());
  for (size_t t = 0; t < params.size(); ++t) {
    float& step = steps[t].data_ptr<float>()[0];
    step += 1.0f;
    // Bias corrections in double, as torch.optim.Adam computes them on the host.
    const double bc1 = bias_correction ? 1.0 - std::pow(beta1, static_cast<double>(step)) : 1.0;
    const double bc2 = bias_correction ? 1.0 - std::pow(beta2, static_cast<double>(step)) : 1.0;
    per_tensor[t] = {static_cast<float>(beta2), static_cast<float>(eps), static_cast<float>(weight_decay),
                     static_cast<float>(1.0 - beta1), static_cast<float>(1.0 - beta2),
                     static_cast<float>(1.0 - lr * weight_decay), decoupled_weight_decay,
                     inv_scale.data_ptr<float>()[0], static_cast<float>(lr / bc1),
                     static_cast<float>(std::sqrt(bc2)), stochastic_state_rounding, static_cast<uint32_t>(step)};
  }
  const auto& k = kernels();
  const auto& p = rows.list(0);
  const auto& g = rows.list(1);
  const auto& m = rows.list(2);
  const auto& v = rows.list(3);
  const std::vector<at::Tensor>* model = models.empty() ? nullptr : &rows.list(4);
  for_each_chunk(p, [&](const Chunk& c) {
    const size_t t = c.tensor;
    const OptimizerTypes types{p[t].scalar_type(), g[t].scalar_type(), m[t].scalar_type(),
                               type_or_undefined(model, t)};
    k.adam(per_tensor[t], types, at_offset(p[t], c.begin), remainder_at(remainders, ties, t, c.begin),
           at_offset(g[t], c.begin), at_offset(m[t], c.begin), at_offset(v[t], c.begin),
           address_or_null(model, t, c.begin), c.size, c.begin);
    return false;
  });
  rows.finish();
}

void fused_sgd_(at::TensorList params, at::TensorList grads, at::TensorList momentum_buffers, at::TensorList steps,
                at::TensorList models, at::TensorList remainders, at::TensorList ties, double lr_arg, double momentum_arg, double dampening_arg,
                double weight_decay_arg, bool nesterov, const at::Tensor& inv_scale, const at::Tensor& found_inf,
                at::TensorList new_buffer_flags, const std::optional<at::Tensor>& hyper) {
  check_flag("fused_sgd_", "inv_scale", inv_scale, at::kCPU);
  check_flag("fused_sgd_", "found_inf", found_inf, at::kCPU);
  check_hyper("fused_sgd_", hyper, 4, "[lr, momentum, dampening, weight_decay]", at::kCPU);
  const bool has_momentum = !momentum_buffers.empty();
  // With `hyper` the momentum may change between steps (a scheduler cycling it); the buffers
  // decide the structure then.
  TORCH_CHECK(hyper.has_value() || has_momentum == (momentum_arg != 0.0) || params.empty(),
              "ampinit.fused_sgd_: pass one momentum buffer per param exactly when momentum is nonzero");
  std::vector<at::TensorList> states;
  if (has_momentum) states.push_back(momentum_buffers);
  check_optimizer_lists("fused_sgd_", params, grads, states, steps, models, at::kCPU);
  check_new_buffer_flags("fused_sgd_", new_buffer_flags, momentum_buffers.size(), at::kCPU);
  check_remainders("fused_sgd_", params, remainders, ties, models);
  if (found_inf.data_ptr<float>()[0] != 0.0f) return;
  const auto h = hyper_values(hyper, {lr_arg, momentum_arg, dampening_arg, weight_decay_arg});
  const double lr = h[0], momentum = h[1], dampening = h[2], weight_decay = h[3];
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
  DenseRows rows("fused_sgd_", std::move(lists), std::move(written));
  std::vector<SgdParams> per_tensor(params.size());
  for (size_t t = 0; t < params.size(); ++t) {
    steps[t].data_ptr<float>()[0] += 1.0f;
    const bool new_buffer = has_momentum && new_buffer_flags[t].data_ptr<float>()[0] != 0.0f;
    per_tensor[t] = {static_cast<float>(lr), static_cast<float>(momentum), static_cast<float>(1.0 - dampening),
                     static_cast<float>(weight_decay), nesterov, new_buffer, inv_scale.data_ptr<float>()[0]};
  }
  const auto& k = kernels();
  const auto& p = rows.list(0);
  const auto& g = rows.list(1);
  const std::vector<at::Tensor>* buffers = has_momentum ? &rows.list(2) : nullptr;
  const std::vector<at::Tensor>* model = models.empty() ? nullptr : &rows.list(model_list);
  for_each_chunk(p, [&](const Chunk& c) {
    const size_t t = c.tensor;
    const OptimizerTypes types{p[t].scalar_type(), g[t].scalar_type(),
                               buffers == nullptr ? p[t].scalar_type() : (*buffers)[t].scalar_type(),
                               type_or_undefined(model, t)};
    k.sgd(per_tensor[t], types, at_offset(p[t], c.begin), remainder_at(remainders, ties, t, c.begin),
          at_offset(g[t], c.begin), address_or_null(buffers, t, c.begin), address_or_null(model, t, c.begin), c.size);
    return false;
  });
  rows.finish();
  for (const auto& flag : new_buffer_flags) flag.data_ptr<float>()[0] = 0.0f;  // applied: no longer new
}

std::vector<at::Tensor> join_masters(at::TensorList weights, at::TensorList remainders, at::TensorList ties) {
  check_remainder_masters("join_masters", weights, remainders, ties, nullptr, at::kCPU);
  std::vector<at::Tensor> masters;
  masters.reserve(weights.size());
  for (const auto& weight : weights) masters.push_back(at::empty(weight.sizes(), weight.options().dtype(at::kFloat)));
  const auto& k = kernels();
  for_each_chunk(weights.vec(), [&](const Chunk& c) {
    k.join_masters(at_offset(weights[c.tensor], c.begin), remainder_at(remainders, ties, c.tensor, c.begin),
                   at_offset<float>(masters[c.tensor], c.begin), c.size);
    return false;
  });
  return masters;
}

void split_masters_(at::TensorList weights, at::TensorList remainders, at::TensorList ties, at::TensorList masters) {
  check_remainder_masters("split_masters_", weights, remainders, ties, &masters, at::kCPU);
  const auto& k = kernels();
  // kChunk is a multiple of 32: no two chunks share a tie word (set_tie_bit is atomic anyway)
  for_each_chunk(weights.vec(), [&](const Chunk& c) {
    k.split_masters(at_offset<float>(masters[c.tensor], c.begin), at_offset(weights[c.tensor], c.begin),
                    remainder_at(remainders, ties, c.tensor, c.begin), c.size);
    return false;
  });
}

}  // namespace

std::string kernel_name() { return kernels().name; }

TORCH_LIBRARY_IMPL(ampinit, CPU, m) {
  m.impl("unscale_", &unscale_);
  m.impl("accumulate_", &accumulate_);
  m.impl("copy_", &copy_);
  m.impl("adopt_changes_", &adopt_changes_);
  m.impl("fingerprint", &fingerprint);
  m.impl("check_finite_", &check_finite_);
  m.impl("l2norm", &l2norm);
  m.impl("update_scale_", &update_scale_);
  m.impl("fused_adam_", &fused_adam_);
  m.impl("fused_sgd_", &fused_sgd_);
  m.impl("join_masters", &join_masters);
  m.impl("split_masters_", &split_masters_);
}

}  // namespace ampinit::cpu

// Argument checks and dense-layout handling shared by the CPU and CUDA implementations.
#pragma once

#include <ATen/ATen.h>
#include <ATen/MemoryOverlap.h>

#include <algorithm>
#include <cstdint>
#include <optional>
#include <utility>
#include <unordered_set>
#include <vector>

namespace ampinit {

inline bool is_supported_float(c10::ScalarType type) {
  return type == at::kFloat || type == at::kHalf || type == at::kBFloat16;
}

// inv_scale / found_inf: 1-element float32 tensors on the tensors' device.
inline void check_flag(const char* op, const char* name, const at::Tensor& flag, const at::Device& device) {
  TORCH_CHECK(flag.numel() == 1 && flag.scalar_type() == at::kFloat && flag.device() == device,
              "ampinit.", op, ": ", name, " must be a 1-element float32 tensor on ", device,
              "; got ", flag.numel(), " element(s) of ", flag.scalar_type(), " on ", flag.device(),
              " (keep inv_scale, found_inf and step counters on the device of the tensors they belong to)");
}

inline void check_same_length(const char* op, const char* name_a, size_t a, const char* name_b, size_t b) {
  TORCH_CHECK(a == b, "ampinit.", op, ": ", name_a, " and ", name_b, " must have the same length; got ",
              a, " and ", b);
}

// Every tensor of one row (the i-th entries of each list): same device and shape, a float dtype
// the kernels handle.  (Equal numels alone let a (1, 4) row pass for a (4,) one, and the error
// came from the write-back, after other rows were written.)
inline void check_row(const char* op, size_t index, at::TensorList row, const at::Device& device) {
  for (const auto& tensor : row) {
    TORCH_CHECK(tensor.defined(), "ampinit.", op, ": tensor ", index, " is undefined");
    TORCH_CHECK(tensor.device() == device, "ampinit.", op, ": tensor ", index, " is on ", tensor.device(),
                "; every tensor of one call must be on ", device);
    TORCH_CHECK(is_supported_float(tensor.scalar_type()), "ampinit.", op, ": tensor ", index, " is ",
                tensor.scalar_type(), "; the kernels take float32, float16 and bfloat16 (use the torch "
                "fallback, AMPINIT_DISABLE_EXT=1, for other dtypes)");
    TORCH_CHECK(!tensor.is_sparse(), "ampinit.", op, ": tensor ", index, " is sparse; ampinit.ops.unscale_sparse "
                "handles sparse gradients");
    TORCH_CHECK(tensor.sizes() == row[0].sizes(), "ampinit.", op, ": tensors at index ", index,
                " have different shapes (", row[0].sizes(), " and ", tensor.sizes(), "); each row must have one shape");
  }
}

// A model tensor and its FP32 master (adopt_changes_): a row, with the master in float32.
inline void check_master_row(const char* op, size_t index, const at::Tensor& model, const at::Tensor& master,
                             const at::Device& device) {
  check_row(op, index, {model, master}, device);
  TORCH_CHECK(master.scalar_type() == at::kFloat, "ampinit.", op, ": master ", index, " is ", master.scalar_type(),
              "; masters are float32");
}

// The tensors of one call, row by row, laid out so that element k of every tensor in a row is
// at data_ptr() + k.  Rows whose tensors are dense with identical strides are used in place;
// other rows run on contiguous copies, and the copies of written tensors are copied back by
// finish().
class DenseRows {
 public:
  // lists[l][i]: tensor i of list l; written[l]: whether the op writes list l.
  DenseRows(const char* op, std::vector<std::vector<at::Tensor>> lists, std::vector<bool> written)
      : lists_(std::move(lists)) {
    const size_t rows = lists_.empty() ? 0 : lists_[0].size();
    check_rows_apart(op, written);
    // A written tensor is the row's other tensor itself (in place) or apart from it, as torch's
    // in-place ops require: a view shifted by one element, or an expanded output, would read
    // values the same pass has already written.  Checked for every row before any is written.
    for (size_t i = 0; i < rows; ++i) {
      for (size_t l = 0; l < lists_.size(); ++l) {
        if (!written[l]) continue;
        at::assert_no_internal_overlap(lists_[l][i]);
        for (size_t m = 0; m < lists_.size(); ++m) {
          if (m != l) at::assert_no_partial_overlap(lists_[l][i], lists_[m][i]);
        }
      }
    }
    for (size_t i = 0; i < rows; ++i) {
      bool direct = true;
      for (const auto& list : lists_) {
        const auto& t = list[i];
        direct = direct && t.is_non_overlapping_and_dense() && t.strides() == lists_[0][i].strides();
      }
      if (direct) continue;
      // The row's tensors take the first one's layout where it is dense, else they are made
      // contiguous: element k of every buffer is then the first tensor's k-th element in its
      // memory order (the index the optimizers' stochastic rounding hashes, as the fallback does).
      const at::Tensor first = lists_[0][i];
      const bool keep_layout = first.is_non_overlapping_and_dense();
      for (size_t l = 0; l < lists_.size(); ++l) {
        at::Tensor original = lists_[l][i];
        if (!keep_layout) {
          lists_[l][i] = original.contiguous();
        } else if (!(original.is_non_overlapping_and_dense() && original.strides() == first.strides())) {
          lists_[l][i] = at::empty_strided(first.sizes(), first.strides(), original.options());
          lists_[l][i].copy_(original);
        }
        if (written[l] && !lists_[l][i].is_same(original)) write_back_.emplace_back(original, lists_[l][i]);
      }
    }
  }
  const std::vector<at::Tensor>& list(size_t l) const { return lists_[l]; }
  void finish() {
    for (auto& [original, copy] : write_back_) original.copy_(copy);
  }

 private:
  // A tensor the op writes shares no memory with a tensor of another row.  Rows run in
  // parallel chunks, so one output listed twice (a tied parameter passed twice), or a row
  // reading what another row writes, gives a result that depends on thread timing; the
  // fallback would apply the op twice.  Extents are sorted by address and only neighbours whose
  // byte ranges meet are compared, with torch's own test (interleaved strided views, which it
  // cannot decide, pass, unless they are one view).
  void check_rows_apart(const char* op, const std::vector<bool>& written) const {
    struct Extent {
      uintptr_t begin, end;
      size_t list, row;
    };
    std::vector<Extent> extents;
    bool writes = false;
    for (size_t l = 0; l < lists_.size(); ++l) writes = writes || written[l];
    if (!writes) return;
    for (size_t l = 0; l < lists_.size(); ++l) {
      for (size_t i = 0; i < lists_[l].size(); ++i) {
        const at::Tensor& t = lists_[l][i];
        if (t.numel() == 0) continue;
        int64_t last = 0;  // the farthest element from the first, in elements (strides are >= 0)
        for (int64_t d = 0; d < t.dim(); ++d) last += (t.size(d) - 1) * t.stride(d);
        const auto begin = reinterpret_cast<uintptr_t>(t.data_ptr());
        extents.push_back({begin, begin + static_cast<uintptr_t>((last + 1) * t.element_size()), l, i});
      }
    }
    std::sort(extents.begin(), extents.end(), [](const Extent& a, const Extent& b) { return a.begin < b.begin; });
    for (size_t a = 0; a < extents.size(); ++a) {
      for (size_t b = a + 1; b < extents.size() && extents[b].begin < extents[a].end; ++b) {
        const Extent& x = extents[a];
        const Extent& y = extents[b];
        if (x.row == y.row || !(written[x.list] || written[y.list])) continue;
        const at::Tensor& t = lists_[x.list][x.row];
        const at::Tensor& u = lists_[y.list][y.row];
        const auto status = at::get_overlap_status(t, u);
        const bool same_view = x.begin == y.begin && t.sizes() == u.sizes() && t.strides() == u.strides() &&
                               t.scalar_type() == u.scalar_type();
        TORCH_CHECK(!same_view && status != at::MemOverlapStatus::Full && status != at::MemOverlapStatus::Partial,
                    "ampinit.", op, ": tensors ", std::min(x.row, y.row), " and ", std::max(x.row, y.row),
                    " share memory, and the op writes one of them (the same tensor listed twice, a tied "
                    "parameter say?); rows run in parallel, so the result would depend on timing.  Pass each "
                    "tensor once");
      }
    }
  }

  std::vector<std::vector<at::Tensor>> lists_;
  std::vector<std::pair<at::Tensor, at::Tensor>> write_back_;
};

// Checks shared by the optimizers: params float32/float16/bfloat16 with optimizer state of the
// param's dtype, float32, or (float32 params) bfloat16; grads any of the three; model copies
// (float32 params only) 16-bit; step counters 1-element float32, one per param.
inline void check_optimizer_lists(const char* op, at::TensorList params, at::TensorList grads,
                                  const std::vector<at::TensorList>& states, at::TensorList steps,
                                  at::TensorList models, const at::Device& device) {
  check_same_length(op, "params", params.size(), "grads", grads.size());
  check_same_length(op, "params", params.size(), "steps", steps.size());
  for (const auto& state : states) check_same_length(op, "params", params.size(), "optimizer state", state.size());
  TORCH_CHECK(models.empty() || models.size() == params.size(), "ampinit.", op,
              ": model_params must be empty or have one entry per param");
  for (size_t i = 0; i < params.size(); ++i) {
    std::vector<at::Tensor> row = {params[i], grads[i]};
    for (const auto& state : states) row.push_back(state[i]);
    if (!models.empty()) row.push_back(models[i]);
    check_row(op, i, row, device);
    for (const auto& state : states) {
      const auto type = state[i].scalar_type();
      const bool allowed = type == params[i].scalar_type() || type == at::kFloat ||
                           (type == at::kBFloat16 && params[i].scalar_type() == at::kFloat);
      TORCH_CHECK(allowed && type == states[0][i].scalar_type(), "ampinit.", op, ": optimizer state ", i, " is ",
                  type, "; the state of a ", params[i].scalar_type(), " param must be all of its dtype, all float32, "
                  "or (float32 params) all bfloat16");
    }
    if (!models.empty()) {
      TORCH_CHECK(params[i].scalar_type() == at::kFloat, "ampinit.", op, ": param ", i, " is ",
                  params[i].scalar_type(), "; model copies are for float32 (master) params: update a 16-bit "
                  "param directly, with empty model_params");
      TORCH_CHECK(models[i].scalar_type() != at::kFloat && !models[i].is_same(params[i]), "ampinit.", op,
                  ": model_params[", i, "] must be a float16/bfloat16 tensor distinct from the param");
    }
    check_flag(op, "steps[i]", steps[i], device);
  }
  // One counter per param: a counter shared by rows would be advanced by each row (and by racing
  // threads on CUDA).
  std::unordered_set<const void*> counters;
  for (size_t i = 0; i < steps.size(); ++i) {
    TORCH_CHECK(counters.insert(steps[i].data_ptr()).second, "ampinit.", op, ": steps[", i,
                "] is the counter of an earlier param too; pass one step tensor per param");
  }
}

// Remainder masters (see cpu/kernels.h): `remainders` is empty, or holds per param an int16
// tensor of its shape and `ties` an int32 tensor of ceil(numel / 32) tie words; params with
// remainders are contiguous bfloat16 updated in place (no model copies).
inline void check_remainders(const char* op, at::TensorList params, at::TensorList remainders, at::TensorList ties,
                             at::TensorList models) {
  if (remainders.empty() && ties.empty()) return;
  check_same_length(op, "params", params.size(), "remainders", remainders.size());
  check_same_length(op, "params", params.size(), "ties", ties.size());
  TORCH_CHECK(models.empty(), "ampinit.", op, ": params with remainders are the model weights; pass no model_params");
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& param = params[i];
    TORCH_CHECK(param.scalar_type() == at::kBFloat16 && param.is_contiguous(), "ampinit.", op, ": param ", i,
                " has remainders, so it must be a contiguous bfloat16 tensor; got a ",
                param.is_contiguous() ? "contiguous " : "non-contiguous ", param.scalar_type(), " tensor");
    TORCH_CHECK(remainders[i].scalar_type() == at::kShort && remainders[i].is_contiguous() &&
                    remainders[i].numel() == param.numel() && remainders[i].device() == param.device(),
                "ampinit.", op, ": remainders[", i, "] must be a contiguous int16 tensor of the param's size "
                "on its device");
    TORCH_CHECK(ties[i].scalar_type() == at::kInt && ties[i].is_contiguous() &&
                    ties[i].numel() == (param.numel() + 31) / 32 && ties[i].device() == param.device(),
                "ampinit.", op, ": ties[", i, "] must be a contiguous int32 tensor of ceil(numel / 32) = ",
                (param.numel() + 31) / 32, " elements on the param's device");
  }
}

// ops.join_masters / split_masters_: one contiguous bfloat16 weight per row on `device`, with its
// remainders and tie words as check_remainders wants them, and (split, `masters` not null) a
// contiguous float32 master of the weight's size on the same device.
inline void check_remainder_masters(const char* op, at::TensorList weights, at::TensorList remainders,
                                    at::TensorList ties, const at::TensorList* masters, const at::Device& device) {
  check_same_length(op, "weights", weights.size(), "remainders", remainders.size());
  check_same_length(op, "weights", weights.size(), "ties", ties.size());
  if (masters != nullptr) check_same_length(op, "weights", weights.size(), "masters", masters->size());
  for (size_t i = 0; i < weights.size(); ++i) {
    TORCH_CHECK(weights[i].device() == device, "ampinit.", op, ": weights[", i, "] is on ", weights[i].device(),
                "; every tensor of one call must be on ", device);
    if (masters == nullptr) continue;
    const auto& master = (*masters)[i];
    TORCH_CHECK(master.scalar_type() == at::kFloat && master.is_contiguous() && master.numel() == weights[i].numel() &&
                    master.device() == device,
                "ampinit.", op, ": masters[", i, "] must be a contiguous float32 tensor of its weight's size on ",
                device);
  }
  check_remainders(op, weights, remainders, ties, {});
}

// The device-resident hyper-parameters of a capturable optimizer step: a contiguous float64
// tensor of `count` values on the params' device.
inline void check_hyper(const char* op, const std::optional<at::Tensor>& hyper, int64_t count, const char* layout,
                        const at::Device& device) {
  if (!hyper.has_value()) return;
  TORCH_CHECK(hyper->scalar_type() == at::kDouble && hyper->numel() == count && hyper->is_contiguous() &&
                  hyper->device() == device,
              "ampinit.", op, ": hyper must be a contiguous float64 tensor of ", count, " values ", layout, " on ",
              device, "; got ", hyper->numel(), " value(s) of ", hyper->scalar_type(), " on ", hyper->device());
}

// SGD's new-buffer flags: empty without momentum buffers, else one 1-element float32 tensor per
// param.
inline void check_new_buffer_flags(const char* op, at::TensorList flags, size_t buffers, const at::Device& device) {
  check_same_length(op, "momentum_buffers", buffers, "new_buffer_flags", flags.size());
  for (const auto& flag : flags) check_flag(op, "new_buffer_flags[i]", flag, device);
}

}  // namespace ampinit

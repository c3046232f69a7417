// What the CUDA ops share: the device of a call, dtype dispatch, grouping rows by dtypes.
#pragma once

#include <ATen/ATen.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <initializer_list>
#include <map>
#include <vector>

#include "../common.h"

namespace ampinit::cuda {

// The device a CUDA op runs on: that of its first CUDA tensor.  Found before any device guard,
// so that flags on the CPU beside CUDA tensors fail in check_flag with a message that says
// what to do, not inside the guard.
inline at::Device cuda_device_of(const char* op, std::initializer_list<at::TensorList> lists,
                                 std::initializer_list<const at::Tensor*> singles = {}) {
  for (const auto& list : lists) {
    for (const auto& tensor : list) {
      if (tensor.defined() && tensor.is_cuda()) return tensor.device();
    }
  }
  for (const at::Tensor* tensor : singles) {
    if (tensor != nullptr && tensor->defined() && tensor->is_cuda()) return tensor->device();
  }
  TORCH_CHECK(false, "ampinit.", op, ": the CUDA kernel got no CUDA tensor");
}

template <typename Fn>
void with_type(c10::ScalarType type, const Fn& fn) {
  switch (type) {
    case at::kHalf: fn(at::Half{}); break;
    case at::kBFloat16: fn(at::BFloat16{}); break;
    default: fn(float{}); break;  // check_row admits only these three
  }
}

// Rows grouped by the dtypes of their tensors: each group is one set of launches of one
// kernel instantiation.  Returns, per group, the row indices (in row order).  The common case,
// one dtype per list, is found without allocating per row.
inline std::vector<std::vector<size_t>> group_by_dtypes(const std::vector<std::vector<at::Tensor>>& lists) {
  const size_t rows = lists.empty() ? 0 : lists[0].size();
  if (rows == 0) return {};  // empty lists: nothing to launch (callers read sub[0][0] per group)
  bool uniform = true;
  for (const auto& list : lists) {
    for (size_t i = 1; i < rows && uniform; ++i) uniform = list[i].scalar_type() == list[0].scalar_type();
  }
  if (uniform) {
    std::vector<size_t> all(rows);
    for (size_t i = 0; i < rows; ++i) all[i] = i;
    return {std::move(all)};
  }
  std::map<std::vector<c10::ScalarType>, std::vector<size_t>> groups;
  for (size_t i = 0; i < rows; ++i) {
    std::vector<c10::ScalarType> key;
    for (const auto& list : lists) key.push_back(list[i].scalar_type());
    groups[key].push_back(i);
  }
  std::vector<std::vector<size_t>> result;
  for (auto& entry : groups) result.push_back(std::move(entry.second));
  return result;
}

inline std::vector<std::vector<at::Tensor>> select(const std::vector<std::vector<at::Tensor>>& lists,
                                                   const std::vector<size_t>& rows) {
  if (!lists.empty() && rows.size() == lists[0].size()) return lists;  // one group: all rows, in order
  std::vector<std::vector<at::Tensor>> out(lists.size());
  for (size_t l = 0; l < lists.size(); ++l) {
    for (size_t r : rows) out[l].push_back(lists[l][r]);
  }
  return out;
}

inline std::vector<int32_t> as_indices(const std::vector<size_t>& rows) {
  return std::vector<int32_t>(rows.begin(), rows.end());
}

}  // namespace ampinit::cuda

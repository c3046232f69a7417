// The chunked multi-tensor launcher: many tensors per launch, each block one chunk of one
// tensor.  The tensors' addresses travel in the kernel's parameter block, so a launch needs no
// host-to-device copy and no sync, and is safe to capture in a CUDA graph.
//
// The parameter block is 4 KiB everywhere, or 32,764 bytes where the build (CUDA >= 12.1), the
// driver (>= 12.1) and the GPU (Volta+) allow it: seven times the blocks and tensors per launch.
// Both metadata layouts are compiled; launch() picks one at run time (launch_config.h).
//
// Indices are 64-bit: a chunk's start is chunk * kChunkSize computed in int64, so tensors of
// more than 2**31 elements work.  Inside a chunk, each array is read and written in 16-byte
// (float) or 8-byte (16-bit) vectors of kILP elements when its address allows: a short scalar
// head first aligns the chunk's widest array, and an array whose offset differs from it (a
// view at an odd offset, say) falls back to scalar accesses for itself only.  Each thread
// issues the loads of kUnroll vectors before any arithmetic, keeping that many in flight.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <type_traits>
#include <vector>

#include "launch_config.h"

#if defined(CUDART_VERSION) && CUDART_VERSION >= 12010 && !defined(AMPINIT_NO_LARGE_KERNEL_PARAMS)
// Kernels with a 32 KiB parameter block compile for sm_70 and newer only: define
// AMPINIT_NO_LARGE_KERNEL_PARAMS to build for older GPUs.
#define AMPINIT_LARGE_KERNEL_PARAMS 1
#else
#define AMPINIT_LARGE_KERNEL_PARAMS 0
#endif

namespace ampinit::cuda {

constexpr int kBlockSize = 512;
constexpr int64_t kChunkSize = 65536;
constexpr int kILP = 4;
constexpr int kUnroll = 2;

template <bool Large>
struct ParamSpace;
template <>
struct ParamSpace<false> {
  static constexpr int kBytes = 4096;
  static constexpr int kMaxBlocks = 320;
  using BlockIndex = uint8_t;
};
template <>
struct ParamSpace<true> {
  static constexpr int kBytes = 32764;
  static constexpr int kMaxBlocks = 2240;
  using BlockIndex = uint16_t;
};

// Bytes of the parameter block left to the functor (and alignment padding) beside the metadata.
constexpr int kFunctorBytes = 256;

// Per tensor: its address in each of the Depth lists, its size, two optional device scalars
// (an optimizer's step counter and SGD's new-buffer flag) and its position in the op's
// arguments; per block: which tensor and chunk it runs.
template <int Depth, bool Large>
struct TensorListMeta {
  using Space = ParamSpace<Large>;
  using BlockIndex = typename Space::BlockIndex;
  static constexpr int kMaxBlocks = Space::kMaxBlocks;
  static constexpr int kPerTensor = Depth * 8 + 8 + 2 * 8 + 4;
  static constexpr int kFixed = 8 + kMaxBlocks * (4 + static_cast<int>(sizeof(BlockIndex))) + kFunctorBytes;
  static constexpr int kFit = (Space::kBytes - kFixed) / kPerTensor;
  static constexpr int kMaxTensors =
      kFit < static_cast<int>(std::numeric_limits<BlockIndex>::max()) ? kFit
                                                                       : std::numeric_limits<BlockIndex>::max();

  int64_t block_offset;  // how many blocks earlier launches of this op ran
  void* addresses[Depth][kMaxTensors];
  int64_t sizes[kMaxTensors];
  float* scalars[2][kMaxTensors];
  int32_t tensor_index[kMaxTensors];
  int32_t block_to_chunk[kMaxBlocks];
  BlockIndex block_to_tensor[kMaxBlocks];
};

template <int Depth, bool Large, typename Functor>
__global__ void __launch_bounds__(kBlockSize)
    multi_tensor_kernel(const TensorListMeta<Depth, Large> meta, Functor functor) {
  functor(meta, meta.block_to_tensor[blockIdx.x], static_cast<int64_t>(meta.block_to_chunk[blockIdx.x]));
}

// Per row: up to two device scalars handed to the functor (meta.scalars[0/1][t]).
using RowScalars = std::array<float*, 2>;

template <int Depth, bool Large, typename Functor>
void launch_with(const std::vector<std::vector<at::Tensor>>& lists, const std::vector<RowScalars>& scalars,
                 const std::vector<int32_t>& indices, const Functor& functor) {
  using Meta = TensorListMeta<Depth, Large>;
  static_assert(sizeof(Meta) + sizeof(Functor) <= ParamSpace<Large>::kBytes,
                "the metadata and the functor must fit the kernel parameter block");
  TORCH_INTERNAL_ASSERT(lists.size() == Depth);
  // The metadata goes by value into each launch; 32 KiB stays off the host stack.
  auto meta = std::make_unique<Meta>();
  std::memset(meta.get(), 0, sizeof(Meta));
  const auto stream = at::cuda::getCurrentCUDAStream();
  int tensors = 0, blocks = 0;
  auto flush = [&]() {
    multi_tensor_kernel<Depth, Large><<<blocks, kBlockSize, 0, stream>>>(*meta, functor);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    meta->block_offset += blocks;
    blocks = 0;
  };
  auto set_slot = [&](int slot, size_t row) {
    for (int d = 0; d < Depth; ++d) meta->addresses[d][slot] = lists[d][row].data_ptr();
    meta->sizes[slot] = lists[0][row].numel();
    meta->scalars[0][slot] = scalars.empty() ? nullptr : scalars[row][0];
    meta->scalars[1][slot] = scalars.empty() ? nullptr : scalars[row][1];
    meta->tensor_index[slot] = indices[row];
  };
  for (size_t i = 0; i < lists[0].size(); ++i) {
    const int64_t numel = lists[0][i].numel();
    if (numel == 0) continue;
    set_slot(tensors, i);
    ++tensors;
    const int64_t chunks = (numel + kChunkSize - 1) / kChunkSize;
    for (int64_t c = 0; c < chunks; ++c) {
      meta->block_to_tensor[blocks] = static_cast<typename Meta::BlockIndex>(tensors - 1);
      meta->block_to_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool last_chunk = c == chunks - 1;
      if (blocks == Meta::kMaxBlocks || (tensors == Meta::kMaxTensors && last_chunk)) {
        flush();
        if (last_chunk) {
          tensors = 0;
        } else {  // this tensor goes on in the next launch, from slot 0
          set_slot(0, i);
          tensors = 1;
        }
      }
    }
  }
  if (blocks > 0) flush();
}

// Runs `functor(meta, tensor, chunk)` over every chunk of the tensors in `lists` (lists[l][i]:
// tensor i of list l; all tensors of row i have lists[0][i].numel() elements, dense, same
// layout).  `scalars` is empty or one pair of device pointers per row; `indices[i]` is row i's
// position for per-tensor output.  The functor's operator() takes any TensorListMeta.
template <int Depth, typename Functor>
void launch(const std::vector<std::vector<at::Tensor>>& lists, const std::vector<RowScalars>& scalars,
            const std::vector<int32_t>& indices, const Functor& functor) {
#if AMPINIT_LARGE_KERNEL_PARAMS
  if (kernel_param_bytes() > 4096) return launch_with<Depth, true>(lists, scalars, indices, functor);
#endif
  launch_with<Depth, false>(lists, scalars, indices, functor);
}

// -- chunk geometry ------------------------------------------------------------------------------

struct ChunkRange {
  int64_t start, length;
  __device__ ChunkRange(int64_t size, int64_t chunk) : start(chunk * kChunkSize) {
    length = size - start < kChunkSize ? size - start : kChunkSize;
  }
};

template <typename T>
__device__ __forceinline__ bool vector_aligned(const T* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kILP) == 0;
}

// Elements before `p` reaches a vector boundary (kILP - its misalignment), 0 to kILP - 1.
template <typename T>
__device__ __forceinline__ int head_to_align(const T* p) {
  const int misaligned = static_cast<int>((reinterpret_cast<uintptr_t>(p) / sizeof(T)) % kILP);
  return (kILP - misaligned) % kILP;
}

// A chunk of `length` elements: [0, head) scalar, [head, packs_end) in vectors, then a scalar tail.
struct Split {
  int64_t head, packs_end, length;
  __device__ Split(int64_t length_, int head_) : length(length_) {
    head = head_ < length ? head_ : length;
    packs_end = head + (length - head) / kILP * kILP;
  }
};

// Visits the chunk: load(u, i, count) for up to kUnroll slots u, then finish(u, i, count) for
// each: count is kILP for a vector of elements [i, i + kILP), 1 for element i.
template <typename Load, typename Finish>
__device__ __forceinline__ void for_each_pack(const Split& split, const Load& load, const Finish& finish) {
  for (int64_t i = threadIdx.x; i < split.head; i += blockDim.x) {
    load(0, i, 1);
    finish(0, i, 1);
  }
  const int64_t stride = static_cast<int64_t>(blockDim.x) * kILP;
  for (int64_t base = split.head + threadIdx.x * kILP; base < split.packs_end; base += stride * kUnroll) {
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < split.packs_end) load(u, i, kILP);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      const int64_t i = base + u * stride;
      if (i < split.packs_end) finish(u, i, kILP);
    }
  }
  for (int64_t i = split.packs_end + threadIdx.x; i < split.length; i += blockDim.x) {
    load(0, i, 1);
    finish(0, i, 1);
  }
}

// -- element access ------------------------------------------------------------------------------

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T values[N];
};

// One array of a chunk: the pointer at the chunk's start (null: the call has no such array)
// and whether its vectors are aligned once the block skipped the common head.
template <typename T>
struct ArrayRef {
  T* p;
  bool vectors;
  __device__ ArrayRef(T* p_, int head) : p(p_), vectors(p_ != nullptr && vector_aligned(p_ + head)) {}
};

template <typename T>
__device__ __forceinline__ void load(float (&out)[kILP], const ArrayRef<T>& a, int64_t i, int count) {
  using V = std::remove_const_t<T>;
  if (count == kILP && a.vectors) {
    const Pack<V, kILP> pack = *reinterpret_cast<const Pack<V, kILP>*>(a.p + i);
#pragma unroll
    for (int k = 0; k < kILP; ++k) out[k] = static_cast<float>(pack.values[k]);
  } else if (count == kILP) {
#pragma unroll
    for (int k = 0; k < kILP; ++k) out[k] = static_cast<float>(a.p[i + k]);
  } else {
    out[0] = static_cast<float>(a.p[i]);
  }
}

template <typename T>
__device__ __forceinline__ void store(const ArrayRef<T>& a, int64_t i, const float (&in)[kILP], int count) {
  if (count == kILP && a.vectors) {
    Pack<T, kILP> pack;
#pragma unroll
    for (int k = 0; k < kILP; ++k) pack.values[k] = static_cast<T>(in[k]);
    *reinterpret_cast<Pack<T, kILP>*>(a.p + i) = pack;
  } else if (count == kILP) {
#pragma unroll
    for (int k = 0; k < kILP; ++k) a.p[i + k] = static_cast<T>(in[k]);
  } else {
    a.p[i] = static_cast<T>(in[0]);
  }
}

// The largest magnitude that a float rounds to a finite T (round-to-nearest-even): a stored
// value is non-finite exactly when !(|v| < boundary).
template <typename T>
__device__ __forceinline__ float overflow_boundary() {
  if constexpr (std::is_same_v<T, at::Half>) {
    return 65520.0f;  // 65504 + half an ulp: the tie rounds to even, 65536 = inf
  } else if constexpr (std::is_same_v<T, at::BFloat16>) {
    return 0x1.ffp+127f;  // the largest bfloat16 + half an ulp: the tie rounds to inf
  } else {
    return __int_as_float(0x7f800000);  // inf: only inf and NaN fail |v| < inf
  }
}

template <typename T>
__device__ __forceinline__ bool stores_nonfinite(float v) {
  return !(fabsf(v) < overflow_boundary<T>());
}

}  // namespace ampinit::cuda

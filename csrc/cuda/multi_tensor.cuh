// The chunked multi-tensor launcher: many tensors per launch, each block one chunk of one
// tensor.  The tensors' addresses travel in the kernel's parameter block (under the 4 KiB
// limit for every depth), so a launch needs no host-to-device copy and no sync.
//
// Indices are 64-bit: a chunk's start is chunk * kChunkSize computed in int64, so tensors of
// more than 2**31 elements work.  Loads are 16-byte vectors (4 floats, or 4 16-bit values in
// 8 bytes) when every address of the tensor is aligned for them, with a scalar tail.
#pragma once

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>

#include <cstring>
#include <vector>

namespace ampinit::cuda {

constexpr int kBlockSize = 512;
constexpr int64_t kChunkSize = 65536;
constexpr int kMaxBlocks = 320;
constexpr int kILP = 4;

constexpr int max_tensors(int depth) {
  return depth == 1 ? 64 : depth == 2 ? 48 : depth == 3 ? 36 : depth == 4 ? 30 : 24;
}

template <int Depth>
struct TensorListMeta {
  static constexpr int kMaxTensors = max_tensors(Depth);
  void* addresses[Depth][kMaxTensors];
  int64_t sizes[kMaxTensors];
  const float* scalars[kMaxTensors];  // a per-tensor device scalar (an optimizer's step), or null
  int32_t tensor_index[kMaxTensors];  // the tensor's position in the op's arguments
  unsigned char block_to_tensor[kMaxBlocks];
  int32_t block_to_chunk[kMaxBlocks];
  int64_t block_offset;  // how many blocks earlier launches of this op ran
};
static_assert(sizeof(TensorListMeta<1>) < 4000 && sizeof(TensorListMeta<2>) < 4000 &&
                  sizeof(TensorListMeta<3>) < 4000 && sizeof(TensorListMeta<4>) < 4000 &&
                  sizeof(TensorListMeta<5>) < 4000,
              "kernel parameters must stay under 4 KiB");

template <int Depth, typename Functor>
__global__ void __launch_bounds__(kBlockSize) multi_tensor_kernel(const TensorListMeta<Depth> meta, Functor functor) {
  const int tensor = meta.block_to_tensor[blockIdx.x];
  const int64_t chunk = meta.block_to_chunk[blockIdx.x];
  functor(meta, tensor, chunk);
}

// Runs `functor` over every chunk of the tensors in `lists` (lists[l][i]: tensor i of list l;
// all tensors of row i have lists[0][i].numel() elements, dense, same layout).  `scalars` is
// empty or one device pointer per row; `indices[i]` is row i's position for per-tensor output.
template <int Depth, typename Functor>
void launch(const std::vector<std::vector<at::Tensor>>& lists, const std::vector<const float*>& scalars,
            const std::vector<int32_t>& indices, const Functor& functor) {
  TORCH_INTERNAL_ASSERT(lists.size() == Depth);
  TensorListMeta<Depth> meta;
  std::memset(&meta, 0, sizeof(meta));
  const auto stream = at::cuda::getCurrentCUDAStream();
  int tensors = 0, blocks = 0;
  auto flush = [&]() {
    multi_tensor_kernel<Depth><<<blocks, kBlockSize, 0, stream>>>(meta, functor);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    meta.block_offset += blocks;
    blocks = 0;
  };
  for (size_t i = 0; i < lists[0].size(); ++i) {
    const int64_t numel = lists[0][i].numel();
    if (numel == 0) continue;
    for (int d = 0; d < Depth; ++d) meta.addresses[d][tensors] = lists[d][i].data_ptr();
    meta.sizes[tensors] = numel;
    meta.scalars[tensors] = scalars.empty() ? nullptr : scalars[i];
    meta.tensor_index[tensors] = indices[i];
    ++tensors;
    const int64_t chunks = (numel + kChunkSize - 1) / kChunkSize;
    for (int64_t c = 0; c < chunks; ++c) {
      meta.block_to_tensor[blocks] = static_cast<unsigned char>(tensors - 1);
      meta.block_to_chunk[blocks] = static_cast<int32_t>(c);
      ++blocks;
      const bool last_chunk = c == chunks - 1;
      if (blocks == kMaxBlocks || (tensors == TensorListMeta<Depth>::kMaxTensors && last_chunk)) {
        flush();
        if (last_chunk) {
          tensors = 0;
        } else {  // this tensor goes on in the next launch, from slot 0
          for (int d = 0; d < Depth; ++d) meta.addresses[d][0] = meta.addresses[d][tensors - 1];
          meta.sizes[0] = meta.sizes[tensors - 1];
          meta.scalars[0] = meta.scalars[tensors - 1];
          meta.tensor_index[0] = meta.tensor_index[tensors - 1];
          tensors = 1;
        }
      }
    }
  }
  if (blocks > 0) flush();
}

// -- per-chunk element access -------------------------------------------------------------------

template <typename T, int N>
struct alignas(sizeof(T) * N) Pack {
  T values[N];
};

template <typename T>
__device__ __forceinline__ bool aligned_for_vectors(const void* p) {
  return reinterpret_cast<uintptr_t>(p) % (sizeof(T) * kILP) == 0;
}

template <typename T>
__device__ __forceinline__ void load_pack(float (&out)[kILP], const T* src) {
  const Pack<T, kILP> pack = *reinterpret_cast<const Pack<T, kILP>*>(src);
#pragma unroll
  for (int k = 0; k < kILP; ++k) out[k] = static_cast<float>(pack.values[k]);
}

template <typename T>
__device__ __forceinline__ void store_pack(T* dst, const float (&in)[kILP]) {
  Pack<T, kILP> pack;
#pragma unroll
  for (int k = 0; k < kILP; ++k) pack.values[k] = static_cast<T>(in[k]);
  *reinterpret_cast<Pack<T, kILP>*>(dst) = pack;
}

// The elements [begin, begin + length) of this block's chunk, visited as packs of kILP when
// `vectors`, then one by one: body(offset, count, k) with count == kILP or 1.
template <typename Body>
__device__ __forceinline__ void for_each_element(int64_t length, bool vectors, const Body& body) {
  int64_t scalar_from = 0;
  if (vectors) {
    const int64_t packs = length / kILP;
    for (int64_t p = threadIdx.x; p < packs; p += blockDim.x) body(p * kILP, kILP);
    scalar_from = packs * kILP;
  }
  for (int64_t i = scalar_from + threadIdx.x; i < length; i += blockDim.x) body(i, 1);
}

template <typename T>
__device__ __forceinline__ void load_n(float (&out)[kILP], const T* src, int count) {
  if (count == kILP) return load_pack(out, src);
  out[0] = static_cast<float>(src[0]);
}

template <typename T>
__device__ __forceinline__ void store_n(T* dst, const float (&in)[kILP], int count) {
  if (count == kILP) return store_pack(dst, in);
  dst[0] = static_cast<T>(in[0]);
}

}  // namespace ampinit::cuda

// The run-time choice of the kernel-parameter space (see launch_config.h).
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/util/Exception.h>
#include <cuda_runtime.h>

#include <atomic>

#include "launch_config.h"
#include "multi_tensor.cuh"

namespace ampinit::cuda {
namespace {

std::atomic<int> forced_bytes{0};

// 32 KiB of kernel parameters need a CUDA 12.1 build (checked at compile time), a 12.1 driver
// and compute capability 7.0.
bool large_params_possible() {
#if AMPINIT_LARGE_KERNEL_PARAMS
  static const bool driver_ok = [] {
    int version = 0;
    return cudaDriverGetVersion(&version) == cudaSuccess && version >= 12010;
  }();
  return driver_ok && at::cuda::getCurrentDeviceProperties()->major >= 7;
#else
  return false;
#endif
}

}  // namespace

int kernel_param_bytes() {
  const int forced = forced_bytes.load(std::memory_order_relaxed);
  if (forced != 0) return forced;
  return large_params_possible() ? ParamSpace<true>::kBytes : ParamSpace<false>::kBytes;
}

void set_kernel_param_bytes(int bytes) {
  TORCH_CHECK(bytes == 0 || bytes == ParamSpace<false>::kBytes || bytes == ParamSpace<true>::kBytes,
              "ampinit: kernel parameter space must be 0 (automatic), ", ParamSpace<false>::kBytes, " or ",
              ParamSpace<true>::kBytes, "; got ", bytes);
  TORCH_CHECK(bytes != ParamSpace<true>::kBytes || large_params_possible(),
              "ampinit: 32 KiB kernel parameters need a CUDA >= 12.1 build, a >= 12.1 driver and a Volta or "
              "newer GPU");
  forced_bytes.store(bytes, std::memory_order_relaxed);
}

}  // namespace ampinit::cuda

// How the CUDA multi-tensor launches pass their metadata, readable from plain C++ (module.cpp).
#pragma once

namespace ampinit::cuda {

// Bytes of kernel parameters the launches use: 32764 where the build (CUDA >= 12.1), the driver
// (>= 12.1) and the GPU (Volta or newer) allow it, else 4096.  Decided once per process for
// device 0's properties, unless set_kernel_param_bytes() forced a value.
int kernel_param_bytes();

// Forces 4096 or 32764 (0: back to the automatic choice).  32764 where the build or the driver
// cannot use it is an error.  For tests and benchmarks of both launch paths.
void set_kernel_param_bytes(int bytes);

}  // namespace ampinit::cuda

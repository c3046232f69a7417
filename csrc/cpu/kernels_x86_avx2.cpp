// The CPU kernels for AVX2 + FMA + F16C machines.  setup.py compiles this file alone with
// -mavx2 -mfma -mf16c and CPU_CAPABILITY=AVX2, so at::vec uses 256-bit registers and the
// hardware fp16 <-> fp32 conversions; ops_cpu.cpp calls it only where ATen reports AVX2.
#include "kernels.h"

namespace ampinit::cpu {
const KernelTable& avx2_kernels() { return CPU_CAPABILITY::table("avx2"); }
}  // namespace ampinit::cpu

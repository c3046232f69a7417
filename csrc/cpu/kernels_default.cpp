// The CPU kernels for any CPU: at::vec's portable implementation (the compiler's baseline ISA).
#ifndef CPU_CAPABILITY
#define CPU_CAPABILITY DEFAULT
#endif
#include "kernels.h"

namespace ampinit::cpu {
const KernelTable& default_kernels() { return CPU_CAPABILITY::table("default"); }
}  // namespace ampinit::cpu

// The CPU kernels as a table of plain functions over one contiguous range of elements.
//
// kernels.h is compiled once per CPU capability (kernels_default.cpp, and kernels_x86_avx2.cpp
// with -mavx2 -mfma -mf16c); ops_cpu.cpp picks a table at run time from ATen's own
// capability detection, splits the tensors into chunks and runs the chunks in parallel.
#pragma once

#include <c10/core/ScalarType.h>

#include <cstdint>

namespace ampinit::cpu {

// Hyper-parameters of one fused-optimizer call, with the per-tensor bias corrections.
struct AdamParams {
  float beta2, eps, weight_decay;
  float one_minus_beta1, one_minus_beta2;  // computed in double, like torch's Python scalars
  float decay;                             // 1 - lr * weight_decay (AdamW)
  bool decoupled_weight_decay;             // AdamW: decay the weights, not the gradient
  float inv_scale;
  float step_size;         // lr / (1 - beta1^step), or lr without bias correction
  float bias_correction2_sqrt;
  // Nonzero: bfloat16 moments are rounded stochastically, with noise drawn from (key, element
  // index) (see kernels.h, store_state); key = the step number mixed with the moment.
  bool stochastic_state;
  uint32_t seed;  // the step number after this step
};

struct SgdParams {
  float lr, momentum, one_minus_dampening, weight_decay;
  bool nesterov;
  bool new_buffer;  // the momentum buffer has never been applied: it becomes the gradient
  float inv_scale;
};

// The dtypes of one fused-optimizer row: `state` is the optimizer state's (the param's, float32 or
// bfloat16); `model` is c10::ScalarType::Undefined without a model copy (always, for 16-bit params).
struct OptimizerTypes {
  c10::ScalarType param, grad, state, model;
};

// A bfloat16 param kept with remainders (remainder masters, see kernels.h): the remainders of
// the range, and the tensor's tie words with the index of the range's first element in the
// tensor.  `remainder` is null for a param without them.
struct MasterRemainder {
  int16_t* remainder;
  uint32_t* ties;
  int64_t base;
};

struct KernelTable {
  const char* name;
  // y = x * inv_scale.  Returns true if a value written to y is inf/NaN (a finite product
  // that overflows y's dtype included).
  bool (*unscale)(c10::ScalarType in, c10::ScalarType out, const void* x, void* y, int64_t n,
                  float inv_scale);
  // y = out_weight * y + x * inv_scale.  Returns true if x * inv_scale is inf/NaN somewhere, or
  // a finite y becomes inf/NaN (the sum overflows y's dtype).
  bool (*accumulate)(c10::ScalarType in, c10::ScalarType out, const void* x, void* y, int64_t n,
                     float inv_scale, float out_weight);
  // y = x, converted with round-to-nearest-even.
  void (*copy)(c10::ScalarType in, c10::ScalarType out, const void* x, void* y, int64_t n);
  // true if x holds an inf/NaN.
  bool (*check)(c10::ScalarType in, const void* x, int64_t n);
  // master = model wherever model != master rounded to model_type (a write to the model adopted).
  void (*adopt)(c10::ScalarType model_type, const void* model, float* master, int64_t n);
  // sum over j of fingerprint_bits::term(bits(x[j]), base + j), mod 2^32: bits are the unsigned
  // element (2 or 4 bytes).  Any single changed element changes it (each term is a bijection).
  uint32_t (*fingerprint)(int64_t element_size, const void* x, int64_t n, int64_t base);
  // Sum of squares, each square and the sum in double.
  double (*sum_of_squares)(c10::ScalarType in, const void* x, int64_t n);
  // One Adam/AdamW update of params and state; `model` (may be null) gets the new params.
  // `base`: the index of the range's first element in its tensor (stochastic rounding's noise).
  void (*adam)(const AdamParams& p, const OptimizerTypes& types, void* param, const MasterRemainder& r,
               const void* grad, void* exp_avg, void* exp_avg_sq, void* model, int64_t n, int64_t base);
  // One SGD update; `momentum_buffer` is null without momentum.
  void (*sgd)(const SgdParams& p, const OptimizerTypes& types, void* param, const MasterRemainder& r,
              const void* grad, void* momentum_buffer, void* model, int64_t n);
  // master = the FP32 master of a bfloat16 weight and its remainders (ops.join_masters).
  void (*join_masters)(const void* weight, const MasterRemainder& r, float* master, int64_t n);
  // weight, remainders and tie bits = the split of master (ops.split_masters_): the tie bits are
  // written only where the remainder is -32768, the only place they are read.
  void (*split_masters)(const float* master, void* weight, const MasterRemainder& r, int64_t n);
};

const KernelTable& default_kernels();
#ifdef AMPINIT_AVX2_KERNELS
const KernelTable& avx2_kernels();
#endif

}  // namespace ampinit::cpu

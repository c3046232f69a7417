// Vectorized CPU kernels over one contiguous range, written once with at::vec and compiled
// once per CPU capability: everything here lives in `CPU_CAPABILITY`, a namespace named after
// the instruction set of the including file, so the copies never collide at link time.
//
// Every kernel computes in float32.  An iteration handles kStep elements: one vector of 16-bit
// values converts to exactly two float vectors.  The tail goes through a zero-padded buffer,
// so it runs the same vector code and rounds the same way.
#pragma once

#include <ATen/cpu/vec/functional.h>
#include <ATen/cpu/vec/vec.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <type_traits>

#include "kernel_table.h"

namespace ampinit::cpu {
inline namespace CPU_CAPABILITY {

using FloatVec = at::vec::Vectorized<float>;
constexpr int64_t kStep = 2 * FloatVec::size();

template <typename T>
inline void load(const T* src, FloatVec& lo, FloatVec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo = FloatVec::loadu(src);
    hi = FloatVec::loadu(src + FloatVec::size());
  } else {
    std::tie(lo, hi) = at::vec::convert_to_float<T>(at::vec::Vectorized<T>::loadu(src));
  }
}

template <typename T>
inline void store(T* dst, const FloatVec& lo, const FloatVec& hi) {
  if constexpr (std::is_same_v<T, float>) {
    lo.store(dst);
    hi.store(dst + FloatVec::size());
  } else {
    at::vec::convert_from_float<T>(lo, hi).store(dst);
  }
}

// Runs `body(offset, count)` over [0, n) in steps of kStep; the last, partial step is
// staged through float buffers by the caller-supplied body (count < kStep).
template <typename Body>
inline void for_each_step(int64_t n, const Body& body) {
  int64_t i = 0;
  for (; i + kStep <= n; i += kStep) body(i, kStep);
  if (i < n) body(i, n - i);
}

// Loads kStep values (or `count` of them, zero padded) as floats.
template <typename T>
inline void load_n(const T* src, int64_t count, FloatVec& lo, FloatVec& hi) {
  if (count == kStep) return load(src, lo, hi);
  alignas(64) float buffer[kStep] = {};
  for (int64_t k = 0; k < count; ++k) buffer[k] = static_cast<float>(src[k]);
  lo = FloatVec::loadu(buffer);
  hi = FloatVec::loadu(buffer + FloatVec::size());
}

// Stores the first `count` values; the conversion is the vector one even for the tail.
template <typename T>
inline void store_n(T* dst, int64_t count, const FloatVec& lo, const FloatVec& hi) {
  if (count == kStep) return store(dst, lo, hi);
  alignas(64) T buffer[kStep];
  store(buffer, lo, hi);
  for (int64_t k = 0; k < count; ++k) dst[k] = buffer[k];
}

// A float is inf or NaN exactly when its exponent bits are all ones.  The running maximum of
// the masked exponents (an integer max: one cycle, no long dependency chain) equals the mask
// at the end iff some value was non-finite.
using IntVec = at::vec::Vectorized<int32_t>;
constexpr int32_t kExponentMask = 0x7f800000;

inline IntVec flag_nonfinite(const IntVec& flags, const FloatVec& x) {
  return at::vec::maximum(flags, at::vec::cast<int32_t>(x) & IntVec(kExponentMask));
}

inline bool any_nonfinite(const IntVec& flags) {
  alignas(64) int32_t values[IntVec::size()];
  flags.store(values);
  for (int64_t k = 0; k < IntVec::size(); ++k) {
    if (values[k] == kExponentMask) return true;
  }
  return false;
}

template <typename In, typename Out>
bool unscale(const In* x, Out* y, int64_t n, float inv_scale) {
  const FloatVec inv(inv_scale);
  IntVec lo_flags(0), hi_flags(0);
  for_each_step(n, [&](int64_t i, int64_t count) {
    FloatVec lo, hi;
    load_n(x + i, count, lo, hi);
    lo = lo * inv;
    hi = hi * inv;
    lo_flags = flag_nonfinite(lo_flags, lo);
    hi_flags = flag_nonfinite(hi_flags, hi);
    store_n(y + i, count, lo, hi);
  });
  return any_nonfinite(at::vec::maximum(lo_flags, hi_flags));
}

template <typename In, typename Out>
bool accumulate(const In* x, Out* y, int64_t n, float inv_scale, float out_weight) {
  const FloatVec inv(inv_scale), weight(out_weight);
  IntVec lo_flags(0), hi_flags(0);
  for_each_step(n, [&](int64_t i, int64_t count) {
    FloatVec x_lo, x_hi, y_lo, y_hi;
    load_n(x + i, count, x_lo, x_hi);
    load_n(y + i, count, y_lo, y_hi);
    x_lo = x_lo * inv;
    x_hi = x_hi * inv;
    lo_flags = flag_nonfinite(lo_flags, x_lo);
    hi_flags = flag_nonfinite(hi_flags, x_hi);
    store_n(y + i, count, y_lo * weight + x_lo, y_hi * weight + x_hi);
  });
  return any_nonfinite(at::vec::maximum(lo_flags, hi_flags));
}

template <typename In, typename Out>
void copy(const In* x, Out* y, int64_t n) {
  for_each_step(n, [&](int64_t i, int64_t count) {
    FloatVec lo, hi;
    load_n(x + i, count, lo, hi);
    store_n(y + i, count, lo, hi);
  });
}

template <typename In>
bool check(const In* x, int64_t n) {
  IntVec lo_flags(0), hi_flags(0);
  for_each_step(n, [&](int64_t i, int64_t count) {
    FloatVec lo, hi;
    load_n(x + i, count, lo, hi);
    lo_flags = flag_nonfinite(lo_flags, lo);
    hi_flags = flag_nonfinite(hi_flags, hi);
  });
  return any_nonfinite(at::vec::maximum(lo_flags, hi_flags));
}

template <typename In>
double sum_of_squares(const In* x, int64_t n) {
  // Float lanes, flushed into a double every kFlush elements: float speed, double accuracy.
  constexpr int64_t kFlush = 64 * kStep;
  double total = 0.0;
  for (int64_t start = 0; start < n; start += kFlush) {
    FloatVec acc_lo(0.0f), acc_hi(0.0f);
    for_each_step(std::min(kFlush, n - start), [&](int64_t i, int64_t count) {
      FloatVec lo, hi;
      load_n(x + start + i, count, lo, hi);
      acc_lo = at::vec::fmadd(lo, lo, acc_lo);
      acc_hi = at::vec::fmadd(hi, hi, acc_hi);
    });
    alignas(64) float lanes[kStep];
    acc_lo.store(lanes);
    acc_hi.store(lanes + FloatVec::size());
    for (int64_t k = 0; k < kStep; ++k) total += lanes[k];
  }
  return total;
}

// Adam/AdamW, written as torch.optim.Adam's single-tensor path computes it.
template <typename Grad, typename Model>
void adam(const AdamParams& p, float* param, const Grad* grad, float* exp_avg, float* exp_avg_sq,
          Model* model, int64_t n) {
  const FloatVec inv(p.inv_scale), wd(p.weight_decay), decay(p.decay);
  const FloatVec one_minus_beta1(p.one_minus_beta1), beta2(p.beta2), one_minus_beta2(p.one_minus_beta2);
  const FloatVec eps(p.eps), neg_step_size(-p.step_size), bc2_sqrt(p.bias_correction2_sqrt);
  const bool coupled_decay = p.weight_decay != 0.0f && !p.decoupled_weight_decay;
  const bool decoupled_decay = p.weight_decay != 0.0f && p.decoupled_weight_decay;
  for_each_step(n, [&](int64_t i, int64_t count) {
    FloatVec g[2], w[2], m[2], v[2];
    load_n(grad + i, count, g[0], g[1]);
    load_n(param + i, count, w[0], w[1]);
    load_n(exp_avg + i, count, m[0], m[1]);
    load_n(exp_avg_sq + i, count, v[0], v[1]);
    for (int h = 0; h < 2; ++h) {
      g[h] = g[h] * inv;
      if (coupled_decay) g[h] = g[h] + wd * w[h];
      if (decoupled_decay) w[h] = w[h] * decay;
      m[h] = m[h] + one_minus_beta1 * (g[h] - m[h]);
      v[h] = v[h] * beta2 + one_minus_beta2 * g[h] * g[h];
      const FloatVec denom = v[h].sqrt() / bc2_sqrt + eps;
      w[h] = w[h] + neg_step_size * m[h] / denom;
    }
    store_n(param + i, count, w[0], w[1]);
    store_n(exp_avg + i, count, m[0], m[1]);
    store_n(exp_avg_sq + i, count, v[0], v[1]);
    if constexpr (!std::is_same_v<Model, void>) store_n(model + i, count, w[0], w[1]);
  });
}

// SGD with momentum, dampening, nesterov and weight decay, as torch.optim.SGD computes it.
template <typename Grad, typename Model>
void sgd(const SgdParams& p, float* param, const Grad* grad, float* buffer, Model* model, int64_t n) {
  const FloatVec inv(p.inv_scale), wd(p.weight_decay), momentum(p.momentum);
  const FloatVec one_minus_dampening(p.one_minus_dampening), neg_lr(-p.lr);
  for_each_step(n, [&](int64_t i, int64_t count) {
    FloatVec g[2], w[2], b[2];
    load_n(grad + i, count, g[0], g[1]);
    load_n(param + i, count, w[0], w[1]);
    if (buffer != nullptr && !p.first_step) load_n(buffer + i, count, b[0], b[1]);
    for (int h = 0; h < 2; ++h) {
      g[h] = g[h] * inv;
      if (p.weight_decay != 0.0f) g[h] = g[h] + wd * w[h];
      if (buffer != nullptr) {
        b[h] = p.first_step ? g[h] : b[h] * momentum + one_minus_dampening * g[h];
        g[h] = p.nesterov ? g[h] + momentum * b[h] : b[h];
      }
      w[h] = w[h] + neg_lr * g[h];
    }
    store_n(param + i, count, w[0], w[1]);
    if (buffer != nullptr) store_n(buffer + i, count, b[0], b[1]);
    if constexpr (!std::is_same_v<Model, void>) store_n(model + i, count, w[0], w[1]);
  });
}

// -- dtype dispatch: ScalarType -> template argument ------------------------------------------

template <typename Fn>
inline auto with_type(c10::ScalarType type, const Fn& fn) {
  switch (type) {
    case c10::ScalarType::Half: return fn(c10::Half{});
    case c10::ScalarType::BFloat16: return fn(c10::BFloat16{});
    default: return fn(float{});  // ops_cpu.cpp admits only these three
  }
}

// Like with_type, plus "no tensor" (c10::ScalarType::Undefined) as void.
template <typename Fn>
inline auto with_model_type(c10::ScalarType type, const Fn& fn) {
  if (type == c10::ScalarType::Undefined) return fn(static_cast<void*>(nullptr));
  return with_type(type, [&](auto tag) { return fn(static_cast<decltype(tag)*>(nullptr)); });
}

inline const KernelTable& table(const char* name) {
  static const KernelTable kernels = {
      name,
      [](c10::ScalarType in, c10::ScalarType out, const void* x, void* y, int64_t n, float inv) {
        return with_type(in, [&](auto i) {
          return with_type(out, [&](auto o) {
            using I = decltype(i);
            using O = decltype(o);
            return unscale(static_cast<const I*>(x), static_cast<O*>(y), n, inv);
          });
        });
      },
      [](c10::ScalarType in, c10::ScalarType out, const void* x, void* y, int64_t n, float inv,
         float weight) {
        return with_type(in, [&](auto i) {
          return with_type(out, [&](auto o) {
            using I = decltype(i);
            using O = decltype(o);
            return accumulate(static_cast<const I*>(x), static_cast<O*>(y), n, inv, weight);
          });
        });
      },
      [](c10::ScalarType in, c10::ScalarType out, const void* x, void* y, int64_t n) {
        with_type(in, [&](auto i) {
          with_type(out, [&](auto o) {
            using I = decltype(i);
            using O = decltype(o);
            copy(static_cast<const I*>(x), static_cast<O*>(y), n);
          });
        });
      },
      [](c10::ScalarType in, const void* x, int64_t n) {
        return with_type(in, [&](auto i) { return check(static_cast<const decltype(i)*>(x), n); });
      },
      [](c10::ScalarType in, const void* x, int64_t n) {
        return with_type(in, [&](auto i) {
          return sum_of_squares(static_cast<const decltype(i)*>(x), n);
        });
      },
      [](const AdamParams& p, c10::ScalarType grad_type, c10::ScalarType model_type, float* param,
         const void* grad, float* exp_avg, float* exp_avg_sq, void* model, int64_t n) {
        with_type(grad_type, [&](auto g) {
          with_model_type(model_type, [&](auto* model_tag) {
            using G = decltype(g);
            using M = std::remove_pointer_t<decltype(model_tag)>;
            adam(p, param, static_cast<const G*>(grad), exp_avg, exp_avg_sq, static_cast<M*>(model), n);
          });
        });
      },
      [](const SgdParams& p, c10::ScalarType grad_type, c10::ScalarType model_type, float* param,
         const void* grad, float* buffer, void* model, int64_t n) {
        with_type(grad_type, [&](auto g) {
          with_model_type(model_type, [&](auto* model_tag) {
            using G = decltype(g);
            using M = std::remove_pointer_t<decltype(model_tag)>;
            sgd(p, param, static_cast<const G*>(grad), buffer, static_cast<M*>(model), n);
          });
        });
      },
  };
  return kernels;
}

}  // namespace CPU_CAPABILITY
}  // namespace ampinit::cpu

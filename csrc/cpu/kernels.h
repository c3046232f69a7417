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
#include <cstring>
#include <limits>
#include <type_traits>

#include "../master_bits.h"
#include "kernel_table.h"

#if defined(CPU_CAPABILITY_AVX2)
#include <immintrin.h>
#endif

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

// Loads kStep values (or `count` of them, padded with `pad`) as floats.
template <typename T>
inline void load_n(const T* src, int64_t count, FloatVec& lo, FloatVec& hi, float pad = 0.0f) {
  if (count == kStep) return load(src, lo, hi);
  alignas(64) float buffer[kStep];
  for (int64_t k = count; k < kStep; ++k) buffer[k] = pad;
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

// The largest magnitude that a float rounds to a finite T (round-to-nearest-even): values at
// or beyond it become inf.  A stored value is non-finite exactly when !(|v| < boundary).
template <typename T>
constexpr float overflow_boundary() {
  if constexpr (std::is_same_v<T, c10::Half>) {
    return 65520.0f;  // 65504 + half an ulp (16): the tie rounds to even, 65536 = inf
  } else if constexpr (std::is_same_v<T, c10::BFloat16>) {
    return 0x1.ffp+127f;  // the largest bfloat16, 0x1.fep+127, + half an ulp; the tie rounds to inf
  } else {
    return std::numeric_limits<float>::infinity();
  }
}

// The running maximum of |v| flags what a kernel writes: at::vec::maximum propagates NaN, so
// one comparison at the end finds inf, NaN and values that overflow the output dtype.
inline FloatVec running_max_abs(const FloatVec& max_abs, const FloatVec& v) {
  return at::vec::maximum(max_abs, v.abs());
}

template <typename T>
inline bool any_nonfinite(const FloatVec& lo, const FloatVec& hi) {
  alignas(64) float lanes[kStep];
  lo.store(lanes);
  hi.store(lanes + FloatVec::size());
  for (int64_t k = 0; k < kStep; ++k) {
    if (!(lanes[k] < overflow_boundary<T>())) return true;
  }
  return false;
}

template <typename In, typename Out>
bool unscale(const In* x, Out* y, int64_t n, float inv_scale) {
  const FloatVec inv(inv_scale);
  FloatVec lo_max(0.0f), hi_max(0.0f);
  for_each_step(n, [&](int64_t i, int64_t count) {
    FloatVec lo, hi;
    load_n(x + i, count, lo, hi);
    lo = lo * inv;
    hi = hi * inv;
    lo_max = running_max_abs(lo_max, lo);
    hi_max = running_max_abs(hi_max, hi);
    store_n(y + i, count, lo, hi);
  });
  return any_nonfinite<Out>(lo_max, hi_max);
}

// The check is on what this call brings: a non-finite contribution, or a finite value that the
// sum pushes past y's dtype.  A value that was already inf/NaN in y is not flagged again (it was
// when it was written): with one loss scaler per loss, the loss that overflowed backs off, not
// the next one to add to the same gradients.
// Passes ``v`` through an empty asm the compiler must assume reads and writes it (by reference:
// no vector passed by value): a product passed through it is rounded to float before the add
// that follows, as the fallback's two torch ops round it.  GCC otherwise contracts
// ``a * b + c`` into one FMA (-ffp-contract=fast, its default, with -mfma): one rounding
// instead of two, one ulp off in ~4 % of the elements for out_weight = 0.9.  A store and a
// load per vector, in L1.
template <typename V>
inline void round_apart(V& v) {
  asm volatile("" : "+m"(v));
}

template <typename In, typename Out>
bool accumulate(const In* x, Out* y, int64_t n, float inv_scale, float out_weight) {
  const FloatVec inv(inv_scale), weight(out_weight), zero(0.0f);
  const FloatVec inf(std::numeric_limits<float>::infinity());
  FloatVec contribution_max[2] = {zero, zero}, overflow_max[2] = {zero, zero};
  for_each_step(n, [&](int64_t i, int64_t count) {
    FloatVec c[2], acc[2];
    load_n(x + i, count, c[0], c[1]);
    // padded with inf, which counts as "not finite before": a padded lane is never flagged
    // (0 * an inf out_weight would be NaN)
    load_n(y + i, count, acc[0], acc[1], std::numeric_limits<float>::infinity());
    for (int h = 0; h < 2; ++h) {
      c[h] = c[h] * inv;
      const FloatVec was_finite = acc[h].abs() < inf;
      FloatVec product = acc[h] * weight;
      round_apart(product);
      acc[h] = product + c[h];
      contribution_max[h] = running_max_abs(contribution_max[h], c[h]);
      overflow_max[h] = at::vec::maximum(overflow_max[h], FloatVec::blendv(zero, acc[h].abs(), was_finite));
    }
    store_n(y + i, count, acc[0], acc[1]);
  });
  return any_nonfinite<float>(contribution_max[0], contribution_max[1]) ||
         any_nonfinite<Out>(overflow_max[0], overflow_max[1]);
}

template <typename In, typename Out>
void copy(const In* x, Out* y, int64_t n) {
  for_each_step(n, [&](int64_t i, int64_t count) {
    FloatVec lo, hi;
    load_n(x + i, count, lo, hi);
    store_n(y + i, count, lo, hi);
  });
}

// master = model wherever model differs from master rounded to the model's dtype: a write to
// the model from outside ampinit, adopted.  Reads both, writes a master vector only where
// one of its elements changed (NaN differs from everything, so a NaN model value is taken).
template <typename Model>
void adopt(const Model* model, float* master, int64_t n) {
  constexpr int kAllEqual = (1 << FloatVec::size()) - 1;  // zero_mask() when no lane differs
  for_each_step(n, [&](int64_t i, int64_t count) {
    FloatVec lo, hi, master_lo, master_hi;
    load_n(model + i, count, lo, hi);
    load_n(master + i, count, master_lo, master_hi);
    FloatVec rounded_lo = master_lo, rounded_hi = master_hi;
    if constexpr (!std::is_same_v<Model, float>) {
      std::tie(rounded_lo, rounded_hi) =
          at::vec::convert_to_float<Model>(at::vec::convert_from_float<Model>(master_lo, master_hi));
    }
    const FloatVec differs_lo = lo != rounded_lo;  // all bits set where true (unordered: NaN)
    const FloatVec differs_hi = hi != rounded_hi;
    if (differs_lo.zero_mask() == kAllEqual && differs_hi.zero_mask() == kAllEqual) return;
    store_n(master + i, count, FloatVec::blendv(master_lo, lo, differs_lo),
            FloatVec::blendv(master_hi, hi, differs_hi));
  });
}

// See KernelTable::fingerprint (the terms: master_bits.h).  Unsigned arithmetic wraps, so the
// compiler may vectorize the sum.
template <typename Bits>
uint32_t fingerprint(const Bits* x, int64_t n, int64_t base) {
  const uint32_t first = static_cast<uint32_t>(base);
  uint32_t sum = 0;
  for (int64_t j = 0; j < n; ++j) {
    sum += fingerprint_bits::term(static_cast<uint32_t>(x[j]), first + static_cast<uint32_t>(j));
  }
  return sum;
}

template <typename In>
bool check(const In* x, int64_t n) {
  FloatVec lo_max(0.0f), hi_max(0.0f);
  for_each_step(n, [&](int64_t i, int64_t count) {
    FloatVec lo, hi;
    load_n(x + i, count, lo, hi);
    lo_max = running_max_abs(lo_max, lo);
    hi_max = running_max_abs(hi_max, hi);
  });
  return any_nonfinite<float>(lo_max, hi_max);
}

// Each square in double: a float square overflows for |x| > ~1.8e19 and underflows for
// |x| < ~1e-23, where the norm itself is representable.  The lanes are independent
// accumulators (the compiler vectorizes them), summed in a fixed order at the end.
template <typename In>
double sum_of_squares(const In* x, int64_t n) {
  alignas(64) double acc[kStep] = {};
  for_each_step(n, [&](int64_t i, int64_t count) {
    FloatVec lo, hi;
    load_n(x + i, count, lo, hi);
    alignas(64) float values[kStep];
    lo.store(values);
    hi.store(values + FloatVec::size());
    for (int64_t k = 0; k < kStep; ++k) acc[k] += static_cast<double>(values[k]) * static_cast<double>(values[k]);
  });
  double total = 0.0;
  for (int64_t k = 0; k < kStep; ++k) total += acc[k];
  return total;
}

// torch's lerp: self + weight * (end - self), or end + (weight - 1) * (end - self) for weights
// from 0.5 (exact at weight 1), each one fused multiply-add.
inline FloatVec lerp(const FloatVec& self, const FloatVec& end, float weight) {
  if (std::abs(weight) < 0.5f) return at::vec::fmadd(FloatVec(weight), end - self, self);
  return at::vec::fmadd(FloatVec(weight - 1.0f), end - self, end);
}

// The bits of a step's floats.
inline void float_bits(const FloatVec& lo, const FloatVec& hi, uint32_t (&bits)[kStep]) {
  alignas(64) float values[kStep];
  lo.store(values);
  hi.store(values + FloatVec::size());
  std::memcpy(bits, values, sizeof bits);
}

// -- remainder masters (the format: master_bits.h) ----------------------------------------------
//
// The tie words are read and written only where a remainder is -32768, so rarely, with atomics
// (chunks may share a word).

inline bool tie_bit(const uint32_t* ties, int64_t j) {
  return (__atomic_load_n(ties + (j >> 5), __ATOMIC_RELAXED) >> (j & 31)) & 1u;
}

inline void set_tie_bit(uint32_t* ties, int64_t j, bool value) {
  const uint32_t mask = 1u << (j & 31);
  if (tie_bit(ties, j) == value) return;
  if (value) {
    __atomic_fetch_or(ties + (j >> 5), mask, __ATOMIC_RELAXED);
  } else {
    __atomic_fetch_and(ties + (j >> 5), ~mask, __ATOMIC_RELAXED);
  }
}

#if defined(CPU_CAPABILITY_AVX2)
// AVX2 versions of one full step (kStep = 16 elements) of the join and the split, in registers:
// the same bits as bf16_bits::joined / rounded (master_bits.h), without staging through memory.
inline __m256i rounded_bits8(__m256i bits) {
  const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(bits, _mm256_set1_epi32(0x7fffffff)),
                                         _mm256_set1_epi32(0x7f800000));
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(bits, _mm256_set1_epi32(0x7fff)), odd), 16);
  return _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7fc0), nan);
}

// Returns whether a remainder is -32768 (the tie bit decides: the caller redoes those).
inline bool join16(const uint16_t* weight, const int16_t* rest, FloatVec& lo, FloatVec& hi) {
  const __m256i w16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weight));
  const __m256i r16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(rest));
  const __m256i ties = _mm256_cmpeq_epi16(r16, _mm256_set1_epi16(-32768));
  FloatVec* out[2] = {&lo, &hi};
  for (int h = 0; h < 2; ++h) {
    const __m128i w8 = h == 0 ? _mm256_castsi256_si128(w16) : _mm256_extracti128_si256(w16, 1);
    const __m128i r8 = h == 0 ? _mm256_castsi256_si128(r16) : _mm256_extracti128_si256(r16, 1);
    const __m256i w = _mm256_cvtepu16_epi32(w8);
    const __m256i high = _mm256_slli_epi32(w, 16);
    const __m256i bits = _mm256_add_epi32(high, _mm256_cvtepi16_epi32(r8));
    const __m256i finite = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f80), _mm256_and_si256(w, _mm256_set1_epi32(0x7fff)));
    const __m256i still_rounds = _mm256_and_si256(_mm256_cmpeq_epi32(rounded_bits8(bits), w), finite);
    *out[h] = FloatVec(_mm256_castsi256_ps(_mm256_blendv_epi8(high, bits, still_rounds)));
  }
  return !_mm256_testz_si256(ties, ties);
}

// Writes 16 weights and remainders; returns whether one is a tie (low half 0x8000).
inline bool split16(const FloatVec& lo, const FloatVec& hi, uint16_t* weight, int16_t* rest) {
  __m256i rounded[2], rems[2];
  __m256i any_tie = _mm256_setzero_si256();
  const FloatVec* in[2] = {&lo, &hi};
  for (int h = 0; h < 2; ++h) {
    const __m256i u = _mm256_castps_si256(*in[h]);
    const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                           _mm256_set1_epi32(0x7f800000));
    rounded[h] = rounded_bits8(u);
    // the remainder's low 16 bits (+32768, the upper tie, wraps to -32768); 0 for NaN
    rems[h] = _mm256_andnot_si256(nan, _mm256_and_si256(_mm256_sub_epi32(u, _mm256_slli_epi32(rounded[h], 16)),
                                                          _mm256_set1_epi32(0xffff)));
    const __m256i tie = _mm256_cmpeq_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0xffff)),
                                           _mm256_set1_epi32(0x8000));
    any_tie = _mm256_or_si256(any_tie, _mm256_andnot_si256(nan, tie));
  }
  // packus works per 128-bit lane: [lo 0-3, hi 0-3, lo 4-7, hi 4-7] -> reorder the 64-bit quarters
  const __m256i w16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(rounded[0], rounded[1]), 0xd8);
  const __m256i r16 = _mm256_permute4x64_epi64(_mm256_packus_epi32(rems[0], rems[1]), 0xd8);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(weight), w16);
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(rest), r16);
  return !_mm256_testz_si256(any_tie, any_tie);
}
#endif

// The join and split below run as branch-free loops the compiler vectorizes; the tie words are
// touched in a second, scalar pass only for the rare elements whose remainder is -32768.
template <typename P, bool Remainder>
inline void load_param(const P* param, const MasterRemainder& r, int64_t i, int64_t count, FloatVec& lo,
                       FloatVec& hi) {
  if constexpr (!Remainder) {
    load_n(param + i, count, lo, hi);
  } else {
    const uint16_t* weight = reinterpret_cast<const uint16_t*>(param + i);
    const int16_t* rest = r.remainder + i;
#if defined(CPU_CAPABILITY_AVX2)
    if (count == kStep && !join16(weight, rest, lo, hi)) return;
#endif
    alignas(64) uint32_t bits[kStep] = {};
    int any_tie = 0;
    const auto join = [&](int64_t k) {
      bits[k] = bf16_bits::joined(weight[k], rest[k], false);
      any_tie |= rest[k] == -32768;
    };
    if (count == kStep) {  // a constant trip count: the compiler vectorizes this loop
      for (int64_t k = 0; k < kStep; ++k) join(k);
    } else {
      for (int64_t k = 0; k < count; ++k) join(k);
    }
    if (any_tie) {
      for (int64_t k = 0; k < count; ++k) {
        if (rest[k] == -32768) bits[k] = bf16_bits::joined(weight[k], rest[k], tie_bit(r.ties, r.base + i + k));
      }
    }
    alignas(64) float values[kStep];
    std::memcpy(values, bits, sizeof values);
    lo = FloatVec::loadu(values);
    hi = FloatVec::loadu(values + FloatVec::size());
  }
}

template <typename P, bool Remainder>
inline void store_param(P* param, const MasterRemainder& r, int64_t i, int64_t count, const FloatVec& lo,
                        const FloatVec& hi) {
  if constexpr (!Remainder) {
    store_n(param + i, count, lo, hi);
  } else {
    uint16_t* weight = reinterpret_cast<uint16_t*>(param + i);
    int16_t* rest = r.remainder + i;
#if defined(CPU_CAPABILITY_AVX2)
    if (count == kStep && !split16(lo, hi, weight, rest)) return;
#endif
    alignas(64) uint32_t bits[kStep];
    float_bits(lo, hi, bits);
    alignas(64) uint16_t new_weight[kStep];
    alignas(64) int16_t new_rest[kStep];
    int any_tie = 0;
    // weight = the rounding (NaN: c10's bfloat16 NaN, remainder 0), remainder = the rest, in
    // [-32768, 32768]; branch-free, over the whole padded buffer
    for (int64_t k = 0; k < kStep; ++k) {
      const uint32_t u = bits[k];
      const uint32_t nan = (u & 0x7fffffffu) > 0x7f800000u;
      const uint32_t rounded = bf16_bits::rounded(u);
      const uint32_t rem = u - (rounded << 16);  // in [-32768, 32768] as int32
      new_weight[k] = static_cast<uint16_t>(rounded);
      // +32768 (the upper tie) wraps to -32768 in int16: the tie bit says which
      new_rest[k] = static_cast<int16_t>(static_cast<uint16_t>(nan ? 0u : rem));
      any_tie |= static_cast<int>(!nan & ((u & 0xffffu) == 0x8000u));
    }
    if (count == kStep) {  // a constant size: inlined vector moves, no call
      std::memcpy(weight, new_weight, sizeof new_weight);
      std::memcpy(rest, new_rest, sizeof new_rest);
    } else {
      std::memcpy(weight, new_weight, count * sizeof(uint16_t));
      std::memcpy(rest, new_rest, count * sizeof(int16_t));
    }
    if (any_tie) {
      for (int64_t k = 0; k < count; ++k) {
        if (rest[k] == -32768) set_tie_bit(r.ties, r.base + i + k, (bits[k] & 0xffffu) == 0x8000u &&
                                                                         ((bits[k] >> 16) & 1u) == 0u);
      }
    }
  }
}

// The join and the split alone, for checkpoints and state_dict() (ops.join_masters /
// split_masters_): the optimizers' own load_param / store_param over a range.
inline void join_masters(const c10::BFloat16* weight, const MasterRemainder& r, float* master, int64_t n) {
  for_each_step(n, [&](int64_t i, int64_t count) {
    FloatVec lo, hi;
    load_param<c10::BFloat16, true>(weight, r, i, count, lo, hi);
    store_n(master + i, count, lo, hi);
  });
}

inline void split_masters(const float* master, c10::BFloat16* weight, const MasterRemainder& r, int64_t n) {
  for_each_step(n, [&](int64_t i, int64_t count) {
    FloatVec lo, hi;
    load_n(master + i, count, lo, hi);
    store_param<c10::BFloat16, true>(weight, r, i, count, lo, hi);
  });
}

// -- stochastic rounding of bfloat16 moments (why and how: master_bits.h) -----------------------

#if defined(CPU_CAPABILITY_AVX2)
inline __m256i mix_bits8(__m256i x) {
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(0x7feb352d));
  x = _mm256_xor_si256(x, _mm256_srli_epi32(x, 15));
  x = _mm256_mullo_epi32(x, _mm256_set1_epi32(static_cast<int32_t>(0x846ca68bu)));
  return _mm256_xor_si256(x, _mm256_srli_epi32(x, 16));
}

// bf16_bits::stochastic of 16 values whose indices' low halves are low, low + 1, ..., in registers.
inline void stochastic16(const FloatVec& lo, const FloatVec& hi, uint32_t key, uint32_t low, uint16_t* dst) {
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  __m256i out[2];
  const FloatVec* in[2] = {&lo, &hi};
  for (int h = 0; h < 2; ++h) {
    const __m256i index = _mm256_add_epi32(_mm256_set1_epi32(static_cast<int32_t>(low + 8u * h)), lanes);
    const __m256i noise = _mm256_and_si256(mix_bits8(_mm256_xor_si256(index, _mm256_set1_epi32(static_cast<int32_t>(key)))),
                                           _mm256_set1_epi32(0xffff));
    const __m256i u = _mm256_castps_si256(*in[h]);
    const __m256i finite = _mm256_cmpgt_epi32(_mm256_set1_epi32(0x7f800000),
                                              _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)));
    out[h] = _mm256_blendv_epi8(rounded_bits8(u), _mm256_srli_epi32(_mm256_add_epi32(u, noise), 16), finite);
  }
  _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst),
                      _mm256_permute4x64_epi64(_mm256_packus_epi32(out[0], out[1]), 0xd8));
}
#endif

// Stores optimizer state: rounded to nearest even, or (bfloat16, `key` given) stochastically.
template <typename S>
inline void store_state(S* dst, int64_t i, int64_t count, const FloatVec& lo, const FloatVec& hi, bool stochastic,
                        uint32_t key, int64_t base) {
  if constexpr (std::is_same_v<S, c10::BFloat16>) {
    if (stochastic) {
#if defined(CPU_CAPABILITY_AVX2)
      const int64_t start = base + i;
      if (count == kStep && static_cast<uint32_t>(start) <= UINT32_MAX - kStep) {
        stochastic16(lo, hi, key ^ static_cast<uint32_t>(start >> 32), static_cast<uint32_t>(start),
                     reinterpret_cast<uint16_t*>(dst + i));
        return;
      }
#endif
      alignas(64) uint32_t bits[kStep];
      float_bits(lo, hi, bits);
      alignas(64) uint16_t out[kStep];
      const int64_t first = base + i;
      const uint32_t low = static_cast<uint32_t>(first);
      if (low <= UINT32_MAX - kStep) {  // the index's high half is the same for the whole step: 32-bit lanes
        const uint32_t high_key = key ^ static_cast<uint32_t>(first >> 32);
        for (uint32_t k = 0; k < kStep; ++k) out[k] = bf16_bits::stochastic(bits[k], high_key, low + k);
      } else {
        for (int64_t k = 0; k < kStep; ++k) out[k] = bf16_bits::stochastic_at(bits[k], key, first + k);
      }
      if (count == kStep) {  // a constant size: inlined vector moves, no call
        std::memcpy(reinterpret_cast<uint16_t*>(dst + i), out, sizeof out);
      } else {
        std::memcpy(reinterpret_cast<uint16_t*>(dst + i), out, count * sizeof(uint16_t));
      }
      return;
    }
  }
  store_n(dst + i, count, lo, hi);
}

// Adam/AdamW of params of type P with state of type S (P, float32 or bfloat16), with
// torch.optim's fused kernels' order of operations; every value is computed in float and
// rounded once.  With Remainder (P = bfloat16), the param and its remainder are the FP32 master.
template <typename P, typename Grad, typename S, typename Model, bool Remainder>
void adam(const AdamParams& p, P* param, const MasterRemainder& r, const Grad* grad, S* exp_avg, S* exp_avg_sq,
          Model* model, int64_t n, int64_t base) {
  const uint32_t key_m = bf16_bits::rounding_key(p.seed, 1), key_v = bf16_bits::rounding_key(p.seed, 2);
  const FloatVec inv(p.inv_scale), wd(p.weight_decay), decay(p.decay);
  const FloatVec beta2(p.beta2), one_minus_beta2(p.one_minus_beta2);
  const FloatVec eps(p.eps), neg_step_size(-p.step_size), bc2_sqrt(p.bias_correction2_sqrt);
  const bool coupled_decay = p.weight_decay != 0.0f && !p.decoupled_weight_decay;
  const bool decoupled_decay = p.weight_decay != 0.0f && p.decoupled_weight_decay;
  for_each_step(n, [&](int64_t i, int64_t count) {
    FloatVec g[2], w[2], m[2], v[2];
    load_n(grad + i, count, g[0], g[1]);
    load_param<P, Remainder>(param, r, i, count, w[0], w[1]);
    load_n(exp_avg + i, count, m[0], m[1]);
    load_n(exp_avg_sq + i, count, v[0], v[1]);
    for (int h = 0; h < 2; ++h) {
      g[h] = g[h] * inv;
      if (coupled_decay) g[h] = g[h] + w[h] * wd;
      if (decoupled_decay) w[h] = w[h] * decay;
      m[h] = lerp(m[h], g[h], p.one_minus_beta1);
      v[h] = v[h] * beta2 + one_minus_beta2 * g[h] * g[h];
      const FloatVec denom = v[h].sqrt() / bc2_sqrt + eps;
      w[h] = w[h] + neg_step_size * m[h] / denom;
    }
    store_param<P, Remainder>(param, r, i, count, w[0], w[1]);
    store_state(exp_avg, i, count, m[0], m[1], p.stochastic_state, key_m, base);
    store_state(exp_avg_sq, i, count, v[0], v[1], p.stochastic_state, key_v, base);
    if constexpr (!std::is_same_v<Model, void>) store_n(model + i, count, w[0], w[1]);
  });
}

// SGD with momentum, dampening, nesterov and weight decay, as torch.optim.SGD computes it.
template <typename P, typename Grad, typename S, typename Model, bool Remainder>
void sgd(const SgdParams& p, P* param, const MasterRemainder& r, const Grad* grad, S* buffer, Model* model,
         int64_t n) {
  const FloatVec inv(p.inv_scale), wd(p.weight_decay), momentum(p.momentum);
  const FloatVec one_minus_dampening(p.one_minus_dampening), neg_lr(-p.lr);
  for_each_step(n, [&](int64_t i, int64_t count) {
    FloatVec g[2], w[2], b[2];
    load_n(grad + i, count, g[0], g[1]);
    load_param<P, Remainder>(param, r, i, count, w[0], w[1]);
    if (buffer != nullptr && !p.new_buffer) load_n(buffer + i, count, b[0], b[1]);
    for (int h = 0; h < 2; ++h) {
      g[h] = g[h] * inv;
      if (p.weight_decay != 0.0f) g[h] = at::vec::fmadd(w[h], wd, g[h]);
      if (buffer != nullptr) {
        b[h] = p.new_buffer ? g[h] : at::vec::fmadd(one_minus_dampening, g[h], b[h] * momentum);
        g[h] = p.nesterov ? at::vec::fmadd(b[h], momentum, g[h]) : b[h];
      }
      w[h] = at::vec::fmadd(g[h], neg_lr, w[h]);
    }
    store_param<P, Remainder>(param, r, i, count, w[0], w[1]);
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

// The optimizers' type combinations, fn(P* tag, G tag, S* tag, M* tag, Remainder): float
// params with state float32 or bfloat16 and an optional 16-bit model copy; float16 params with
// float16 or float32 state; bfloat16 params with bfloat16 or float32 state, with or without
// remainders; 16-bit params have no model copy.  M = void for no model.
template <typename Fn>
inline void with_optimizer_types(c10::ScalarType param_type, c10::ScalarType grad_type, c10::ScalarType state_type,
                                 c10::ScalarType model_type, bool remainder, const Fn& fn) {
  constexpr auto no_model = static_cast<void*>(nullptr);
  with_type(grad_type, [&](auto grad_tag) {
    auto with_state = [&](auto* param_tag, auto* narrow_state_tag, auto&& go) {
      using P = std::remove_pointer_t<decltype(param_tag)>;
      using Narrow = std::remove_pointer_t<decltype(narrow_state_tag)>;
      if (state_type == c10::CppTypeToScalarType<P>::value) {
        go(static_cast<P*>(nullptr));
      } else if (state_type == c10::ScalarType::Float) {
        go(static_cast<float*>(nullptr));
      } else {
        go(static_cast<Narrow*>(nullptr));
      }
    };
    if (param_type == c10::ScalarType::Float) {
      with_state(static_cast<float*>(nullptr), static_cast<c10::BFloat16*>(nullptr), [&](auto* state_tag) {
        with_model_type(model_type, [&](auto* model_tag) {
          fn(static_cast<float*>(nullptr), grad_tag, state_tag, model_tag, std::false_type{});
        });
      });
    } else if (param_type == c10::ScalarType::Half) {
      with_state(static_cast<c10::Half*>(nullptr), static_cast<c10::Half*>(nullptr), [&](auto* state_tag) {
        fn(static_cast<c10::Half*>(nullptr), grad_tag, state_tag, no_model, std::false_type{});
      });
    } else {
      with_state(static_cast<c10::BFloat16*>(nullptr), static_cast<c10::BFloat16*>(nullptr), [&](auto* state_tag) {
        if (remainder) {
          fn(static_cast<c10::BFloat16*>(nullptr), grad_tag, state_tag, no_model, std::true_type{});
        } else {
          fn(static_cast<c10::BFloat16*>(nullptr), grad_tag, state_tag, no_model, std::false_type{});
        }
      });
    }
  });
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
      [](c10::ScalarType model_type, const void* model, float* master, int64_t n) {
        with_type(model_type, [&](auto m) { adopt(static_cast<const decltype(m)*>(model), master, n); });
      },
      [](int64_t element_size, const void* x, int64_t n, int64_t base) {
        return element_size == 2 ? fingerprint(static_cast<const uint16_t*>(x), n, base)
                                 : fingerprint(static_cast<const uint32_t*>(x), n, base);
      },
      [](c10::ScalarType in, const void* x, int64_t n) {
        return with_type(in, [&](auto i) {
          return sum_of_squares(static_cast<const decltype(i)*>(x), n);
        });
      },
      [](const AdamParams& p, const OptimizerTypes& types, void* param, const MasterRemainder& r,
         const void* grad, void* exp_avg, void* exp_avg_sq, void* model, int64_t n, int64_t base) {
        with_optimizer_types(types.param, types.grad, types.state, types.model, r.remainder != nullptr,
                             [&](auto* param_tag, auto grad_tag, auto* state_tag, auto* model_tag, auto remainder) {
          using P = std::remove_pointer_t<decltype(param_tag)>;
          using G = decltype(grad_tag);
          using S = std::remove_pointer_t<decltype(state_tag)>;
          using M = std::remove_pointer_t<decltype(model_tag)>;
          adam<P, G, S, M, decltype(remainder)::value>(p, static_cast<P*>(param), r, static_cast<const G*>(grad),
                                                       static_cast<S*>(exp_avg), static_cast<S*>(exp_avg_sq),
                                                       static_cast<M*>(model), n, base);
        });
      },
      [](const SgdParams& p, const OptimizerTypes& types, void* param, const MasterRemainder& r, const void* grad,
         void* buffer, void* model, int64_t n) {
        with_optimizer_types(types.param, types.grad, types.state, types.model, r.remainder != nullptr,
                             [&](auto* param_tag, auto grad_tag, auto* state_tag, auto* model_tag, auto remainder) {
          using P = std::remove_pointer_t<decltype(param_tag)>;
          using G = decltype(grad_tag);
          using S = std::remove_pointer_t<decltype(state_tag)>;
          using M = std::remove_pointer_t<decltype(model_tag)>;
          sgd<P, G, S, M, decltype(remainder)::value>(p, static_cast<P*>(param), r, static_cast<const G*>(grad),
                                                      static_cast<S*>(buffer), static_cast<M*>(model), n);
        });
      },
      [](const void* weight, const MasterRemainder& r, float* master, int64_t n) {
        join_masters(static_cast<const c10::BFloat16*>(weight), r, master, n);
      },
      [](const float* master, void* weight, const MasterRemainder& r, int64_t n) {
        split_masters(master, static_cast<c10::BFloat16*>(weight), r, n);
      },
  };
  return kernels;
}

}  // namespace CPU_CAPABILITY
}  // namespace ampinit::cpu

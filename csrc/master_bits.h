// The bit formats that the CPU and CUDA kernels (and ampinit/_fallback.py) must agree on bit for
// bit, written once for both: remainder masters, the stochastic rounding of bfloat16 moments and
// the terms of ops.fingerprint.
//
// Remainder masters: an FP32 master kept as its bfloat16 rounding (the model's weight) plus an
// int16 remainder: bits(master) = (bits(weight) << 16) + remainder (+ 0x10000 when the tie bit
// is set), mod 2^32.  A bfloat16 value of even mantissa is the rounding of 65537 floats (both
// ties included), one more than 16 bits tell apart: the tie bit (bit j % 32 of word j / 32, j the
// element's index) marks the upper tie, remainder +32768, stored as -32768.  The kernels read and
// write it only where the remainder is -32768.  A master beyond bfloat16's range rounds to an inf
// weight, which joins to that inf (an inf written into the weight must stay inf).
//
// Stochastic rounding: rounded to nearest, a bfloat16 exp_avg_sq never decays with beta2 =
// 0.999 (0.999 * v is within half an ulp of v and rounds back to v).  16 bits of noise added
// below the kept bits, then truncation, round up with probability (dropped bits) / 2^16:
// unbiased.  The noise is a hash of (step, moment, element index: its position in the param's
// memory order, DenseRows lays the row out so), so every backend, chunking and resume rounds the
// same element the same way.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define AMPINIT_BITS_FN __host__ __device__ __forceinline__
#else
#define AMPINIT_BITS_FN inline
#endif

namespace ampinit::bf16_bits {

// The bfloat16 rounding (nearest even; c10's CPU NaN, 0x7fc0, for NaN) of a float's bits.  NaN
// payloads are not part of any contract: CUDA's own float -> bfloat16 conversion (the plain
// stores of the other kernels) writes 0x7fff, and every NaN is treated alike.
AMPINIT_BITS_FN uint32_t rounded(uint32_t bits) {
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  return nan ? 0x7fc0u : (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
}

// bits(weight) << 16, plus the remainder where weight is still the rounding of the sum and is
// finite: a weight written from outside since the last split (zeroed, clamped, pruned, set to
// inf) may not be, and a kept remainder could carry it across zero into NaN, or out of inf.
// The master is then the weight itself.
AMPINIT_BITS_FN uint32_t joined(uint16_t weight, int16_t remainder, bool tie) {
  const uint32_t high = static_cast<uint32_t>(weight) << 16;
  const uint32_t sum = high + static_cast<uint32_t>(static_cast<int32_t>(remainder)) + (tie ? 0x10000u : 0u);
  // an inf (or NaN) weight is its own master: inf - 1 would round back to inf, yet be finite
  const bool special = (weight & 0x7fffu) >= 0x7f80u;
  return !special && rounded(sum) == weight ? sum : high;
}

// The split of a master's bits: weight = its rounding, remainder = the rest in [-32768, 32768]
// (+32768, the upper tie, stored as -32768 with the tie bit set); NaN: c10's NaN, remainder 0.
AMPINIT_BITS_FN void split(uint32_t bits, uint16_t& weight, int16_t& remainder, bool& tie) {
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;
  const uint32_t high = rounded(bits);
  const int32_t rest = nan ? 0 : static_cast<int32_t>(bits - (high << 16));
  weight = static_cast<uint16_t>(high);
  tie = rest == 32768;
  remainder = static_cast<int16_t>(tie ? -32768 : rest);
}

// Chris Wellons' lowbias32 integer hash.
AMPINIT_BITS_FN uint32_t mix(uint32_t x) {
  x ^= x >> 16;
  x *= 0x7feb352du;
  x ^= x >> 15;
  x *= 0x846ca68bu;
  x ^= x >> 16;
  return x;
}

// The key of one moment (salt 1: exp_avg, 2: exp_avg_sq) at one step (the step count after it).
AMPINIT_BITS_FN uint32_t rounding_key(uint32_t seed, uint32_t salt) { return seed * 0x9e3779b9u + salt * 0x85ebca6bu; }

// float bits -> bfloat16 bits: stochastically for finite values, to nearest even for inf/NaN
// (noise could carry inf into NaN).  `key` holds the high half of the element's index already
// (see stochastic_at), `low` is its low half.
AMPINIT_BITS_FN uint16_t stochastic(uint32_t bits, uint32_t key, uint32_t low) {
  const uint32_t noise = mix(low ^ key) & 0xffffu;
  const bool finite = (bits & 0x7fffffffu) < 0x7f800000u;
  return static_cast<uint16_t>(finite ? (bits + noise) >> 16 : rounded(bits));
}

AMPINIT_BITS_FN uint16_t stochastic_at(uint32_t bits, uint32_t key, int64_t index) {
  return stochastic(bits, key ^ static_cast<uint32_t>(index >> 32), static_cast<uint32_t>(index));
}

}  // namespace ampinit::bf16_bits

namespace ampinit::fingerprint_bits {

// One element's term of ops.fingerprint (the sum of the terms mod 2^32): for each index a
// bijection of the element's bits, so one changed element always changes the sum, and not
// linear in them, so changing every element by one amount does not cancel out (in a sum of
// (bits + 1) * (2 * index + 1), halving every weight of a 1024 x 1024 tensor changes it by a
// multiple of n^2 = 2^40: not at all).  Indices past 2^32 wrap.
AMPINIT_BITS_FN uint32_t term(uint32_t bits, uint32_t index) { return bf16_bits::mix(bits ^ (index * 0x9e3779b9u)); }

}  // namespace ampinit::fingerprint_bits

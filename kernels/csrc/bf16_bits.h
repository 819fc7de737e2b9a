// bfloat16 as the high half of a float32's bits, one value or GCC/Clang vectors of any lane count: widened
// by a shift; narrowed by rounding to nearest even, as torch rounds (a NaN becomes the quiet NaN
// 0x7FC0, c10's scalar one). Shared by the fused elementwise ops, the LoRA kernels and the bfloat16 GEMMs.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <utility>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#if defined(__AVX512BF16__) && defined(__AVX512DQ__)
#define LORASERVE_BF16_CONVERT 1
#endif

namespace loraserve_bf16 {

// One bfloat16 (its bits) as a float.
inline float widened(uint16_t half) {
  const uint32_t bits = static_cast<uint32_t>(half) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// The bits of the bfloat16 nearest to v (branch-free, so loops of it vectorize).
inline uint16_t rounded_bits(float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const uint32_t rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return (v != v) ? static_cast<uint16_t>(0x7FC0) : static_cast<uint16_t>(rounded);
}

// N bfloat16 (their bits, a vector U16) as a vector F of N floats.
template <typename F, typename U16, typename U32>
inline F widened_words(U16 half) {
#if defined(__AVX512F__)
  if constexpr (sizeof(U16) == 32 && sizeof(F) == 64) {  // one VPMOVZXWD (GCC 12 splits the generic one in four)
    __m256i words;
    std::memcpy(&words, &half, sizeof(words));
    const __m512i bits = _mm512_slli_epi32(_mm512_cvtepu16_epi32(words), 16);
    F out;
    std::memcpy(&out, &bits, sizeof(out));
    return out;
  }
#endif
  const U32 bits = __builtin_convertvector(half, U32) << 16;
  F out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// The N bfloat16 values at p as a vector F of N floats (U16, U32: vectors of N uint16 / uint32).
template <typename F, typename U16, typename U32>
inline F load_widened(const void* p) {
  U16 half;
  std::memcpy(&half, p, sizeof(half));
  return widened_words<F, U16, U32>(half);
}

// The bfloat16 nearest to each float of v, as its 16 bits in the low half of each lane of U32.
template <typename U32, typename F>
inline U32 rounded_bits(F v) {
  U32 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const U32 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return (v != v) ? U32{} + 0x7FC0u : rounded;
}

// The bfloat16 nearest to each float of v, as a vector U16 of its bits: rounded_bits narrowed. For
// 16 lanes where the CPU has AVX512-BF16 (the only width its callers use there), one VCVTNEPS2BF16
// (round to nearest even, as here) does it, unless a lane is a NaN (which it keeps signed) or a
// float32 denormal (which it flushes to zero): then the integer rounding. The same bits either way.
template <typename U16, typename U32, typename F>
inline U16 rounded_words(F v) {
#if defined(LORASERVE_BF16_CONVERT)
  if constexpr (sizeof(F) == 64 && sizeof(U16) == 32) {
    __m512 x;
    std::memcpy(&x, &v, sizeof(x));
    if (_mm512_fpclass_ps_mask(x, 0x01 | 0x20 | 0x80) == 0) {  // VFPCLASSPS: quiet NaN, denormal, signalling NaN
      const __m256bh h = _mm512_cvtneps_pbh(x);
      U16 out;
      std::memcpy(&out, &h, sizeof(out));
      return out;
    }
  }
#endif
  return __builtin_convertvector(rounded_bits<U32>(v), U16);
}


// ---- 2N bfloat16 values as two vectors of N floats, each word unpacked under a zero word: one
// shuffle a vector, which leaves the FMA ports to the arithmetic (a zero extension and a shift
// take three ops there). Within each 8 words (128 bits), words 0-3 land in `first` and 4-7 in
// `second`; work done lane by lane in that order needs no shuffle back, and store_packed writes
// such a pair back in place. F: a vector of N floats; W: a vector of 2N uint16. ----
namespace detail {
// Word m of `first` (`second` where high) from (zero, the 2n words loaded): zero low halves.
constexpr int unpacked_word(int m, int n, bool high) {
  const int lane = m / 2;
  return m % 2 == 0 ? 0 : 2 * n + lane / 4 * 8 + lane % 4 + (high ? 4 : 0);
}
// Word m of the row written back, from (first's words, second's words): each lane's low half.
constexpr int packed_word(int m, int n) {
  const int block = m / 8, within = m % 8;
  return within < 4 ? 2 * (4 * block + within) : 2 * n + 2 * (4 * block + within - 4);
}
template <typename F, typename W, size_t... M>
inline void load_unpacked(const void* p, F& first, F& second, std::index_sequence<M...>) {
  constexpr int n = sizeof(F) / sizeof(float);
  W words;
  std::memcpy(&words, p, sizeof(words));
  const W zero = {};
  const W lo = __builtin_shufflevector(zero, words, unpacked_word(M, n, false)...);
  const W hi = __builtin_shufflevector(zero, words, unpacked_word(M, n, true)...);
  std::memcpy(&first, &lo, sizeof(first));
  std::memcpy(&second, &hi, sizeof(second));
}
template <typename F, typename U32, typename W, size_t... M>
inline void store_packed(void* p, F first, F second, std::index_sequence<M...>) {
  constexpr int n = sizeof(F) / sizeof(float);
  const U32 r0 = rounded_bits<U32>(first), r1 = rounded_bits<U32>(second);
  W w0, w1;
  std::memcpy(&w0, &r0, sizeof(w0));
  std::memcpy(&w1, &r1, sizeof(w1));
  const W packed = __builtin_shufflevector(w0, w1, packed_word(M, n)...);
  std::memcpy(p, &packed, sizeof(packed));
}
}  // namespace detail

// The 2N bfloat16 at p as (first, second) in the unpacked order above.
template <typename F, typename W>
inline void load_unpacked(const void* p, F& first, F& second) {
  static_assert(sizeof(W) == sizeof(F) && sizeof(F) % 16 == 0, "W: 2N words for N floats, whole 128-bit blocks");
  detail::load_unpacked<F, W>(p, first, second, std::make_index_sequence<sizeof(W) / 2>{});
}
// p[0:2N] = (first, second), given in the unpacked order, each rounded once to bfloat16.
template <typename F, typename U32, typename W>
inline void store_packed(void* p, F first, F second) {
  detail::store_packed<F, U32, W>(p, first, second, std::make_index_sequence<sizeof(W) / 2>{});
}

}  // namespace loraserve_bf16

// Segmented LoRA, short segments over a bfloat16 pool with a bfloat16 x on CPUs with AVX512-BF16:
// the shrink as pair dots (vdpbf16ps: per instruction, two terms of 8 tokens' dots; A's pairs
// broadcast straight from its rows, neither widened), and the dispatch between them and the float
// loops of lora_tiles.h (included through lora_tiled.h only; internal to lora_segments.cpp).
// Measured in benchmarks/RESULTS.md (2026-12-06 15:48).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "lora_tiles.h"

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
#include <immintrin.h>
#endif

namespace loraserve_lora {

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// Whether a bfloat16 x over bfloat16 weights is shrunk by pair dots (vdpbf16ps): each instruction
// takes two terms of 8 tokens' dots, and A's pairs are broadcast straight from its rows.
constexpr bool kPairDots = true;
#else
constexpr bool kPairDots = false;
#endif

// xp[(p * 8 + j) * 2 + h] = x[j, 2 * p + h] (bfloat16 bits) for the tb <= 8 rows of x (stride
// `in`, even); lanes past tb are zero: transpose_tokens' shuffles on 32-bit words (the pairs).
inline void transpose_pairs(const bf16_t* x, int64_t in, int tb, bf16_t* xp) {
  const int64_t pairs = in / 2;
  const int64_t blocked = pairs / 8 * 8;
  for (int64_t p = 0; p < blocked; p += 8) {
    f32x8 r[8];
    for (int j = 0; j < 8; ++j) r[j] = j < tb ? load8(reinterpret_cast<const float*>(x + j * in) + p) : f32x8{};
    transpose8_store(r, reinterpret_cast<float*>(xp) + p * 8);
  }
  if (blocked == pairs) return;
  std::fill(xp + blocked * 16, xp + pairs * 16, bf16_t{0});
  for (int j = 0; j < tb; ++j) {
    for (int64_t p = blocked; p < pairs; ++p) std::memcpy(xp + (p * 8 + j) * 2, x + j * in + 2 * p, 4);
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
// shrink_tile for a bfloat16 x (transposed in pairs: transpose_pairs, [NB, in / 2, 8, 2]) and
// bfloat16 A: vt[i * ld_t + j] = dot(x[j], a_i), summed in chunks of kShrinkChunk terms.
template <int R, int NB>
void shrink_tile_pairs(const bf16_t* xp, int64_t in, const bf16_t* const* a, float* vt, int64_t ld_t, int tb_last,
                       const bf16_t* const* next) {
  constexpr int64_t kLine = 64 / sizeof(bf16_t);
  __m256 acc[NB][R];
  for (int j = 0; j < NB; ++j)
    for (int i = 0; i < R; ++i) acc[j][i] = _mm256_setzero_ps();
  for (int64_t k0 = 0; k0 < in; k0 += kShrinkChunk) {
    const int64_t k1 = std::min(in, k0 + kShrinkChunk);
    __m256 part[NB][R];
    for (int j = 0; j < NB; ++j)
      for (int i = 0; i < R; ++i) part[j][i] = _mm256_setzero_ps();
    for (int64_t k = k0; k < k1; k += 2) {
      if (next != nullptr && k % kLine == 0) {
        for (int i = 0; i < R; ++i) __builtin_prefetch(next[i] + k, 0, 2);
      }
      const int64_t p = k / 2;
      for (int j = 0; j < NB; ++j) {
        const __m256bh xv = (__m256bh)_mm256_loadu_si256(reinterpret_cast<const __m256i*>(xp + j * 2 * in * kShrinkBlock + p * 16));
        for (int i = 0; i < R; ++i) {
          int32_t pair;
          std::memcpy(&pair, a[i] + k, sizeof(pair));
          part[j][i] = _mm256_dpbf16_ps(part[j][i], (__m256bh)_mm256_set1_epi32(pair), xv);
        }
      }
    }
    for (int j = 0; j < NB; ++j)
      for (int i = 0; i < R; ++i) acc[j][i] = _mm256_add_ps(acc[j][i], part[j][i]);
  }
  for (int j = 0; j < NB; ++j) {
    const int tb = j == NB - 1 ? tb_last : kShrinkBlock;
    for (int i = 0; i < R; ++i) {
      store_lanes(vt + i * ld_t + j * kShrinkBlock, static_cast<f32x8>(acc[j][i]), tb);
    }
  }
}
#endif

// vp[p * TB + j] = the bfloat16 bits of v[2p, j] (low half) and v[2p + 1, j] (high half; 0 past
// `rank`), each rounded to nearest even, for TB tokens of v (vt[r * ld_t + j]): v as PairRows reads it.
template <int TB>
void pair_up(const float* vt, int64_t ld_t, int64_t rank, uint32_t* vp) {
  for (int64_t r = 0; r < rank; r += 2) {
    for (int j = 0; j < TB; ++j) {
      const uint32_t high = r + 1 < rank ? loraserve_bf16::rounded_bits(vt[(r + 1) * ld_t + j]) : 0u;
      vp[r / 2 * TB + j] = (high << 16) | loraserve_bf16::rounded_bits(vt[r * ld_t + j]);
    }
  }
}

#if defined(__AVX512BF16__) && defined(__AVX512VL__)
static_assert(kLanes == 16, "pair dots take 16 output columns per vector");

// The expand's rows by pair dots (expand_tile's `rows`, bfloat16 weights and x): two rank rows a
// step, v rounded to bfloat16 (as PEFT's and vLLM's bfloat16 LoRA round it) and paired by pair_up,
// B's rows b_r, b_{r+1} interleaved into pairs in registers (vpunpck{l,h}wd leave their columns in
// load_columns' order), each instruction adding both rows' exact products to float32 sums.
template <int TB>
struct PairRows {
  static constexpr int64_t kRowsPerStep = 2;
  const uint32_t* vp;  // pair_up's
  const bf16_t* const* b;

  template <int N>
  void sum_columns(vecf (&acc)[N][2], int64_t r0, int64_t r1, int64_t c, bool prefetch) const {
    static_assert(N == TB, "the tile's tokens are the pairs' tokens");
    for (int64_t r = r0; r < r1; r += 2) {
      const bool two = r + 1 < r1;
      if (prefetch) {
        for (int64_t i = r; i < r + (two ? 2 : 1); ++i) {
          __builtin_prefetch(b[i] + c + kExpandCols, 0, 2);
          __builtin_prefetch(b[i] + c + kExpandCols + kLanes, 0, 2);
        }
      }
      const __m512i first = _mm512_loadu_si512(b[r] + c);
      const __m512i second = two ? _mm512_loadu_si512(b[r + 1] + c) : _mm512_setzero_si512();
      const __m512bh low = (__m512bh)_mm512_unpacklo_epi16(first, second);
      const __m512bh high = (__m512bh)_mm512_unpackhi_epi16(first, second);
      const uint32_t* v = vp + r / 2 * TB;
      for (int j = 0; j < TB; ++j) {
        const __m512bh vj = (__m512bh)_mm512_set1_epi32(static_cast<int>(v[j]));
        acc[j][0] = (vecf)_mm512_dpbf16_ps((__m512)acc[j][0], vj, low);
        acc[j][1] = (vecf)_mm512_dpbf16_ps((__m512)acc[j][1], vj, high);
      }
    }
  }
  float sum_column(int j, int64_t r0, int64_t r1, int64_t c, float acc) const {
    for (int64_t r = r0; r < r1; r += 2) {
      const uint32_t v = vp[r / 2 * TB + j];
      if (r + 1 < r1) acc += loraserve_bf16::widened(static_cast<bf16_t>(v >> 16)) * widen(b[r + 1][c]);
      acc += loraserve_bf16::widened(static_cast<bf16_t>(v & 0xFFFFu)) * widen(b[r][c]);
    }
    return acc;
  }
};
#endif

// Whether a call over a pool of W with `in` inputs shrinks on pair dots (kPairDots: bfloat16 x and
// weights, an even number of inputs).
template <typename W>
bool pair_dots(int64_t in) {
  return std::is_same_v<W, bf16_t> && kPairDots && in % 2 == 0;
}

// One block of <= 8 tokens of x transposed into `xt` (a block's room of in * 8 floats): in pairs
// where pair_dots, else as floats.
template <typename W>
void transpose_block(const W* x, int64_t in, int tb, float* xt) {
  if constexpr (std::is_same_v<W, bf16_t>) {
    if (pair_dots<W>(in)) return transpose_pairs(x, in, tb, reinterpret_cast<bf16_t*>(xt));
  }
  transpose_tokens(x, in, tb, xt);
}

// shrink_tile, or shrink_tile_pairs on blocks that transpose_block left in pairs.
template <int R, int NB, typename W>
void shrink_dispatch(const float* xt, int64_t in, const W* const* a, float* vt, int64_t ld_t, int tb_last,
                     const W* const* next) {
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
  if constexpr (std::is_same_v<W, bf16_t>) {
    if (pair_dots<W>(in)) {
      return shrink_tile_pairs<R, NB>(reinterpret_cast<const bf16_t*>(xt), in, a, vt, ld_t, tb_last, next);
    }
  }
#endif
  shrink_tile<R, NB>(xt, in, a, vt, ld_t, tb_last, next);
}

}  // namespace loraserve_lora

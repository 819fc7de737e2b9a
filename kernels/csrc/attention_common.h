// Pieces of the decode-attention kernels (cpu_kernels.cpp's generic loops, decode_attention_tiled.h).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <c10/util/Exception.h>

#include "simd8.h"

namespace loraserve_attention {

// exp(x) for x <= 0 after Cephes' expf: with n = round(x / ln 2) and r = x - n ln 2 (ln 2 in two
// parts), exp(x) = 2^n * e^r, e^r by a degree-6 polynomial; about 1 ulp. Inputs below -87 give
// ~0. This is the part the scalar and the 8-lane version share (T: float or f32x8).
template <typename T>
inline T exp_of_remainder(T x, T n) {
  const T r = x - n * 0.693359375f + n * 2.12194440e-4f;
  T p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  return p * r * r + r + 1.0f;
}

// In a form the compiler vectorizes (the generic kernel's loops).
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return exp_of_remainder(x, n) * scale;
}

// All lanes at once (F: a float vector, I: the int32 vector of as many lanes; low = all -87,
// round = all 1.5 * 2^23: rounding to nearest by adding and subtracting it).
template <typename F, typename I>
inline F exp_lanes_nonpositive(F x, F low, F round) {
  x = x < low ? low : x;
  const F n = (x * 1.44269504088896341f + round) - round;
  const I bits = (__builtin_convertvector(n, I) + 127) << 23;
  F scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return exp_of_remainder(x, n) * scale;
}

inline loraserve_simd::f32x8 exp8_nonpositive(loraserve_simd::f32x8 x) {
  using loraserve_simd::splat8;
  return exp_lanes_nonpositive<loraserve_simd::f32x8, loraserve_simd::i32x8>(x, splat8(-87.0f), splat8(12582912.0f));
}

// Sequence `s`, whose context holds `context` tokens, must need no more blocks than its table row
// (`row`, `max_blocks` entries) has, and each page it reads must lie in the pool: a few integer
// compares per sequence, before any kernel reads a page.
inline void check_block_table(int64_t s, int64_t context, const int64_t* row, int64_t max_blocks, int64_t block_size,
                              int64_t num_pages) {
  const int64_t blocks = (context + block_size - 1) / block_size;
  TORCH_CHECK(context >= 0 && blocks <= max_blocks, "sequence ", s, " needs ", blocks, " blocks, its table has ",
              max_blocks);
  for (int64_t b = 0; b < blocks; ++b) {
    TORCH_CHECK(row[b] >= 0 && row[b] < num_pages, "sequence ", s, " block ", b, ": page ", row[b],
                " is outside the pool of ", num_pages);
  }
}

// A prefill work item: rows [row0, row0 + rows) of chunk `seq` (rows starts[seq] .. starts[seq + 1]
// of the query) for one KV head and the query heads of its group.
struct PrefillItem {
  int64_t seq, kv_head, row0, rows;
};

// Every chunk's rows in items of up to `item_rows`, per KV head.
inline std::vector<PrefillItem> prefill_items(const std::vector<int64_t>& starts, int64_t num_kv_heads,
                                              int64_t item_rows) {
  std::vector<PrefillItem> items;
  for (int64_t s = 0; s + 1 < static_cast<int64_t>(starts.size()); ++s)
    for (int64_t g = 0; g < num_kv_heads; ++g)
      for (int64_t r = 0; r < starts[s + 1] - starts[s]; r += item_rows)
        items.push_back({s, g, r, std::min(item_rows, starts[s + 1] - starts[s] - r)});
  return items;
}

// Pages are a few KB: the hardware prefetchers lose the stream at every page boundary, so each
// row of the next page is prefetched while the same row of this one is read.
inline void prefetch_row(const void* row, int64_t bytes) {
  const char* p = static_cast<const char*>(row);
  for (int64_t at = 0; at < bytes; at += 64) __builtin_prefetch(p + at);
}

// s[j] = exp(s[j] - max(s)) for j < n, in place; returns their sum (the softmax's denominator).
inline float exp_shifted_in_place(float* s, int64_t n) {
  float max_score = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : max_score)
  for (int64_t j = 0; j < n; ++j) max_score = std::max(max_score, s[j]);
  float sum = 0.f;
#pragma omp simd reduction(+ : sum)
  for (int64_t j = 0; j < n; ++j) {
    s[j] = exp_nonpositive(s[j] - max_score);
    sum += s[j];
  }
  return sum;
}

}  // namespace loraserve_attention

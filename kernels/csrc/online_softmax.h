// One page's online-softmax update, shared by the decode attention kernels of 8 and 16 lanes
// (decode_attention_tiled.h, decode_attention_wide.h); F is the float vector (f32x8 or f32x16),
// each helper below an overload per width. For each head h, with s_h the page's scores (rows past
// `rows` set to -inf first):
//   m'_h = max(m_h, max(s_h)),  c_h = exp(m_h - m'_h),  s_h <- exp(s_h - m'_h),  l_h <- l_h * c_h + sum(s_h)
// and m_h <- m'_h; the caller rescales its output accumulators by c_h. Vectorized across rows, and
// across heads for c_h (one head at a time, its max, exps and rescaling form a chain of dependent
// scalar steps that cost as much as the matmuls).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>

#include "attention_common.h"
#include "simd16.h"
#include "simd8.h"

namespace loraserve_attention {

using loraserve_simd::f32x16;
using loraserve_simd::f32x8;

inline f32x8 load_lanes(const float* p, f32x8) { return loraserve_simd::load8(p); }
inline f32x16 load_lanes(const float* p, f32x16) { return loraserve_simd::load16(p); }
inline void store_lanes(float* p, f32x8 v) { loraserve_simd::store8(p, v); }
inline void store_lanes(float* p, f32x16 v) { loraserve_simd::store16(p, v); }
inline f32x8 splat_lanes(float x, f32x8) { return loraserve_simd::splat8(x); }
inline f32x16 splat_lanes(float x, f32x16) { return loraserve_simd::splat16(x); }
inline f32x8 max_lanes(f32x8 a, f32x8 b) { return loraserve_simd::max8(a, b); }
inline f32x16 max_lanes(f32x16 a, f32x16 b) { return a > b ? a : b; }
inline float hmax_lanes(f32x8 v) { return loraserve_simd::hmax8(v); }
inline float hmax_lanes(f32x16 v) {
  float m = v[0];
  for (int i = 1; i < 16; ++i) m = m > v[i] ? m : v[i];
  return m;
}
inline float hsum_lanes(f32x8 v) { return loraserve_simd::hsum8(v); }
inline float hsum_lanes(f32x16 v) {
  float s = 0.f;
  for (int i = 0; i < 16; ++i) s += v[i];
  return s;
}
inline f32x8 exp_lanes(f32x8 x) { return exp8_nonpositive(x); }
inline f32x16 exp_lanes(f32x16 x) {
  using loraserve_simd::splat16;
  return exp_lanes_nonpositive<f32x16, loraserve_simd::i32x16>(x, splat16(-87.0f), splat16(12582912.0f));
}

// The update above for the num_heads heads of one page: scores [num_heads, block_size] (block_size
// a multiple of F's lanes), maxes m, new_maxes and corrections c padded to a multiple of F's lanes
// (padded_heads), sums l.
template <typename F>
inline void online_softmax_page(float* scores, int64_t num_heads, int64_t padded_heads, int64_t block_size,
                                int64_t rows, float* maxes, float* new_maxes, float* corrections, float* sums) {
  constexpr int64_t kLanes = sizeof(F) / sizeof(float);
  const int64_t num_vectors = block_size / kLanes;
  for (int64_t h = 0; h < num_heads; ++h) {
    float* s = scores + h * block_size;
    std::fill(s + rows, s + block_size, -std::numeric_limits<float>::infinity());  // past n
    F m = load_lanes(s, F{});
    for (int64_t v = 1; v < num_vectors; ++v) m = max_lanes(m, load_lanes(s + kLanes * v, F{}));
    new_maxes[h] = std::max(maxes[h], hmax_lanes(m));
  }
  for (int64_t h = 0; h < padded_heads; h += kLanes) {
    store_lanes(corrections + h, exp_lanes(load_lanes(maxes + h, F{}) - load_lanes(new_maxes + h, F{})));
    store_lanes(maxes + h, load_lanes(new_maxes + h, F{}));
  }
  for (int64_t h = 0; h < num_heads; ++h) {
    float* s = scores + h * block_size;
    const F shift = splat_lanes(new_maxes[h], F{});
    F total = splat_lanes(0.f, F{});
    for (int64_t v = 0; v < num_vectors; ++v) {
      const F p = exp_lanes(load_lanes(s + kLanes * v, F{}) - shift);  // past n: ~1e-38, below the sum's last bit
      store_lanes(s + kLanes * v, p);
      total += p;
    }
    sums[h] = sums[h] * corrections[h] + hsum_lanes(total);
  }
}

}  // namespace loraserve_attention

// 8-wide float vectors through GCC/Clang vector extensions: AVX2 (+FMA) under -march=native on
// x86, plain SSE or NEON pairs elsewhere. Shared by the register-tiled kernels.
#pragma once

#include <cstdint>
#include <cstring>

namespace loraserve_simd {

using f32x8 = float __attribute__((vector_size(32)));
using i32x8 = int32_t __attribute__((vector_size(32)));

inline f32x8 load8(const float* p) {
  f32x8 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store8(float* p, f32x8 v) { std::memcpy(p, &v, sizeof(v)); }
inline f32x8 splat8(float x) { return f32x8{x, x, x, x, x, x, x, x}; }
inline f32x8 max8(f32x8 a, f32x8 b) { return a > b ? a : b; }
inline float hmax8(f32x8 v) {
  float m = v[0];
  for (int i = 1; i < 8; ++i) m = m > v[i] ? m : v[i];
  return m;
}
inline float hsum8(f32x8 v) { return ((v[0] + v[1]) + (v[2] + v[3])) + ((v[4] + v[5]) + (v[6] + v[7])); }

#if defined(__clang__)
#define LORASERVE_SHUFFLE2(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define LORASERVE_SHUFFLE2(a, b, ...) __builtin_shuffle(a, b, i32x8{__VA_ARGS__})
#endif

// Per 128-bit half, the sums of adjacent pairs of a then b (what AVX's vhaddps computes):
// [a0+a1, a2+a3, b0+b1, b2+b3, a4+a5, a6+a7, b4+b5, b6+b7].
inline f32x8 pair_sums(f32x8 a, f32x8 b) {
  return LORASERVE_SHUFFLE2(a, b, 0, 2, 8, 10, 4, 6, 12, 14) + LORASERVE_SHUFFLE2(a, b, 1, 3, 9, 11, 5, 7, 13, 15);
}

// Lane i of the result is the sum of the 8 lanes of v[i] (eight horizontal sums at once).
inline f32x8 lane_sums(const f32x8* v) {
  const f32x8 low = pair_sums(pair_sums(v[0], v[1]), pair_sums(v[2], v[3]));   // v0..v3, halves apart
  const f32x8 high = pair_sums(pair_sums(v[4], v[5]), pair_sums(v[6], v[7]));  // v4..v7, halves apart
  return LORASERVE_SHUFFLE2(low, high, 0, 1, 2, 3, 8, 9, 10, 11) +
         LORASERVE_SHUFFLE2(low, high, 4, 5, 6, 7, 12, 13, 14, 15);
}

}  // namespace loraserve_simd

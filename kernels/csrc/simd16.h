// 16-wide float vectors through GCC/Clang vector extensions: one AVX-512 register under
// -march=native on such a CPU, register pairs or quadruples elsewhere. Shared by the kernels
// that tile 16 lanes (prefill attention, the AVX-512 panel GEMM).
#pragma once

#include <cstdint>
#include <cstring>

namespace loraserve_simd {

using f32x16 = float __attribute__((vector_size(64)));
using i32x16 = int32_t __attribute__((vector_size(64)));

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }
// A brace list of copies: one broadcast ("f32x16{} + x" would add 0 to x first, without fast-math).
inline f32x16 splat16(float x) { return f32x16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

}  // namespace loraserve_simd

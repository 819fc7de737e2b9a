// bfloat16 as the high half of a float32's bits, one value or GCC/Clang vectors of any lane count: widened
// by a shift; narrowed by rounding to nearest even, as torch rounds (a NaN becomes torch's quiet
// NaN, 0x7FC0). Shared by the fused elementwise ops and the LoRA kernels.
#pragma once

#include <cstdint>
#include <cstring>

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

// The N bfloat16 values at p as a vector F of N floats (U16, U32: vectors of N uint16 / uint32).
template <typename F, typename U16, typename U32>
inline F load_widened(const void* p) {
  U16 half;
  std::memcpy(&half, p, sizeof(half));
  const U32 bits = __builtin_convertvector(half, U32) << 16;
  F out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

// The bfloat16 nearest to each float of v, as its 16 bits in the low half of each lane of U32.
template <typename U32, typename F>
inline U32 rounded_bits(F v) {
  U32 bits;
  std::memcpy(&bits, &v, sizeof(bits));
  const U32 rounded = (bits + 0x7FFFu + ((bits >> 16) & 1u)) >> 16;
  return (v != v) ? U32{} + 0x7FC0u : rounded;
}

}  // namespace loraserve_bf16

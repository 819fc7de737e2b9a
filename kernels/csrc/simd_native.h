// The float vector the build's target runs in one register: 16 lanes where it has AVX-512, 8
// otherwise (there 16-lane vectors would be register pairs, which GCC moves through the stack).
// Shared by the kernels that take their vector width from the target.
#pragma once

#include <cstdint>

namespace loraserve_simd {

#if defined(__AVX512F__)
constexpr int kNativeLanes = 16;
#else
constexpr int kNativeLanes = 8;
#endif
using native_f32 = float __attribute__((vector_size(4 * kNativeLanes)));
using native_i32 = int32_t __attribute__((vector_size(4 * kNativeLanes)));
using native_u32 = uint32_t __attribute__((vector_size(4 * kNativeLanes)));
using native_u16 = uint16_t __attribute__((vector_size(2 * kNativeLanes)));

}  // namespace loraserve_simd

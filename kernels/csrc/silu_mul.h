// SiLU-and-mul of one vector register of bfloat16 values, defined once (elementwise.cpp) for the
// pass over a gated MLP's two outputs (silu_and_mul_) and the pair panels' gated epilogue
// (linear_pair_panels.cpp), so that both round alike, bit for bit:
//   words[l] = bf16( bf16(silu(g[l])) * u[l] ),   silu(g) = g / (1 + exp(-g))
// g, u: kNativeLanes float lanes holding bfloat16 values (widened); the result: their words.
#pragma once

#include "simd_native.h"

namespace loraserve_silu {

loraserve_simd::native_u16 silu_mul_bf16_words(loraserve_simd::native_f32 g, loraserve_simd::native_f32 u);

}  // namespace loraserve_silu

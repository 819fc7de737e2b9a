// The elementwise parts of a Llama layer fused into one pass each, float32 or bfloat16: RMSNorm
// (with the residual add), RoPE, SiLU-and-mul. Semantics and shapes in kernels/cpu.py; the torch
// references they are tested against are RMSNorm, apply_rope and F.silu(...).mul_ (models/llama.py).
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "attention_common.h"
#include "bf16_bits.h"
#include "silu_mul.h"
#include "simd_native.h"

// ---- fused elementwise ops of a Llama layer (float32 or bfloat16) ---------------------------
// RMSNorm as Hugging Face's LlamaRMSNorm computes it (the sum of squares in float32):
//   out[t] = weight * to_dtype(x[t] * (1 / sqrt(mean(x[t]^2) + eps)))
// With ``residual``: residual[t] += x[t] first (rounded to the dtype, as torch's add_), and the
// norm is taken of the sum. In bfloat16 every step rounds where the torch ops round.
namespace {

// Element access in float for the fused ops' scalar tails: float as it is; bfloat16 through its bits
// (round to nearest even, as torch rounds; NaN kept a quiet NaN). The vector loops use load_v /
// store_v below, kLanes at a time.
inline float load_f(float v) { return v; }
inline float load_f(at::BFloat16 v) { return loraserve_bf16::widened(v.x); }
template <typename T>
inline T store_f(float v);
template <>
inline float store_f<float>(float v) { return v; }
template <>
inline at::BFloat16 store_f<at::BFloat16>(float v) {
  return at::BFloat16(loraserve_bf16::rounded_bits(v), at::BFloat16::from_bits());
}
// The value rounded to T and back (a torch op's result in T, read again in float).
template <typename T>
inline float round_f(float v) { return load_f(store_f<T>(v)); }

// One vector register of lanes (16 with AVX-512: measured faster than 8 there, figures in
// benchmarks/RESULTS.md).
constexpr int64_t kLanes = loraserve_simd::kNativeLanes;
using VecF = loraserve_simd::native_f32;
using VecI = loraserve_simd::native_i32;
using VecU32 = loraserve_simd::native_u32;
using VecU16 = loraserve_simd::native_u16;

inline VecF splat_v(float x) { return VecF{} + x; }

inline float exp_clamped(float x) {
  x = std::min(std::max(x, -87.0f), 88.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return loraserve_attention::exp_of_remainder(x, n) * scale;
}

inline VecF exp_v_clamped(VecF x) {
  const VecF high = splat_v(88.0f);
  x = x > high ? high : x;  // (exp_lanes_nonpositive clamps below at -87)
  return loraserve_attention::exp_lanes_nonpositive<VecF, VecI>(x, splat_v(-87.0f), splat_v(12582912.0f));
}

// kLanes elements in float and back, bfloat16 through its bits as load_f / store_f do one.
inline VecF load_v(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline VecF load_v(const at::BFloat16* p) { return loraserve_bf16::load_widened<VecF, VecU16, VecU32>(p); }
inline void store_v(float* p, VecF v) { std::memcpy(p, &v, sizeof(v)); }
inline void store_v(at::BFloat16* p, VecF v) {
  const VecU16 half = loraserve_bf16::rounded_words<VecU16, VecU32>(v);
  std::memcpy(p, &half, sizeof(half));
}
inline VecF round_v(VecF v, const float*) { return v; }
inline VecF round_v(VecF v, const at::BFloat16*) {
  return loraserve_bf16::widened_words<VecF, VecU16, VecU32>(loraserve_bf16::rounded_words<VecU16, VecU32>(v));
}


template <typename T>
void rms_norm_impl(const T* x_ptr, const T* w_ptr, T* sum_ptr, T* out_ptr, int64_t rows, int64_t hidden, float eps) {
  const int64_t vector_end = hidden - hidden % kLanes;
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* src = x_ptr + t * hidden;
      if (sum_ptr != nullptr) {
        T* acc = sum_ptr + t * hidden;
        for (int64_t i = 0; i < vector_end; i += kLanes) store_v(acc + i, load_v(acc + i) + load_v(src + i));
        for (int64_t i = vector_end; i < hidden; ++i) acc[i] = store_f<T>(load_f(acc[i]) + load_f(src[i]));
        src = acc;
      }
      VecF lanes{};
      for (int64_t i = 0; i < vector_end; i += kLanes) {
        const VecF v = load_v(src + i);
        lanes += v * v;
      }
      float squares = 0.f;
      for (int64_t lane = 0; lane < kLanes; ++lane) squares += lanes[lane];
      for (int64_t i = vector_end; i < hidden; ++i) squares += load_f(src[i]) * load_f(src[i]);
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + eps);
      T* dst = out_ptr + t * hidden;
      const VecF inv_v = splat_v(inv);
      for (int64_t i = 0; i < vector_end; i += kLanes) {
        store_v(dst + i, load_v(w_ptr + i) * round_v(load_v(src + i) * inv_v, src));
      }
      for (int64_t i = vector_end; i < hidden; ++i) {
        dst[i] = store_f<T>(load_f(w_ptr[i]) * round_f<T>(load_f(src[i]) * inv));
      }
    }
  });
}

}  // namespace

at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const c10::optional<at::Tensor>& residual) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && weight.scalar_type() == dtype,
              "rms_norm is float32 or bfloat16 only, weight in the same dtype as x");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: x [num_tokens, hidden] contiguous, weight [hidden]");
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == dtype && residual->is_contiguous() && residual->sizes() == x.sizes(),
                "rms_norm: residual must match x");
  }
  at::Tensor out = at::empty_like(x);
  const float feps = static_cast<float>(eps);
  if (dtype == at::kFloat) {
    float* sum_ptr = residual.has_value() ? residual->data_ptr<float>() : nullptr;
    rms_norm_impl<float>(x.data_ptr<float>(), weight.data_ptr<float>(), sum_ptr, out.data_ptr<float>(), x.size(0),
                         x.size(1), feps);
  } else {
    using bf16 = at::BFloat16;
    bf16* sum_ptr = residual.has_value() ? residual->data_ptr<bf16>() : nullptr;
    rms_norm_impl<bf16>(x.data_ptr<bf16>(), weight.data_ptr<bf16>(), sum_ptr, out.data_ptr<bf16>(), x.size(0),
                        x.size(1), feps);
  }
  return out;
}

// Rotary embedding in place, as apply_rope in models/llama.py (rotate-half form):
//   x[t, h, i]        = x[t, h, i] * cos[t, i] - x[t, h, i + D/2] * sin[t, i]
//   x[t, h, i + D/2]  = x[t, h, i + D/2] * cos[t, i + D/2] + x[t, h, i] * sin[t, i + D/2]
// Each product and the sum are rounded separately (no fused multiply-add), so the result is bit
// for bit what the torch ops give, float32 or bfloat16 (whose ops round each result too).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
namespace {

template <typename T>
void rope_impl(T* x_ptr, int64_t token_stride, const T* c_ptr, const T* s_ptr, int64_t tokens, int64_t heads,
               int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = c_ptr + t * dim;
      const T* s = s_ptr + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        T* v = x_ptr + t * token_stride + h * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float lo = load_f(v[i]), hi = load_f(v[i + half]);
          const float lo_cos = round_f<T>(lo * load_f(c[i])), hi_sin = round_f<T>(-hi * load_f(s[i]));
          const float hi_cos = round_f<T>(hi * load_f(c[i + half])), lo_sin = round_f<T>(lo * load_f(s[i + half]));
          v[i] = store_f<T>(lo_cos + hi_sin);
          v[i + half] = store_f<T>(hi_cos + lo_sin);
        }
      }
    }
  });
}

}  // namespace

void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  const auto dtype = x.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && cos.scalar_type() == dtype &&
                  sin.scalar_type() == dtype,
              "rope_ is float32 or bfloat16 only, cos and sin in the same dtype as x");
  // x may be a slice of a wider output (q or k of one q/k/v GEMM): its tokens at any stride
  TORCH_CHECK(x.dim() == 3 && x.stride(2) == 1 && x.stride(1) == x.size(2) && cos.is_contiguous() &&
                  sin.is_contiguous(),
              "rope_: x [num_tokens, heads, head_dim] with contiguous heads, cos/sin [num_tokens, head_dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  TORCH_CHECK(cos.size(0) == tokens && cos.size(1) == dim && sin.sizes() == cos.sizes(), "rope_: cos/sin shape");
  if (dtype == at::kFloat) {
    rope_impl<float>(x.data_ptr<float>(), x.stride(0), cos.data_ptr<float>(), sin.data_ptr<float>(), tokens, heads, dim);
  } else {
    using bf16 = at::BFloat16;
    rope_impl<bf16>(x.data_ptr<bf16>(), x.stride(0), cos.data_ptr<bf16>(), sin.data_ptr<bf16>(), tokens, heads, dim);
  }
}
#pragma GCC pop_options

// SiLU-and-mul in place, as F.silu(gate, inplace=True).mul_(up) computes it:
//   gate[t, j] = to_dtype(to_dtype(silu(gate[t, j])) * up[t, j]),   silu(g) = g / (1 + exp(-g))
// in float32 arithmetic (in float32 to_dtype is nothing; in bfloat16 both torch ops round). The exp
// is the attention kernels' polynomial (about 1 ulp) with its argument clamped to [-87, 88], so
// silu(g) is exact to a few ulp for every finite g and 0 (not NaN) far below zero.
namespace loraserve_silu {

loraserve_simd::native_u16 silu_mul_bf16_words(loraserve_simd::native_f32 g, loraserve_simd::native_f32 u) {
  return loraserve_bf16::rounded_words<VecU16, VecU32>(round_v(g / (splat_v(1.0f) + exp_v_clamped(-g)), static_cast<const at::BFloat16*>(nullptr)) * u);
}

}  // namespace loraserve_silu

namespace {

template <typename T>
void silu_and_mul_impl(T* gate, int64_t gate_stride, const T* up, int64_t up_stride, int64_t rows, int64_t width) {
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1));  // ~16K elements a task
  const int64_t vector_end = width - width % kLanes;
  at::parallel_for(0, rows, grain, [&](int64_t begin, int64_t end) {
    const VecF one = splat_v(1.0f);
    for (int64_t t = begin; t < end; ++t) {
      T* g = gate + t * gate_stride;
      const T* u = up + t * up_stride;
      for (int64_t j = 0; j < vector_end; j += kLanes) {
        if constexpr (std::is_same_v<T, at::BFloat16>) {
          const VecU16 words = loraserve_silu::silu_mul_bf16_words(load_v(g + j), load_v(u + j));
          std::memcpy(g + j, &words, sizeof(words));
        } else {
          const VecF x = load_v(g + j);
          store_v(g + j, round_v(x / (one + exp_v_clamped(-x)), g) * load_v(u + j));
        }
      }
      for (int64_t j = vector_end; j < width; ++j) {
        const float x = load_f(g[j]);
        g[j] = store_f<T>(round_f<T>(x / (1.0f + exp_clamped(-x))) * load_f(u[j]));
      }
    }
  });
}

}  // namespace

void silu_and_mul_(at::Tensor& gate, const at::Tensor& up) {
  const auto dtype = gate.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && up.scalar_type() == dtype,
              "silu_and_mul_ is float32 or bfloat16 only, up in the same dtype as gate");
  TORCH_CHECK(gate.dim() == 2 && up.sizes() == gate.sizes() && gate.stride(1) == 1 && up.stride(1) == 1,
              "silu_and_mul_: gate and up [num_tokens, width], columns contiguous");
  const int64_t rows = gate.size(0), width = gate.size(1);
  if (dtype == at::kFloat) {
    silu_and_mul_impl<float>(gate.data_ptr<float>(), gate.stride(0), up.data_ptr<float>(), up.stride(0), rows, width);
  } else {
    using bf16 = at::BFloat16;
    silu_and_mul_impl<bf16>(gate.data_ptr<bf16>(), gate.stride(0), up.data_ptr<bf16>(), up.stride(0), rows, width);
  }
}

// Linear layers of few rows over bfloat16 weights as they are stored (no packed copy), by
// AVX512-BF16 dot products:
//
//   out_i[m, n] = bf16( sum_k x[m, k] * W_i[n, k]  (+ b_i[n]) )
//
// x [M, K] bfloat16, contiguous; each W_i [N_i, K] bfloat16, contiguous (nn.Linear's layout); each
// b_i [N_i] bfloat16 or absent; each out_i [M, N_i] bfloat16. The products of bfloat16 pairs are
// exact and summed in float32 lanes (vdpbf16ps), the lanes summed at the end, the bias added, the
// result rounded once to nearest even. A tile is 4 rows of W by up to 4 rows of x: each 64-byte
// load of W feeds up to 4 dot products, and W is read once, front to back, which is what a decode
// step of few sequences needs (it is bound by reading the weights from memory). Built where the
// target has avx512_bf16; elsewhere linear_dot_available() is false and linear_dot refuses.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "bf16_bits.h"
#include "linear_bf16_args.h"

#if defined(__AVX512BF16__)
#include <immintrin.h>

namespace {

constexpr int kTileN = 4;   // rows of W per tile
constexpr int kTileM = 4;   // rows of x per tile
constexpr int64_t kTerms = 32;  // bfloat16 terms per vector
// Rows of W ahead that each load prefetches (the rows of a later tile, which lie right after this
// tile's): the hardware prefetchers alone leave a tile of several rows of x waiting on memory.
constexpr int64_t kPrefetchRows = 2 * kTileN;

// acc[m * kTileN + j] = sum_k x_m[k] * w_j[k] for the MR rows of x and the kTileN rows of W given.
template <int MR>
inline void dot_tile(const uint16_t* const* x, const uint16_t* const* w, int64_t K, float* acc) {
  __m512 sums[MR][kTileN];
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < kTileN; ++j) sums[m][j] = _mm512_setzero_ps();
  }
  const auto step = [&](int64_t k, __mmask32 mask) {
    __m512bh b[kTileN];
    for (int j = 0; j < kTileN; ++j) {
      _mm_prefetch(reinterpret_cast<const char*>(w[j] + kPrefetchRows * K + k), _MM_HINT_T0);
      b[j] = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, w[j] + k));
    }
    for (int m = 0; m < MR; ++m) {
      const __m512bh a = reinterpret_cast<__m512bh>(_mm512_maskz_loadu_epi16(mask, x[m] + k));
      for (int j = 0; j < kTileN; ++j) sums[m][j] = _mm512_dpbf16_ps(sums[m][j], a, b[j]);
    }
  };
  int64_t k = 0;
  for (; k + kTerms <= K; k += kTerms) step(k, ~__mmask32{0});
  if (k < K) step(k, static_cast<__mmask32>((uint64_t{1} << (K - k)) - 1));
  for (int m = 0; m < MR; ++m) {
    for (int j = 0; j < kTileN; ++j) acc[m * kTileN + j] = _mm512_reduce_add_ps(sums[m][j]);
  }
}

// Rows [n0, n0 + kTileN) of one layer (fewer at its end: the missing rows repeat row n0, their
// sums dropped) for every row of x.
void layer_tile(const uint16_t* x, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, int64_t N,
                int64_t n0, uint16_t* out) {
  const int nr = static_cast<int>(std::min<int64_t>(kTileN, N - n0));
  const uint16_t* w_rows[kTileN];
  for (int j = 0; j < kTileN; ++j) w_rows[j] = w + (n0 + (j < nr ? j : 0)) * K;
  for (int64_t m0 = 0; m0 < M; m0 += kTileM) {
    const int mr = static_cast<int>(std::min<int64_t>(kTileM, M - m0));
    const uint16_t* x_rows[kTileM];
    for (int m = 0; m < mr; ++m) x_rows[m] = x + (m0 + m) * K;
    float acc[kTileM * kTileN];
    switch (mr) {
      case 4: dot_tile<4>(x_rows, w_rows, K, acc); break;
      case 3: dot_tile<3>(x_rows, w_rows, K, acc); break;
      case 2: dot_tile<2>(x_rows, w_rows, K, acc); break;
      default: dot_tile<1>(x_rows, w_rows, K, acc); break;
    }
    for (int m = 0; m < mr; ++m) {
      for (int j = 0; j < nr; ++j) {
        const float b = bias != nullptr ? loraserve_bf16::widened(bias[n0 + j]) : 0.f;
        out[(m0 + m) * N + n0 + j] = loraserve_bf16::rounded_bits(acc[m * kTileN + j] + b);
      }
    }
  }
}

}  // namespace

bool linear_dot_available() { return true; }

std::vector<at::Tensor> linear_dot(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                   const std::vector<c10::optional<at::Tensor>>& biases) {
  loraserve_linear::LinearItems items = loraserve_linear::checked_items("linear_dot", x, weights, biases, kTileN);
  std::vector<at::Tensor>& outs = items.outs;
  const std::vector<int64_t>& first_tile = items.first;  // each layer's first tile of kTileN rows of W
  const int64_t M = x.size(0), K = x.size(1);
  if (M == 0) return outs;
  const auto* x_ptr = reinterpret_cast<const uint16_t*>(x.data_ptr());
  at::parallel_for(0, first_tile.back(), 1, [&](int64_t begin, int64_t end) {
    size_t layer = 0;
    for (int64_t tile = begin; tile < end; ++tile) {
      while (tile >= first_tile[layer + 1]) ++layer;
      const at::Tensor& w = weights[layer];
      const uint16_t* bias = loraserve_linear::bias_bits(biases, layer);
      layer_tile(x_ptr, M, K, reinterpret_cast<const uint16_t*>(w.data_ptr()), bias, w.size(0),
                 (tile - first_tile[layer]) * kTileN, reinterpret_cast<uint16_t*>(outs[layer].data_ptr()));
    }
  });
  return outs;
}

#else

bool linear_dot_available() { return false; }

std::vector<at::Tensor> linear_dot(const at::Tensor&, const std::vector<at::Tensor>&,
                                   const std::vector<c10::optional<at::Tensor>>&) {
  TORCH_CHECK(false, "linear_dot: this build's target has no avx512_bf16");
}

#endif

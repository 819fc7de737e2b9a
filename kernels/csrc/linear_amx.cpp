// Linear layers over bfloat16 weights as they are stored (no packed copy), on AMX tiles:
//
//   out_i[m, n] = bf16( sum_k x[m, k] * W_i[n, k]  (+ b_i[n]) )
//
// x [M, K] bfloat16, contiguous; each W_i [N_i, K] bfloat16, contiguous (nn.Linear's layout); each
// b_i [N_i] bfloat16 or absent; each out_i [M, N_i] bfloat16. 16 rows x 32 terms of W load in
// place as a tile A; x is transposed once per call into bfloat16 pairs (B tiles of 16 rows of x);
// each tile product gives 16 outputs x 16 rows of x. The tiles multiply bfloat16 pairs exactly and
// sum in float32 (bfloat16 denormals count as zero); the bias is added and the result rounded once
// to nearest even. Work items are 32 rows of W for all rows of x, so W is read from memory once
// (rows of x past 32 take further passes over the item's rows, from cache). No software prefetch:
// each tile load already asks for 16 rows' lines at once, and prefetching the next item's rows,
// or these rows ahead, measured slower (benchmarks/RESULTS.md, 2026-12-05).
// Built where the target has amx_bf16 and avx512_bf16; linear_amx_available() also asks the OS
// for the tile state; elsewhere linear_amx refuses.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "amx_tiles.h"
#include "linear_bf16_args.h"
#include "scratch.h"

#if defined(LORASERVE_AMX)

namespace {

using loraserve_amx::kTileRows;
using loraserve_amx::kTileTerms;
using loraserve_amx::padded;

constexpr int64_t kGroupRows = 2 * kTileRows;  // rows of W per work item (two A tiles)

// xp: per block of 16 rows of x, [padded(K, 32) / 2 pairs, 16 rows] words, zero past M and K.
void pack_rows(const uint16_t* x, int64_t M, int64_t K, uint32_t* xp) {
  const int64_t kpad = padded(K, kTileTerms), block_words = kpad / 2 * kTileRows;
  for (int64_t m0 = 0; m0 < M; m0 += kTileRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
    for (int64_t k = 0; k < kpad; k += kTileTerms) {
      const int64_t terms = std::min<int64_t>(kTileTerms, K - k);
      const __mmask32 mask = terms >= 32 ? ~__mmask32{0} : (__mmask32{1} << terms) - 1;
      __m512i r[kTileRows];
      for (int n = 0; n < kTileRows; ++n) {
        r[n] = n < rows ? _mm512_maskz_loadu_epi16(mask, x + (m0 + n) * K + k) : _mm512_setzero_si512();
      }
      loraserve_amx::store_transposed_words(r, xp + m0 / kTileRows * block_words + k / 2 * kTileRows);
    }
  }
}

// out[m, n0 + i] = bf16(c[i * 16 + m - m0] + bias[n0 + i]) for rows [m0, m0 + rows) of x and
// `cols` (<= 16) outputs: the tile's column per row of x, gathered.
void write_tile(const float* c, const uint16_t* bias, int64_t n0, int cols, int64_t m0, int rows, uint16_t* out,
                int64_t N) {
  const __mmask16 mask = cols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << cols) - 1);
  const __m512i by_row = _mm512_mullo_epi32(_mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0),
                                            _mm512_set1_epi32(kTileRows));
  __m512 b = _mm512_setzero_ps();
  if (bias != nullptr) {
    b = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, bias + n0)), 16));
  }
  for (int m = 0; m < rows; ++m) {
    const __m512 sums = _mm512_i32gather_ps(_mm512_add_epi32(by_row, _mm512_set1_epi32(m)), c, 4);
    const __m256i rounded = (__m256i)_mm512_cvtneps_pbh(_mm512_add_ps(sums, b));
    _mm256_mask_storeu_epi16(out + (m0 + m) * N + n0, mask, rounded);
  }
}

// Rows [n0, n0 + 32) of one layer (fewer at its end) for every row of x. W's rows load in place
// when all 32 are there and K is a multiple of 32, else from a zero-padded copy in `block`.
void run_item(const uint32_t* xp, int64_t M, int64_t K, const uint16_t* w, const uint16_t* bias, int64_t N, int64_t n0,
              uint16_t* out, uint16_t* block, float* cbuf) {
  const int64_t kpad = padded(K, kTileTerms), block_words = kpad / 2 * kTileRows;
  const int64_t rows = std::min(kGroupRows, N - n0);
  const uint16_t* base = w + n0 * K;
  int64_t stride = K;
  if (rows < kGroupRows || kpad != K) {
    std::memset(block, 0, kGroupRows * kpad * sizeof(uint16_t));
    for (int64_t i = 0; i < rows; ++i) std::memcpy(block + i * kpad, base + i * K, K * sizeof(uint16_t));
    base = block, stride = kpad;
  }
  const int64_t x_blocks = (M + kTileRows - 1) / kTileRows;
  for (int64_t b = 0; b < x_blocks; b += 2) {
    const bool two = b + 1 < x_blocks;
    const uint32_t* first = xp + b * block_words;
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
    for (int64_t k = 0; k < kpad; k += kTileTerms) {
      _tile_loadd(4, base + k, stride * sizeof(uint16_t));
      _tile_loadd(5, base + kTileRows * stride + k, stride * sizeof(uint16_t));
      _tile_loadd(6, first + k / 2 * kTileRows, kTileRows * sizeof(uint32_t));
      _tile_dpbf16ps(0, 4, 6);
      _tile_dpbf16ps(1, 5, 6);
      if (two) {
        _tile_loadd(7, first + block_words + k / 2 * kTileRows, kTileRows * sizeof(uint32_t));
        _tile_dpbf16ps(2, 4, 7);
        _tile_dpbf16ps(3, 5, 7);
      }
    }
    constexpr int64_t kTile = kTileRows * kTileRows;
    _tile_stored(0, cbuf, kTileRows * sizeof(float));
    _tile_stored(1, cbuf + kTile, kTileRows * sizeof(float));
    if (two) {
      _tile_stored(2, cbuf + 2 * kTile, kTileRows * sizeof(float));
      _tile_stored(3, cbuf + 3 * kTile, kTileRows * sizeof(float));
    }
    for (int64_t j = 0; j < (two ? 2 : 1); ++j) {
      const int64_t m0 = (b + j) * kTileRows;
      const int m_rows = static_cast<int>(std::min<int64_t>(kTileRows, M - m0));
      for (int64_t h = 0; h < 2 && h * kTileRows < rows; ++h) {
        write_tile(cbuf + (2 * j + h) * kTile, bias, n0 + h * kTileRows,
                   static_cast<int>(std::min<int64_t>(kTileRows, rows - h * kTileRows)), m0, m_rows, out, N);
      }
    }
  }
}

}  // namespace

bool linear_amx_available() { return loraserve_amx::amx_permitted(); }

std::vector<at::Tensor> linear_amx(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                   const std::vector<c10::optional<at::Tensor>>& biases) {
  TORCH_CHECK(linear_amx_available(), "linear_amx: the OS did not grant the AMX tile state");
  loraserve_linear::LinearItems items = loraserve_linear::checked_items("linear_amx", x, weights, biases, kGroupRows);
  std::vector<at::Tensor>& outs = items.outs;
  const std::vector<int64_t>& first_item = items.first;  // each layer's first item of 32 rows of W
  const int64_t M = x.size(0), K = x.size(1);
  if (M == 0) return outs;
  const int64_t kpad = padded(K, kTileTerms);
  thread_local std::vector<uint32_t> packed;
  uint32_t* xp = loraserve_scratch::at_least(packed, ((M + kTileRows - 1) / kTileRows) * kpad / 2 * kTileRows);
  pack_rows(reinterpret_cast<const uint16_t*>(x.data_ptr()), M, K, xp);
  at::parallel_for(0, first_item.back(), 1, [&](int64_t begin, int64_t end) {
    thread_local std::vector<uint16_t> block;
    alignas(64) float cbuf[4 * kTileRows * kTileRows];
    uint16_t* block_rows = loraserve_scratch::at_least(block, kGroupRows * kpad);
    loraserve_amx::configure_tiles();
    size_t layer = 0;
    for (int64_t item = begin; item < end; ++item) {
      while (item >= first_item[layer + 1]) ++layer;
      const at::Tensor& w = weights[layer];
      const uint16_t* bias = loraserve_linear::bias_bits(biases, layer);
      run_item(xp, M, K, reinterpret_cast<const uint16_t*>(w.data_ptr()), bias, w.size(0),
               (item - first_item[layer]) * kGroupRows, reinterpret_cast<uint16_t*>(outs[layer].data_ptr()),
               block_rows, cbuf);
    }
    _tile_release();
  });
  loraserve_scratch::trim(packed);
  return outs;
}

#else

bool linear_amx_available() { return false; }

std::vector<at::Tensor> linear_amx(const at::Tensor&, const std::vector<at::Tensor>&,
                                   const std::vector<c10::optional<at::Tensor>>&) {
  TORCH_CHECK(false, "linear_amx: this build's target has no amx_bf16");
}

#endif

// Linear layers over bfloat16 weights packed into 16-column panels of k pairs, by AVX512-BF16
// dot products (vdpbf16ps):
//
//   out_i[m, n] = bf16( b_i[n] + sum_k x[m, k] * W_i[n, k] )
//
// x [M, K] bfloat16, contiguous; panels [P, ceil(K / 2), 32] bfloat16 with
// panels[p, q, 2 j + h] = W[16 p + j, 2 q + h] (zero past a weight's rows or K), the outputs'
// weights one after another (kernels/cpu_linear.py packs them); bias float32 [P * 16] or absent;
// each out_i [M, N_i] bfloat16. Products of bfloat16 pairs are exact and summed in float32 lanes,
// two k terms an instruction, in k order per lane pair; the bias starts the sums; each output is
// rounded once to nearest even (torch's rounding; a NaN becomes 0x7FC0).
//
// Gated (linear_pair_panels_silu): a gate and an up of `width` outputs each, packed in that order;
//
//   out[m, n] = bf16( bf16(silu(gate[m, n])) * up[m, n] )
//
// with gate and up the rounded outputs above, combined in the tiles' epilogue as silu_and_mul_
// combines them after a plain call (silu_mul.h): the same bits, without writing and reading up.
//
// The tiling is the float32 panels' (linear_panels.cpp) with a k pair where that has one k: four
// panels side by side for 6 rows (24 accumulators of the 32 registers; each k pair step loads 4
// weight vectors and broadcasts one 32-bit pair of x per row: 24 dot products), two or one panel
// for 12 rows at a thread's end; a panel's line is one k pair row (64 bytes); the tiles passing
// over a group of panels fetch the next group into L2 between them; threads own ranges of panels
// and take over each other's last units (panel_units.h). Built where the target has avx512_bf16;
// elsewhere linear_pair_panels_available() is false and linear_pair_panels refuses.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>

#include "bf16_bits.h"
#include "panel_units.h"
#include "silu_mul.h"

namespace {

using loraserve_panels::Chunk;
using loraserve_panels::LinePrefetcher;
constexpr int64_t kPanel = 16;     // output columns per panel
constexpr int64_t kLine = 2 * kPanel;  // bfloat16 values per k pair row of a panel (one cache line)
constexpr int kWideRows = 12;      // rows of a one- or two-panel tile
constexpr int kQuadRows = 6;       // rows of a four-panel tile
constexpr int64_t kRowBlock = 144;  // a multiple of 6 and 12 (as linear_panels.cpp)

using u32x16 = uint32_t __attribute__((vector_size(64)));

// Where one panel's tile goes.
struct PairOut {
  const uint16_t* panel;
  const float* bias;
  uint16_t* c;
  int64_t ldc;
  int64_t num_cols;
};

// x[i, 2q], x[i, 2q + 1] as one 32-bit lane pattern, broadcast.
inline __m512bh pair_at(const uint16_t* p) {
  uint32_t bits;
  std::memcpy(&bits, p, sizeof(bits));
  return reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(bits)));
}

inline void store_rounded(const __m512& acc, const PairOut& out, int64_t row) {
  const u32x16 rounded = loraserve_bf16::rounded_bits<u32x16>(acc);  // each lane's low half
  const __m256i words = _mm512_cvtepi32_epi16(reinterpret_cast<const __m512i&>(rounded));
  uint16_t* dst = out.c + row * out.ldc;
  if (out.num_cols == kPanel) {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst), words);
  } else {
    _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << out.num_cols) - 1), words);
  }
}

// The sums of a gate and an up panel, each rounded to bfloat16 as the plain GEMM stores them,
// combined as silu_and_mul_ combines the stored outputs: bf16(bf16(silu(g)) * u) (silu_mul.h).
inline void store_silu_mul(const __m512& gate, const __m512& up, const PairOut& out, int64_t row) {
  const auto widened = [](const __m512& acc) {
    const u32x16 bits = loraserve_bf16::rounded_bits<u32x16>(acc) << 16;
    loraserve_simd::native_f32 value;
    std::memcpy(&value, &bits, sizeof(value));
    return value;
  };
  const loraserve_simd::native_u16 words = loraserve_silu::silu_mul_bf16_words(widened(gate), widened(up));
  uint16_t* dst = out.c + row * out.ldc;
  if (out.num_cols == kPanel) {
    std::memcpy(dst, &words, sizeof(words));
  } else {
    __m256i packed;
    std::memcpy(&packed, &words, sizeof(packed));
    _mm256_mask_storeu_epi16(dst, static_cast<__mmask16>((1u << out.num_cols) - 1), packed);
  }
}

// R rows times NP panels side by side over all k pairs; tile `first` of the `every` tiles over
// these panels prefetches its share of the `fetch_lines` lines at `fetch`.
// Gated: outs holds NP / 2 gate panels, then their NP / 2 up panels; each gate panel's output gets
// silu_mul(gate, up) (store_silu_mul) and the up panels' outputs are not written.
template <int R, int NP, bool Gated = false>
void pair_tile(const uint16_t* a, int64_t lda, const PairOut* outs, int64_t K, const uint16_t* fetch,
               int64_t fetch_lines, int64_t every, int64_t first) {
  __m512 acc[NP][R];
  for (int j = 0; j < NP; ++j) {
    const __m512 b = outs[j].bias != nullptr ? _mm512_loadu_ps(outs[j].bias) : _mm512_setzero_ps();
    for (int i = 0; i < R; ++i) acc[j][i] = b;
  }
  LinePrefetcher<uint16_t> prefetch(fetch, fetch_lines, kLine, every, first);
  const int64_t pairs = K / 2;
  for (int64_t q = 0; q < pairs; ++q) {
    prefetch.step();
    __m512bh w[NP];
    for (int j = 0; j < NP; ++j) w[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(outs[j].panel + q * kLine));
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i) {
      const __m512bh x = pair_at(a + i * lda + 2 * q);
      for (int j = 0; j < NP; ++j) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], x, w[j]);
    }
  }
  if (K % 2 != 0) {  // the last k alone: its pair's second half is zero in x (and in the panel)
    __m512bh w[NP];
    for (int j = 0; j < NP; ++j) w[j] = reinterpret_cast<__m512bh>(_mm512_loadu_si512(outs[j].panel + pairs * kLine));
    for (int i = 0; i < R; ++i) {
      const __m512bh x = reinterpret_cast<__m512bh>(_mm512_set1_epi32(a[i * lda + K - 1]));
      for (int j = 0; j < NP; ++j) acc[j][i] = _mm512_dpbf16_ps(acc[j][i], x, w[j]);
    }
  }
  if constexpr (Gated) {
    for (int j = 0; j < NP / 2; ++j) {
      for (int i = 0; i < R; ++i) store_silu_mul(acc[j][i], acc[j + NP / 2][i], outs[j], i);
    }
  } else {
    for (int j = 0; j < NP; ++j) {
      for (int i = 0; i < R; ++i) store_rounded(acc[j][i], outs[j], i);
    }
  }
}

using PairTileFn = void (*)(const uint16_t*, int64_t, const PairOut*, int64_t, const uint16_t*, int64_t, int64_t,
                            int64_t);
template <int NP, bool Gated, size_t... R>
constexpr std::array<PairTileFn, sizeof...(R) + 1> tiles_of(std::index_sequence<R...>) {
  return {nullptr, &pair_tile<static_cast<int>(R) + 1, NP, Gated>...};
}
template <int NP, bool Gated = false>
constexpr auto kPairTiles = tiles_of<NP, Gated>(std::make_index_sequence<NP == 4 ? kQuadRows : kWideRows>{});

}  // namespace

bool linear_pair_panels_available() { return true; }

std::vector<at::Tensor> linear_pair_panels(const at::Tensor& x, const at::Tensor& panels,
                                           const c10::optional<at::Tensor>& bias,
                                           const std::vector<int64_t>& out_sizes) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "linear_pair_panels: x must be a contiguous bfloat16 [num_rows, in_features]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() &&
                  panels.size(1) == (K + 1) / 2 && panels.size(2) == kLine,
              "linear_pair_panels: panels must be a contiguous bfloat16 [num_panels, ceil(in_features / 2), 32] "
              "matching x");
  const int64_t num_panels = panels.size(0);
  const loraserve_panels::PanelOwners owners(out_sizes, kPanel, num_panels, "linear_pair_panels");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == num_panels * kPanel,
                "linear_pair_panels: bias must be a contiguous float32 [num_panels * 16]");
    bias_ptr = bias->data_ptr<float>();
  }
  std::vector<at::Tensor> outputs;
  std::vector<uint16_t*> out_ptrs;
  for (const int64_t size : out_sizes) {
    outputs.push_back(at::empty({M, size}, x.options()));
    out_ptrs.push_back(reinterpret_cast<uint16_t*>(outputs.back().data_ptr()));
  }
  if (M == 0) return outputs;
  const auto* a = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  const int64_t panel_elems = panels.size(1) * kLine;
  auto out_of = [&](int64_t p, int64_t row) {
    const auto where = owners.at(p);
    return PairOut{w + p * panel_elems, bias_ptr ? bias_ptr + p * kPanel : nullptr,
                   out_ptrs[where.output] + row * where.width + where.column, where.width,
                   std::min(kPanel, where.width - where.column)};
  };
  loraserve_panels::run_panel_units(M, kRowBlock, num_panels, true, [&](int64_t row, int64_t rows, Chunk chunk,
                                                                       const Chunk* next) {
    const uint16_t* fetch = next != nullptr ? w + next->panel * panel_elems : nullptr;
    const int64_t lines = next != nullptr ? next->count * panels.size(1) : 0;
    loraserve_panels::with_chunk_outs(chunk, row, out_of, [&](const PairOut* outs, auto np) {
      constexpr int NP = decltype(np)::value;
      loraserve_panels::run_tile_rows<NP>(a + row * K, K, rows, outs, K, fetch, lines,
                                          NP == 4 ? kQuadRows : kWideRows, kPairTiles<NP>.data());
    });
  });
  return outputs;
}

at::Tensor linear_pair_panels_silu(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                                  int64_t width) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(),
              "linear_pair_panels_silu: x must be a contiguous bfloat16 [num_rows, in_features]");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(width > 0, "linear_pair_panels_silu: width must be positive");
  const int64_t gates = (width + kPanel - 1) / kPanel;  // the gate's panels, then as many of the up's
  TORCH_CHECK(panels.dim() == 3 && panels.scalar_type() == at::kBFloat16 && panels.is_contiguous() &&
                  panels.size(0) == 2 * gates && panels.size(1) == (K + 1) / 2 && panels.size(2) == kLine,
              "linear_pair_panels_silu: panels must be a contiguous bfloat16 [2 * ceil(width / 16), "
              "ceil(in_features / 2), 32] matching x (a gate and an up of `width` outputs each)");
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == 2 * gates * kPanel,
                "linear_pair_panels_silu: bias must be a contiguous float32 [num_panels * 16]");
    bias_ptr = bias->data_ptr<float>();
  }
  at::Tensor output = at::empty({M, width}, x.options());
  if (M == 0) return output;
  auto* out = reinterpret_cast<uint16_t*>(output.data_ptr());
  const auto* a = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* w = reinterpret_cast<const uint16_t*>(panels.data_ptr());
  const int64_t panel_elems = panels.size(1) * kLine;
  auto panel_out = [&](int64_t p, int64_t row) {  // p < gates: a gate panel; else the up panel p - gates
    const int64_t column = (p % gates) * kPanel;
    return PairOut{w + p * panel_elems, bias_ptr ? bias_ptr + p * kPanel : nullptr, out + row * width + column, width,
                   std::min(kPanel, width - column)};
  };
  // The units run over the gate's panels; each tile takes one or two of them with their up panels.
  loraserve_panels::run_panel_units(M, kRowBlock, gates, true, [&](int64_t row, int64_t rows, Chunk chunk,
                                                                   const Chunk* next) {
    const uint16_t* fetch = next != nullptr ? w + next->panel * panel_elems : nullptr;
    const int64_t lines = next != nullptr ? next->count * panels.size(1) : 0;
    for (int64_t p = chunk.panel; p < chunk.panel + chunk.count; p += 2) {
      if (p + 1 < chunk.panel + chunk.count) {
        const PairOut outs[4] = {panel_out(p, row), panel_out(p + 1, row), panel_out(gates + p, row),
                                 panel_out(gates + p + 1, row)};
        loraserve_panels::run_tile_rows<4>(a + row * K, K, rows, outs, K, fetch, lines, kQuadRows,
                                           kPairTiles<4, true>.data());
      } else {
        const PairOut outs[2] = {panel_out(p, row), panel_out(gates + p, row)};
        loraserve_panels::run_tile_rows<2>(a + row * K, K, rows, outs, K, fetch, lines, kWideRows,
                                           kPairTiles<2, true>.data());
      }
    }
  });
  return output;
}

#else

bool linear_pair_panels_available() { return false; }

at::Tensor linear_pair_panels_silu(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&, int64_t) {
  TORCH_CHECK(false, "linear_pair_panels_silu: this build's target has no avx512_bf16");
}

std::vector<at::Tensor> linear_pair_panels(const at::Tensor&, const at::Tensor&, const c10::optional<at::Tensor>&,
                                           const std::vector<int64_t>&) {
  TORCH_CHECK(false, "linear_pair_panels: this build's target has no avx512_bf16");
}

#endif

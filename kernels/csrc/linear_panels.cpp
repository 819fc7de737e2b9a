// Linear layers on weights packed into 16-column panels (float32); semantics, shapes and the
// packing are documented in kernels/cpu.py, the reference is torch's F.linear.
//
// Each output tile of 6 rows x 16 columns is held in 12 vector registers while the loop runs
// over all of K: per k, two weight vectors (one row of the panel, contiguous) and one broadcast
// input element per row, 12 FMAs. A panel ([K, 16], at most ~100 KB) stays in L1/L2 while every
// row block of the input passes over it, so each weight is read from memory once per block of
// 144 rows; the next panel is prefetched a cache line at a time during those passes.
//
// Where the build targets AVX-512 (-march=native on such a CPU; the build is cached per CPU
// signature), a second tiling runs instead: four panels side by side (64 columns, four 16-lane
// registers) for 6 rows, 24 accumulators of the 32 registers, so each broadcast input element
// feeds four FMAs and each k step loads 4 weight vectors and 6 broadcasts for 24 FMAs (two panels
// for 12 rows, the tiling before, load 14 for 24 and measured slower from 16 rows up: see
// benchmarks/RESULTS.md, 2026-12-02, EPYC Zen 4). A thread's
// last 1-3 panels run as two- and one-panel tiles of 12 rows. The tiles that pass over a group of
// panels split the next group's lines into contiguous runs, one run each, and fetch one line per
// k step into L2 (prefetcht1). Measured at 64 rows with the weights coming from memory (RESULTS,
// 2026-12-05 22:44): strided lines in bursts into L1, the 8-lane tiling's way, took 4-9 % longer
// a layer; into L1, ~3 % longer; two lines a step, or the run spread over all K steps, longer
// still. linear_panels_variants() names the tilings compiled in.
//
// Threads and their units: panel_units.h.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "panel_units.h"
#include "simd16.h"
#include "simd8.h"

namespace {

using loraserve_simd::f32x8;
using loraserve_simd::load8;
using loraserve_simd::splat8;
using loraserve_simd::store8;
using loraserve_panels::Chunk;
using loraserve_panels::LinePrefetcher;

constexpr int64_t kPanel = 16;     // output columns per panel: two 8-lane vectors
constexpr int kTileRows = 6;       // 6 x 2 accumulators + 2 weight vectors + 1 broadcast: 15 of 16 registers
// Input rows whose passes over one panel run back to back: a multiple of both tilings' rows (6
// and 12), so only a call's last block has a short tile; each panel is fetched once per block.
constexpr int64_t kRowBlock = 144;

// One panel's output columns for R rows: c[i, j] = bias[j] + sum_k a[i, k] * panel[k, j].
// While it runs it prefetches lines first, first + every, ... of `next` (a panel's line is one
// k row of 16 floats), so the tiles of one panel between them fetch all of the next one.
template <int R>
void tile(const float* a, int64_t lda, const float* panel, int64_t K, const float* bias, float* c, int64_t ldc,
          int64_t num_cols, const float* next, int64_t every, int64_t first) {
  f32x8 acc0[R], acc1[R];
  const f32x8 bias0 = bias != nullptr ? load8(bias) : splat8(0.f);
  const f32x8 bias1 = bias != nullptr ? load8(bias + 8) : splat8(0.f);
  for (int i = 0; i < R; ++i) {
    acc0[i] = bias0;
    acc1[i] = bias1;
  }
  for (int64_t k0 = 0; k0 < K; k0 += every) {
    if (next != nullptr && k0 + first < K) __builtin_prefetch(next + (k0 + first) * kPanel, 0, 3);
    const int64_t k_end = std::min(K, k0 + every);
    for (int64_t k = k0; k < k_end; ++k) {
      const f32x8 w0 = load8(panel + k * kPanel), w1 = load8(panel + k * kPanel + 8);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const f32x8 x = splat8(a[i * lda + k]);
        acc0[i] += x * w0;
        acc1[i] += x * w1;
      }
    }
  }
  if (num_cols == kPanel) {
    for (int i = 0; i < R; ++i) {
      store8(c + i * ldc, acc0[i]);
      store8(c + i * ldc + 8, acc1[i]);
    }
    return;
  }
  for (int i = 0; i < R; ++i) {  // the last panel of an output whose width is not a multiple of 16
    float row[kPanel];
    store8(row, acc0[i]);
    store8(row + 8, acc1[i]);
    std::copy(row, row + num_cols, c + i * ldc);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, int64_t, const float*, float*, int64_t, int64_t,
                        const float*, int64_t, int64_t);
constexpr TileFn kTiles[kTileRows + 1] = {nullptr, tile<1>, tile<2>, tile<3>, tile<4>, tile<5>, tile<6>};

// Rows [0, m) of a (stride lda) times one panel into c (stride ldc).
void panel_rows(const float* a, int64_t lda, int64_t m, const float* panel, int64_t K, const float* bias, float* c,
                int64_t ldc, int64_t num_cols, const float* next) {
  const int64_t num_tiles = (m + kTileRows - 1) / kTileRows;
  for (int64_t t = 0; t < num_tiles; ++t) {
    const int64_t row = t * kTileRows, rows = std::min<int64_t>(kTileRows, m - row);
    kTiles[rows](a + row * lda, lda, panel, K, bias, c + row * ldc, ldc, num_cols, next, num_tiles, t);
  }
}

// Where one panel's tile goes: its bias (or null), its output rows and their stride, its width.
struct PanelOut {
  const float* panel;
  const float* bias;
  float* c;
  int64_t ldc;
  int64_t num_cols;
};

#if defined(__AVX512F__)
#define LORASERVE_PANELS_AVX512 1
using loraserve_simd::f32x16;
using loraserve_simd::load16;
using loraserve_simd::splat16;
using loraserve_simd::store16;

constexpr int kWideRows = 12;  // 12 x 2 accumulators + 2 weight vectors + 1 broadcast: 27 of 32 registers
constexpr int kQuadRows = 6;   // 6 x 4 accumulators + 4 weight vectors + 1 broadcast: 29 of 32 registers

template <int R>
inline void store_tile(const f32x16* acc, const PanelOut& out) {
  for (int i = 0; i < R; ++i) {
    if (out.num_cols == kPanel) {
      store16(out.c + i * out.ldc, acc[i]);
    } else {
      float row[kPanel];
      store16(row, acc[i]);
      std::copy(row, row + out.num_cols, out.c + i * out.ldc);
    }
  }
}

// R rows times NP (1, 2 or 4) panels side by side. Tile `first` of the `every` tiles that pass over
// these panels prefetches its share of the `fetch_lines` cache lines at `fetch` (the panels that
// come next: a contiguous run, as panels are stored one after another): a contiguous run of them,
// one line per k step, so the tiles between them fetch all of the lines.
template <int R, int NP>
void wide_tile(const float* a, int64_t lda, const PanelOut* outs, int64_t K, const float* fetch, int64_t fetch_lines,
               int64_t every, int64_t first) {
  f32x16 acc[NP][R];
  for (int j = 0; j < NP; ++j) {
    const f32x16 b = outs[j].bias != nullptr ? load16(outs[j].bias) : splat16(0.f);
    for (int i = 0; i < R; ++i) acc[j][i] = b;
  }
  LinePrefetcher<float> prefetch(fetch, fetch_lines, kPanel, every, first);  // a line: one k row of a panel
  for (int64_t k = 0; k < K; ++k) {
    prefetch.step();
    f32x16 w[NP];
    for (int j = 0; j < NP; ++j) w[j] = load16(outs[j].panel + k * kPanel);
#pragma GCC unroll 12
    for (int i = 0; i < R; ++i) {
      const f32x16 x = splat16(a[i * lda + k]);
      for (int j = 0; j < NP; ++j) acc[j][i] += x * w[j];
    }
  }
  for (int j = 0; j < NP; ++j) store_tile<R>(acc[j], outs[j]);
}

using WideTileFn = void (*)(const float*, int64_t, const PanelOut*, int64_t, const float*, int64_t, int64_t, int64_t);
template <int NP>
constexpr WideTileFn kWideTiles[kWideRows + 1] = {
    nullptr,           wide_tile<1, NP>, wide_tile<2, NP>, wide_tile<3, NP>,  wide_tile<4, NP>,
    wide_tile<5, NP>,  wide_tile<6, NP>, wide_tile<7, NP>, wide_tile<8, NP>,  wide_tile<9, NP>,
    wide_tile<10, NP>, wide_tile<11, NP>, wide_tile<12, NP>};
template <>
constexpr WideTileFn kWideTiles<4>[kWideRows + 1] = {
    nullptr, wide_tile<1, 4>, wide_tile<2, 4>, wide_tile<3, 4>, wide_tile<4, 4>, wide_tile<5, 4>, wide_tile<6, 4>};

#endif

}  // namespace

// The tilings compiled into this build, widest first.
std::vector<std::string> linear_panels_variants() {
#if defined(LORASERVE_PANELS_AVX512)
  return {"avx512", "vec8"};
#else
  return {"vec8"};
#endif
}

// outputs[i] = x @ W_i^T + b_i for the weights W_i packed one after another into `panels`.
// variant: one of linear_panels_variants(), or "" for the widest.
std::vector<at::Tensor> linear_panels(const at::Tensor& x, const at::Tensor& panels,
                                      const c10::optional<at::Tensor>& bias, const std::vector<int64_t>& out_sizes,
                                      const std::string& variant) {
  const auto variants = linear_panels_variants();
  TORCH_CHECK(variant.empty() || std::find(variants.begin(), variants.end(), variant) != variants.end(),
              "linear_panels variant '", variant, "' is not compiled into this build");
  const bool wide = variant.empty() ? variants.front() != "vec8" : variant != "vec8";
  TORCH_CHECK(x.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat, "linear_panels is float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [num_rows, in_features]");
  TORCH_CHECK(panels.dim() == 3 && panels.is_contiguous() && panels.size(2) == kPanel && panels.size(1) == x.size(1),
              "panels must be a contiguous [num_panels, in_features, 16] matching x");
  const int64_t M = x.size(0), K = x.size(1), num_panels = panels.size(0);
  const loraserve_panels::PanelOwners owners(out_sizes, kPanel, num_panels, "linear_panels");
  std::vector<at::Tensor> outputs;
  std::vector<float*> out_ptrs;
  for (const int64_t size : out_sizes) {
    outputs.push_back(at::empty({M, size}, x.options()));
    out_ptrs.push_back(outputs.back().data_ptr<float>());
  }
  const float* bias_ptr = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == num_panels * kPanel,
                "bias must be a contiguous float32 [num_panels * 16]");
    bias_ptr = bias->data_ptr<float>();
  }
  if (M == 0) return outputs;
  const float* a = x.data_ptr<float>();
  const float* w = panels.data_ptr<float>();
  auto out_of = [&](int64_t p, int64_t row) {
    const auto where = owners.at(p);
    return PanelOut{w + p * K * kPanel, bias_ptr ? bias_ptr + p * kPanel : nullptr,
                    out_ptrs[where.output] + row * where.width + where.column, where.width,
                    std::min(kPanel, where.width - where.column)};
  };
  // Chunks of 4, 2 and 1 panels for the wide tiling, single panels for the 8-lane one.
  loraserve_panels::run_panel_units(M, kRowBlock, num_panels, wide, [&](int64_t row, int64_t rows, Chunk chunk,
                                                                        const Chunk* next) {
#if defined(LORASERVE_PANELS_AVX512)
    if (wide) {
      const float* fetch = next != nullptr ? w + next->panel * K * kPanel : nullptr;
      const int64_t lines = next != nullptr ? next->count * K : 0;
      loraserve_panels::with_chunk_outs(chunk, row, out_of, [&](const PanelOut* outs, auto np) {
        constexpr int NP = decltype(np)::value;
        loraserve_panels::run_tile_rows<NP>(a + row * K, K, rows, outs, K, fetch, lines,
                                            NP == 4 ? kQuadRows : kWideRows, kWideTiles<NP>);
      });
      return;
    }
#endif
    const PanelOut out = out_of(chunk.panel, row);
    panel_rows(a + row * K, K, rows, out.panel, K, out.bias, out.c, out.ldc, out.num_cols,
               next != nullptr ? w + next->panel * K * kPanel : nullptr);
  });
  return outputs;
}

// Segmented LoRA of loraserve's compiled CPU kernels (bound in cpu_kernels.cpp): for each
// segment of tokens using one adapter, shrink v = x @ A^T and expand out_m += scale_m * v_m @ B_m^T,
// with the adapter's weights read in place from the pool's pages. Semantics and argument shapes
// are documented in kernels/cpu.py; the torch reference is kernels/lora.py. The weights are
// float32 or bfloat16 (widened to float32 as they are read, or multiplied in bfloat16 pairs on
// AMX tiles: lora_amx.h); the sums are float32.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <iterator>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "lora_amx.h"
#include "lora_amx_long.h"
#include "lora_long.h"
#include "lora_tiled.h"

namespace {

using namespace loraserve_lora;

// Segments of at most this many tokens (decode steps over many adapters) are bound by reading
// the weights: small_segment reads each weight row once for all of the segment's tokens.
constexpr int64_t kSmallSegment = 2;

// A segment of a few tokens, row by row: each weight row is read once (in place, or copied
// when it crosses a page boundary) for all the segment's tokens.
template <typename W>
void small_segment(const float* x, int64_t in_features, const AdapterBuffer<W>& w, const int64_t* m,
                   const float* scale, int64_t start, int64_t num, float* v, int64_t ldv, W* const* outs,
                   int64_t num_outputs, std::vector<float>& tmp, W* row_buf) {
  for (int64_t c = 0; c < m[1]; ++c) {
    const W* a_row = w.span(m[0] + c * in_features, in_features, row_buf);
    for (int64_t t = 0; t < num; ++t) {
      const float* x_row = x + (start + t) * in_features;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t k = 0; k < in_features; ++k) dot += x_row[k] * widen(a_row[k]);
      v[(start + t) * ldv + c] = dot;
    }
  }
  for (int64_t module = 0; module < num_outputs; ++module) {
    const int64_t* mm = m + kModuleBase + kModuleStride * module;
    const int64_t column = mm[0], rank = mm[1], b_offset = mm[2], out_features = mm[3];
    if (rank == 0) continue;
    // tmp[t] = v_m[t] @ B_m^T first, then out[t] += scale * tmp[t], as one GEMM with alpha would.
    tmp.assign(num * out_features, 0.f);
    for (int64_t r = 0; r < rank; ++r) {
      const W* b_row = w.span(b_offset + r * out_features, out_features, row_buf);
      for (int64_t t = 0; t < num; ++t) {
        const float coef = v[(start + t) * ldv + column + r];
        float* acc = tmp.data() + t * out_features;
#pragma omp simd
        for (int64_t o = 0; o < out_features; ++o) acc[o] += coef * widen(b_row[o]);
      }
    }
    const float s = scale[module];
    add_scaled(outs[module] + start * out_features, tmp.data(), s, num * out_features);
  }
}

// Whether a segment of `num` tokens (3 or more, off the AMX tiles) runs on the tiled loops: up to
// kTiledMax tokens always; longer ones where `loop_lengths` has their length class's bit, in
// pieces of at most kTiledMax tokens (each piece reads the adapter's rows again, from cache),
// others as MKL GEMMs (run_long). Which is faster depends on the CPU: lora/tile_choice.py times it.
bool on_loops(int64_t num, int64_t loop_lengths) {
  return num <= kTiledMax || ((loop_lengths >> tile_length_class(num)) & 1) != 0;
}

// Whether a segment of `num` tokens is run by loops that read x as float32 (one or two tokens, and
// the MKL GEMMs); the tiled loops and the tiles read it as given. For a bfloat16 x the caller
// widens only those segments' rows (widening all of them, on one thread while the other waited,
// was a measurable share of a decode step's LoRA: benchmarks/RESULTS.md, 2026-12-06 14:21).
template <typename W>
bool read_float_x(int64_t num, int64_t tile_lengths, int64_t loop_lengths) {
  return num <= kSmallSegment || (!on_amx_tiles<W>(num, tile_lengths) && !on_loops(num, loop_lengths));
}

// x [num_tokens, in_features] as float32 (the caller's; for a bfloat16 x, a copy of the rows of the
// segments that read_float_x) and the outputs [num_tokens, widths[m]] of the pool's type W.
template <typename W>
struct SegmentArgs {
  const float* x = nullptr;
  const W* x_own = nullptr;  // x as given (read in place by the tiled loops and the AMX tiles)
  int64_t num_tokens = 0, in_features = 0;
  std::vector<W*> outs;
  std::vector<int64_t> widths;
};

// lora_segments over a pool and outputs of W (float, or bf16_t).
template <typename W>
void run_segments(const SegmentArgs<W>& args, const at::Tensor& storage, int64_t layer, int64_t group,
                  const at::Tensor& bounds, const at::Tensor& page_tables, const at::Tensor& meta,
                  const at::Tensor& scales, int64_t tile_lengths, int64_t loop_lengths, int64_t rank_block,
                  bool expand_pairs) {
  const int64_t num_segments = bounds.size(0), in_features = args.in_features;
  const int64_t num_outputs = static_cast<int64_t>(args.outs.size());
  const int64_t page_elems = storage.size(2), max_pages = page_tables.size(1), num_pages = storage.size(1);
  const int64_t* meta_ptr = meta.data_ptr<int64_t>() + (layer * meta.size(1) + group) * num_segments * kMetaWidth;
  const float* scale_ptr = scales.data_ptr<float>() + (layer * scales.size(1) + group) * num_segments * kMaxModules;
  const int64_t* bound_ptr = bounds.data_ptr<int64_t>();
  const int64_t* table_ptr = page_tables.data_ptr<int64_t>();
  const W* layer_ptr = static_cast<const W*>(storage.data_ptr()) + layer * storage.stride(0);
  int64_t max_rows = 0;
  for (int64_t s = 0; s < num_segments; ++s) max_rows = std::max(max_rows, meta_ptr[s * kMetaWidth + 1]);
  if (max_rows == 0) return;
  thread_local std::vector<float> shrunk;  // v [num_tokens, max_rows]: reused across calls
  float* v_ptr = at_least(shrunk, args.num_tokens * max_rows);
  const float* x_ptr = args.x;
  const int ldv = static_cast<int>(max_rows);
  W* const* out_ptrs = args.outs.data();

  // Each segment's weights. Short segments read them in place: an adapter on consecutive pages
  // through one pointer, one on scattered pages through its page table (row pointers into its
  // pages, copying only rows that cross a page boundary); so do segments of any length on AMX
  // tiles (bfloat16, their length class chosen in tile_lengths; those of 32+ tokens in
  // run_long_amx), which read x in place too, and long ones on the loops in pieces (on_loops).
  // Other long ones go to run_long, which copies them out where MKL cannot read them in place
  // (scattered pages, or bfloat16).
  std::vector<AdapterBuffer<W>> buffers(num_segments);
  std::vector<TiledSegment<W>> tiled, on_tiles, long_tiles;
  tiled.reserve(num_segments);
  std::vector<int64_t> small, large;
  int64_t max_row = in_features;
  const std::vector<int64_t>& out_widths = args.widths;
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t* m = meta_ptr + s * kMetaWidth;
    const int64_t num = bound_ptr[s * 4 + 1] - bound_ptr[s * 4];
    if (m[1] == 0 || num == 0) continue;
    // (offset in the adapter's layer buffer, elements) of A, then of each present B^T.
    std::pair<int64_t, int64_t> spans[1 + kMaxModules] = {{m[0], m[1] * in_features}};
    size_t num_spans = 1;
    for (int64_t module = 0; module < num_outputs; ++module) {
      const int64_t* mm = m + kModuleBase + kModuleStride * module;
      if (mm[1] == 0) continue;
      TORCH_CHECK(out_widths[module] == mm[3], "output ", module, " width does not match the adapter");
      spans[num_spans++] = {mm[2], mm[1] * mm[3]};
      max_row = std::max(max_row, mm[3]);
    }
    AdapterBuffer<W>& buffer = buffers[s];
    buffer.layer = layer_ptr;
    buffer.page_elems = page_elems;
    buffer.table = table_ptr + s * max_pages;
    int64_t end = 0;
    for (size_t i = 0; i < num_spans; ++i) end = std::max(end, spans[i].first + spans[i].second);
    TORCH_CHECK(end <= max_pages * page_elems, "adapter weights run past its page table");
    for (int64_t p = 0; p < (end + page_elems - 1) / page_elems; ++p) {  // every page read, checked
      TORCH_CHECK(buffer.table[p] >= 0 && buffer.table[p] < num_pages, "segment ", s, ": page id ", buffer.table[p],
                  " is outside the pool of ", num_pages, " pages");
    }
    TORCH_CHECK(bound_ptr[s * 4 + 2] != 0 || bound_ptr[s * 4 + 3] + end <= num_pages * page_elems,
                "segment ", s, ": its consecutive pages run past the pool");
    if (num <= kSmallSegment) {
      // Row by row through the page table even on consecutive pages: measured 2-3x faster
      // here than the same loops over one flat pointer, and ~2x faster than the tiled loops at
      // 1-2 tokens in the 1000-adapter benchmark.
      small.push_back(s);
      continue;
    }
    if (bound_ptr[s * 4 + 2] == 0) buffer.base = layer_ptr + bound_ptr[s * 4 + 3];
    const auto tiled_segment = [&](int64_t start, int64_t count) {
      TiledSegment<W> seg;
      seg.start = start;
      seg.num = count;
      seg.meta = m;
      seg.scale = scale_ptr + s * kMaxModules;
      seg.buffer = &buffer;
      return seg;
    };
    const bool amx = on_amx_tiles<W>(num, tile_lengths);
    if (num <= kTiledMax || amx) {
      const TiledSegment<W> seg = tiled_segment(bound_ptr[s * 4], num);
      (on_long_tiles<W>(num, in_features, tile_lengths) ? long_tiles : amx ? on_tiles : tiled).push_back(seg);
    } else if (on_loops(num, loop_lengths)) {  // pieces of equal length (within one token)
      const int64_t pieces = (num + kTiledMax - 1) / kTiledMax;
      for (int64_t p = 0, start = bound_ptr[s * 4]; p < pieces; ++p) {
        const int64_t count = num / pieces + (p < num % pieces ? 1 : 0);
        tiled.push_back(tiled_segment(start, count));
        start += count;
      }
    } else {
      large.push_back(s);
    }
  }
  if (!small.empty()) {
    const int num_threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(small.size())));
#pragma omp parallel num_threads(num_threads)
    {
      std::vector<float> tmp;
      std::vector<W> row_buf(max_row);
#pragma omp for schedule(dynamic, 1)
      for (size_t i = 0; i < small.size(); ++i) {
        const int64_t s = small[i];
        small_segment(x_ptr, in_features, buffers[s], meta_ptr + s * kMetaWidth, scale_ptr + s * kMaxModules,
                      bound_ptr[s * 4], bound_ptr[s * 4 + 1] - bound_ptr[s * 4], v_ptr, ldv, out_ptrs,
                      num_outputs, tmp, row_buf.data());
      }
    }
  }
  if (!tiled.empty()) {
    run_tiled(tiled, args.x_own, in_features, out_ptrs, out_widths.data(), num_outputs, rank_block, expand_pairs);
  }
  if (!large.empty()) {
    run_long(large, buffers, meta_ptr, scale_ptr, bound_ptr, x_ptr, in_features, v_ptr, ldv, out_ptrs,
             out_widths.data(), num_outputs);
  }
#if defined(LORASERVE_LORA_AMX)
  if constexpr (std::is_same_v<W, bf16_t>) {  // one after the other: both bind rows in the same scratch
    if (!on_tiles.empty()) {
      run_tiled_amx(on_tiles, args.x_own, in_features, out_ptrs, out_widths.data(), num_outputs, rank_block,
                    expand_pairs);
    }
    if (!long_tiles.empty()) run_long_amx(long_tiles, args.x_own, in_features, out_ptrs, out_widths.data(), num_outputs);
  }
#endif
  trim(shrunk);
}

}  // namespace

void lora_segments(const at::Tensor& x, const std::vector<at::Tensor>& outputs, const at::Tensor& storage,
                   int64_t layer, int64_t group, const at::Tensor& bounds, const at::Tensor& page_tables,
                   const at::Tensor& meta, const at::Tensor& scales, int64_t tile_lengths, int64_t loop_lengths,
                   int64_t expand_rank_block, bool expand_pairs) {
  const at::ScalarType dtype = storage.scalar_type();
  TORCH_CHECK((dtype == at::kFloat || dtype == at::kBFloat16) && x.scalar_type() == dtype,
              "lora_segments takes float32 or bfloat16: x and storage of one dtype");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [num_tokens, in_features]");
  TORCH_CHECK(storage.dim() == 3 && storage.is_contiguous(), "storage must be a contiguous [layers, pages, elems]");
  TORCH_CHECK(meta.dim() == 4 && meta.size(3) == kMetaWidth && meta.is_contiguous(), "meta: [L, G, S, 14] int64");
  TORCH_CHECK(scales.dim() == 4 && scales.size(3) == kMaxModules && scales.is_contiguous(), "scales: [L, G, S, 3]");
  TORCH_CHECK(bounds.dim() == 2 && bounds.size(1) == 4 && bounds.is_contiguous(), "bounds: [S, 4] int64");
  TORCH_CHECK(page_tables.dim() == 2 && page_tables.size(0) == bounds.size(0) && page_tables.is_contiguous() &&
                  page_tables.scalar_type() == at::kLong,
              "page_tables: [S, max_pages] int64");
  TORCH_CHECK(static_cast<int64_t>(outputs.size()) <= kMaxModules, "at most 3 outputs per group");
  TORCH_CHECK(expand_rank_block >= 0, "expand_rank_block must be 0 (the whole rank) or positive, got ",
              expand_rank_block);
  TORCH_CHECK(!expand_pairs || (kPairDots && dtype == at::kBFloat16),
              "expand_pairs takes a bfloat16 pool on a build with avx512_bf16 (lora_pair_dots())");
  for (const auto& out : outputs) {
    TORCH_CHECK(out.scalar_type() == dtype && out.is_contiguous() && out.size(0) == x.size(0),
                "outputs must be contiguous [num_tokens, out_features] of x's dtype");
  }
  const int64_t* bound_ptr = bounds.data_ptr<int64_t>();
  const int64_t num_segments = bounds.size(0);
  TORCH_CHECK(meta.scalar_type() == at::kLong && bounds.scalar_type() == at::kLong, "meta and bounds must be int64");
  TORCH_CHECK(scales.scalar_type() == at::kFloat, "scales must be float32");
  TORCH_CHECK(meta.size(2) == num_segments && scales.size(2) == num_segments,
              "meta and scales need one row per segment");
  TORCH_CHECK(0 <= layer && layer < meta.size(0) && layer < scales.size(0) && layer < storage.size(0), "layer ", layer,
              " is outside meta, scales or storage");
  TORCH_CHECK(0 <= group && group < meta.size(1) && group < scales.size(1), "group ", group,
              " is outside meta or scales");
  for (int64_t s = 0, end = 0; s < num_segments; end = bound_ptr[s * 4 + 1], ++s) {
    // In order and disjoint: threads write each segment's output rows, so overlaps would race.
    const int64_t first = bound_ptr[s * 4], last = bound_ptr[s * 4 + 1];
    TORCH_CHECK(end <= first && first <= last && last <= x.size(0), "segment ", s, ": tokens [", first, ", ", last,
                ") must follow the previous segment's and lie within x's ", x.size(0));
  }
  const auto run_as = [&](auto type) {
    using W = decltype(type);
    SegmentArgs<W> args;
    args.num_tokens = x.size(0);
    args.in_features = x.size(1);
    for (const auto& out : outputs) {
      args.widths.push_back(out.size(1));
      args.outs.push_back(static_cast<W*>(out.data_ptr()));
    }
    thread_local std::vector<float> wide_x;  // bfloat16: the segments' rows of x as float32, reused across calls
    if constexpr (std::is_same_v<W, float>) {
      args.x = x.data_ptr<float>();
      args.x_own = args.x;
    } else {
      float* x_ptr = at_least(wide_x, args.num_tokens * args.in_features);
      const W* x_rows = static_cast<const W*>(x.data_ptr());
      for (int64_t s = 0; s < num_segments; ++s) {
        const int64_t num = bound_ptr[s * 4 + 1] - bound_ptr[s * 4];
        if (!read_float_x<W>(num, tile_lengths, loop_lengths)) continue;  // read in place
        const int64_t first = bound_ptr[s * 4] * args.in_features, end = bound_ptr[s * 4 + 1] * args.in_features;
        widen_n(x_rows + first, end - first, x_ptr + first);
      }
      args.x = x_ptr;
      args.x_own = x_rows;
    }
    run_segments<W>(args, storage, layer, group, bounds, page_tables, meta, scales, tile_lengths, loop_lengths,
                    expand_rank_block, expand_pairs);
    trim(wide_x);
  };
  if (dtype == at::kFloat) return run_as(float{});
  run_as(bf16_t{});
}

// Whether long segments run as MKL grouped GEMMs (false: one ATen GEMM pair each); `enable` false
// forces the fallback (tests).
bool lora_grouped_gemm(bool enable) {
  use_grouped_gemm = enable;
  return grouped_gemm_available();
}

// Whether segments of 3 or more tokens over a bfloat16 pool can run on AMX tiles (compiled in, and
// the OS grants the tile state); each call's tile_lengths says which lengths do.
bool lora_amx() { return amx_available(); }

// Whether the tiled loops shrink a bfloat16 x over a bfloat16 pool by pair dots (lora_pair_dots.h):
// built in where the CPU has avx512_bf16 (the build targets its own CPU).
bool lora_pair_dots() { return kPairDots; }

// The upper bounds of the segment-length classes of tile_lengths and loop_lengths (the last class:
// every longer one).
std::vector<int64_t> lora_tile_length_bounds() {
  return std::vector<int64_t>(std::begin(kTileLengthBounds), std::end(kTileLengthBounds));
}

// The segment metadata layout these kernels read: {width, max modules, module base, module stride}.
std::vector<int64_t> lora_meta_layout() { return {kMetaWidth, kMaxModules, kModuleBase, kModuleStride}; }

// Segmented LoRA, short segments: their weight rows in place in an adapter's pages, and the split
// of their work across threads (included by lora_segments.cpp only; internal to it). The tile
// loops are in lora_tiles.h, the bfloat16 pair dots in lora_pair_dots.h.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "lora_pair_dots.h"
#include "lora_tiles.h"
#include "scratch.h"

namespace loraserve_lora {

// meta[layer, group, s] = [a_offset, num_rows, (column, rank, b_offset, out_features) x 3]: the
// layout defined in kernels/lora.py (SegmentMeta), checked against these by tests/test_lora_kernel.py.
constexpr int64_t kMaxModules = 3;
constexpr int64_t kModuleBase = 2;    // where module 0's fields start
constexpr int64_t kModuleStride = 4;  // column, rank, b_offset, out_features
constexpr int64_t kMetaWidth = kModuleBase + kModuleStride * kMaxModules;
// Segments of 3 up to this many tokens (decode steps, short prefills) run as the register-tiled
// loops below, which read each weight row of the segment's adapter once, in place in its pages;
// longer ones go to MKL's grouped GEMM, or to these loops in pieces of at most this many tokens
// where the call's loop_lengths says (lora_segments.cpp: on_loops). (Over a bfloat16 pool on AMX,
// segments of any length go to lora_amx.h instead.) Measured on SmolLM2 shapes (8 adapters, ranks 8-64, all
// four groups, weights cold in cache), tiled time / MKL time: 0.7 at 4 tokens per segment, 0.85
// at 8, about 1 at 24-32; on scattered pages, which MKL needs copied out first, 0.25-0.8.
constexpr int64_t kTiledMax = 32;

// One adapter's flat layer buffer through its page table (`table`, pages of `page_elems`
// elements starting at `layer`); `base` is its first element when the pages are consecutive.
// W: the pool's element type (float, or bf16_t).
template <typename W>
struct AdapterBuffer {
  const W* layer = nullptr;
  const W* base = nullptr;  // nullptr: scattered pages
  const int64_t* table = nullptr;
  int64_t page_elems = 0;

  bool crosses_page(int64_t f, int64_t n) const { return base == nullptr && f % page_elems + n > page_elems; }

  // Elements [f, f + n) of the buffer: in place when they lie in one page, else copied to `buf`.
  const W* span(int64_t f, int64_t n, W* buf) const {
    if (base != nullptr) return base + f;
    const int64_t offset = f % page_elems;
    if (offset + n <= page_elems) return layer + table[f / page_elems] * page_elems + offset;
    for (int64_t done = 0; done < n;) {
      const int64_t at = f + done, count = std::min(page_elems - at % page_elems, n - done);
      std::memcpy(buf + done, layer + table[at / page_elems] * page_elems + at % page_elems, count * sizeof(W));
      done += count;
    }
    return buf;
  }

  // dst[0:n] = elements [f, f + n) of the buffer as floats, page by page.
  void widen_to(int64_t f, int64_t n, float* dst) const {
    if (base != nullptr) return widen_n(base + f, n, dst);
    for (int64_t done = 0; done < n;) {
      const int64_t at = f + done, count = std::min(page_elems - at % page_elems, n - done);
      widen_n(layer + table[at / page_elems] * page_elems + at % page_elems, count, dst + done);
      done += count;
    }
  }
};

// A short segment: its tokens, metadata, adapter buffer and (once bound) its weight rows.
template <typename W>
struct TiledSegment {
  int64_t start = 0, num = 0;
  const int64_t* meta = nullptr;
  const float* scale = nullptr;
  const AdapterBuffer<W>* buffer = nullptr;
  const W* const* a_rows = nullptr;          // meta[1] row pointers
  const W* const* b_rows[kMaxModules] = {};  // each module's rank row pointers
};

// Elements of the rows, among `count` rows of `width` elements from element `offset` of `w`,
// that cross a page boundary (and so are copied to scratch).
template <typename W>
int64_t crossing_elements(const AdapterBuffer<W>& w, int64_t offset, int64_t count, int64_t width) {
  if (w.base != nullptr) return 0;
  int64_t total = 0;
  for (int64_t c = 0; c < count; ++c) total += w.crosses_page(offset + c * width, width) ? width : 0;
  return total;
}

// What bind_rows needs for a segment: {row pointers, scratch elements}.
template <typename W>
std::pair<int64_t, int64_t> rows_needed(const TiledSegment<W>& seg, int64_t in, int64_t num_outputs) {
  const int64_t* m = seg.meta;
  int64_t rows = m[1], crossing = crossing_elements(*seg.buffer, m[0], m[1], in);
  for (int64_t module = 0; module < num_outputs; ++module) {
    const int64_t* mm = m + kModuleBase + kModuleStride * module;
    rows += mm[1];
    if (mm[1] != 0) crossing += crossing_elements(*seg.buffer, mm[2], mm[1], mm[3]);
  }
  return {rows, crossing};
}

// Row pointers for `count` rows of `width` elements from element `offset` of `w` into `rows`;
// rows that cross a page boundary are copied to `scratch` (advanced past them).
template <typename W>
void collect_rows(const AdapterBuffer<W>& w, int64_t offset, int64_t count, int64_t width, const W** rows,
                  W*& scratch) {
  if (w.base != nullptr) {
    for (int64_t c = 0; c < count; ++c) rows[c] = w.base + offset + c * width;
    return;
  }
  for (int64_t c = 0; c < count; ++c) {
    rows[c] = w.span(offset + c * width, width, scratch);
    if (rows[c] == scratch) scratch += width;
  }
}

// Points seg's a_rows and b_rows at its weight rows, the pointers stored from `rows` on and the
// copied rows from `scratch` on (both with room for rows_needed; both advanced past what it used).
template <typename W>
void bind_rows(TiledSegment<W>& seg, int64_t in, int64_t num_outputs, const W**& rows, W*& scratch) {
  const int64_t* m = seg.meta;
  collect_rows(*seg.buffer, m[0], m[1], in, rows, scratch);
  seg.a_rows = rows;
  rows += m[1];
  for (int64_t module = 0; module < num_outputs; ++module) {
    const int64_t* mm = m + kModuleBase + kModuleStride * module;
    if (mm[1] == 0) continue;
    collect_rows(*seg.buffer, mm[2], mm[1], mm[3], rows, scratch);
    seg.b_rows[module] = rows;
    rows += mm[1];
  }
}

using loraserve_scratch::at_least;  // per-thread scratch (scratch.h)
using loraserve_scratch::line_start;
using loraserve_scratch::trim;

// A segment's weight elements per token (A's rows x inputs, plus each module's rank x outputs).
template <typename W>
int64_t work_per_token(const TiledSegment<W>& seg, int64_t in, const int64_t* out_widths, int64_t num_outputs) {
  int64_t work = seg.meta[1] * in;
  for (int64_t module = 0; module < num_outputs; ++module) {
    work += seg.meta[kModuleBase + 1 + kModuleStride * module] * out_widths[module];
  }
  return work;
}

// Binds every segment's rows (bind_rows) in scratch of the calling thread, kept across calls.
template <typename W>
void bind_all_rows(std::vector<TiledSegment<W>>& segs, int64_t in, int64_t num_outputs) {
  int64_t total_rows = 0, total_crossing = 0;
  for (const TiledSegment<W>& seg : segs) {
    const auto [num_rows, crossing] = rows_needed(seg, in, num_outputs);
    total_rows += num_rows;
    total_crossing += crossing;
  }
  thread_local std::vector<const W*> rows;
  thread_local std::vector<W> scratch;
  const W** row_ptr = at_least(rows, total_rows);
  W* scratch_ptr = at_least(scratch, total_crossing);
  for (TiledSegment<W>& seg : segs) bind_rows(seg, in, num_outputs, row_ptr, scratch_ptr);
}

// Output columns per expand work item: at most about kExpandBlock, a multiple of kExpandCols.
int64_t expand_chunk(int64_t width) {
  const int64_t chunks = (width + kExpandBlock - 1) / kExpandBlock;
  return (width / chunks + kExpandCols - 1) / kExpandCols * kExpandCols;
}

// Rows [c0, c1) of a segment's v (vt[row * ld_t + token], the segment's first token at column 0)
// from its tokens transposed in blocks of 8 (`xt`: [blocks, in, 8]).
template <typename W>
void shrink_rows(const TiledSegment<W>& seg, const float* xt, int64_t in, int64_t c0, int64_t c1, float* vt,
                 int64_t ld_t) {
  for (int64_t c = c0; c < c1; c += kShrinkRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kShrinkRows, c1 - c));
    const W* const* next = c + 2 * kShrinkRows <= seg.meta[1] ? seg.a_rows + c + kShrinkRows : nullptr;
    for (int64_t t = 0, b = 0; t < seg.num;) {
      const float* xb = xt + b * in * kShrinkBlock;
      float* vb = vt + c * ld_t + t;
      const W* const* pf = t == 0 ? next : nullptr;
      if (kShrinkBlocks == 2 && seg.num - t > kShrinkBlock) {  // two blocks, the second maybe partial
        const int tb = static_cast<int>(std::min<int64_t>(kShrinkBlock, seg.num - t - kShrinkBlock));
        with_rows<kShrinkRows>(rows, [&](auto r) {
          shrink_dispatch<decltype(r)::value, 2>(xb, in, seg.a_rows + c, vb, ld_t, tb, pf);
        });
        t += 2 * kShrinkBlock, b += 2;
      } else {
        const int tb = static_cast<int>(std::min<int64_t>(kShrinkBlock, seg.num - t));
        with_rows<kShrinkRows>(rows, [&](auto r) {
          shrink_dispatch<decltype(r)::value, 1>(xb, in, seg.a_rows + c, vb, ld_t, tb, pf);
        });
        t += kShrinkBlock, ++b;
      }
    }
  }
}

// Columns [o0, o1) of a segment's module output from its v (as shrink_rows left it), B's rows
// streamed `rank_block` at a time (expand_tile); by pair dots where `pairs` (v rounded to bfloat16:
// PairRows; the caller checks that the build has them and the pool is bfloat16).
template <typename W>
void expand_columns(const TiledSegment<W>& seg, int64_t module, int64_t o0, int64_t o1, const float* vt,
                    int64_t ld_t, W* out, int64_t width, float* tmp, int64_t rank_block, bool pairs) {
  const int64_t* mm = seg.meta + kModuleBase + kModuleStride * module;
  const int64_t column = mm[0], rank = mm[1];
  for_token_blocks(seg.num, [&](auto tb, int64_t t) {
    constexpr int TB = decltype(tb)::value;
    const float* v = vt + column * ld_t + t;
    W* dst = out + (seg.start + t) * width;
    const bool read_once = seg.num <= kTokenBlock;
#if defined(__AVX512BF16__) && defined(__AVX512VL__)
    if constexpr (std::is_same_v<W, bf16_t>) {
      if (pairs) {
        thread_local std::vector<uint32_t> paired;  // pair_up's v, reused across calls
        uint32_t* vp = at_least(paired, (rank + 1) / 2 * TB);
        pair_up<TB>(v, ld_t, rank, vp);
        return expand_tile<TB>(PairRows<TB>{vp, seg.b_rows[module]}, rank, o0, o1, seg.scale[module], dst,
                               width, tmp, rank_block, read_once);
      }
    }
#endif
    expand_tile<TB>(FloatRows<W>{v, ld_t, seg.b_rows[module]}, rank, o0, o1, seg.scale[module], dst, width, tmp,
                    rank_block, read_once);
  });
}

// Each thread takes whole segments when there are at least this many per thread (decode steps
// over many adapters): no barriers between the phases, and x, v and the output rows of a
// segment stay in one core's cache. With fewer, the phases are split across threads by rows of A
// and columns of the outputs.
constexpr int64_t kSegmentsPerThread = 4;

// All short segments of one call (their rows not yet bound), x [tokens, in] of the pool's type read
// in place; the expands stream B's rows `rank_block` at a time (expand_tile). Scratch is per thread
// and reused across calls: at small hidden sizes a call's setup costs as much as its arithmetic.
template <typename W>
void run_tiled(std::vector<TiledSegment<W>>& segs, const W* x, int64_t in, W* const* outs,
               const int64_t* out_widths, int64_t num_outputs, int64_t rank_block, bool pairs) {
  int64_t max_chunk = 0, max_rows = 0, total_blocks = 0, max_blocks = 0;
  for (int64_t module = 0; module < num_outputs; ++module) {
    max_chunk = std::max(max_chunk, expand_chunk(out_widths[module]));
  }
  thread_local std::vector<int64_t> first_block;  // each segment's first token block
  first_block.assign(segs.size() + 1, 0);
  for (size_t i = 0; i < segs.size(); ++i) {
    const int64_t blocks = (segs[i].num + kShrinkBlock - 1) / kShrinkBlock;
    first_block[i + 1] = first_block[i] + blocks;
    max_blocks = std::max(max_blocks, blocks);
    max_rows = std::max(max_rows, segs[i].meta[1]);
  }
  total_blocks = first_block.back();
  const int64_t* first = first_block.data();  // thread_locals are named outside parallel regions only
  const int64_t block_elems = in * kShrinkBlock;
  const int max_threads = at::get_num_threads();
  if (static_cast<int64_t>(segs.size()) >= kSegmentsPerThread * max_threads || max_threads == 1) {
    // Largest first, so that the threads' last segments are small ones and they finish together.
    thread_local std::vector<std::pair<int64_t, size_t>> by_work;  // (-work, segment)
    by_work.resize(segs.size());
    for (size_t i = 0; i < segs.size(); ++i) {
      by_work[i] = {-work_per_token(segs[i], in, out_widths, num_outputs), i};
    }
    std::sort(by_work.begin(), by_work.end());
    const std::pair<int64_t, size_t>* order = by_work.data();  // thread_locals are named outside the region only
#pragma omp parallel num_threads(max_threads)
    {
      // Each thread binds the rows of the segments it takes.
      thread_local std::vector<float> xt, vt, tmp;
      thread_local std::vector<W> scratch;
      thread_local std::vector<const W*> rows;
      float* xt_ptr = at_least(xt, max_blocks * block_elems);
      float* vt_ptr = at_least(vt, max_rows * max_blocks * kShrinkBlock);
      float* tmp_ptr = at_least(tmp, kTokenBlock * max_chunk);
#pragma omp for schedule(dynamic, 1)
      for (size_t i = 0; i < segs.size(); ++i) {
        TiledSegment<W> seg = segs[order[i].second];
        const auto [num_rows, crossing] = rows_needed(seg, in, num_outputs);
        const W** row_ptr = at_least(rows, num_rows);
        W* scratch_ptr = at_least(scratch, crossing);
        bind_rows(seg, in, num_outputs, row_ptr, scratch_ptr);
        const int64_t ld_t = (seg.num + kShrinkBlock - 1) / kShrinkBlock * kShrinkBlock;
        for (int64_t t = 0, b = 0; t < seg.num; t += kShrinkBlock, ++b) {
          transpose_block(x + (seg.start + t) * in, in, static_cast<int>(std::min<int64_t>(kShrinkBlock, seg.num - t)),
                          xt_ptr + b * block_elems);
        }
        shrink_rows(seg, xt_ptr, in, 0, seg.meta[1], vt_ptr, ld_t);
        for (int64_t module = 0; module < num_outputs; ++module) {
          if (seg.meta[kModuleBase + 1 + kModuleStride * module] == 0) continue;
          const int64_t width = out_widths[module], chunk = expand_chunk(width);
          for (int64_t o = 0; o < width; o += chunk) {
            expand_columns(seg, module, o, std::min(width, o + chunk), vt_ptr, ld_t, outs[module], width, tmp_ptr,
                           rank_block, pairs);
          }
        }
      }
    }
    return;
  }
  // Few segments: their rows bound here, tokens transposed per segment, then shrink items
  // (segment, up to 48 rows of A), then expand items (segment, module, up to 512 output columns),
  // each phase across threads; v is shared, transposed: vt[row, token] over all of the call's tokens.
  bind_all_rows(segs, in, num_outputs);
  std::vector<std::pair<int64_t, int64_t>> shrinks;            // (segment, first row)
  std::vector<std::tuple<int64_t, int64_t, int64_t>> expands;  // (segment, module, first column)
  int64_t num_tokens = 0;
  for (size_t i = 0; i < segs.size(); ++i) {
    for (int64_t c = 0; c < segs[i].meta[1]; c += kShrinkItemRows) shrinks.emplace_back(i, c);
    for (int64_t module = 0; module < num_outputs; ++module) {
      if (segs[i].meta[kModuleBase + 1 + kModuleStride * module] == 0) continue;
      const int64_t width = out_widths[module], chunk = expand_chunk(width);
      for (int64_t o = 0; o < width; o += chunk) expands.emplace_back(i, module, o);
    }
    num_tokens = std::max(num_tokens, segs[i].start + segs[i].num);
  }
  thread_local std::vector<float> transposed, shared_v;
  float* xt = at_least(transposed, total_blocks * block_elems);
  float* vt = at_least(shared_v, max_rows * num_tokens);
  const int64_t ld_t = num_tokens;
  const int64_t num_items = static_cast<int64_t>(std::max(shrinks.size(), expands.size()));
  const int num_threads = std::max(1, std::min<int>(max_threads, static_cast<int>(num_items)));
#pragma omp parallel num_threads(num_threads)
  {
    thread_local std::vector<float> tmp;
    float* tmp_ptr = at_least(tmp, kTokenBlock * max_chunk);
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < segs.size(); ++i) {
      for (int64_t t = 0, b = first[i]; t < segs[i].num; t += kShrinkBlock, ++b) {
        const int tb = static_cast<int>(std::min<int64_t>(kShrinkBlock, segs[i].num - t));
        transpose_block(x + (segs[i].start + t) * in, in, tb, xt + b * block_elems);
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < shrinks.size(); ++i) {
      const auto [s, c] = shrinks[i];
      const TiledSegment<W>& seg = segs[s];
      shrink_rows(seg, xt + first[s] * block_elems, in, c, std::min(seg.meta[1], c + kShrinkItemRows),
                  vt + seg.start, ld_t);
    }
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < expands.size(); ++i) {
      const auto [s, module, o] = expands[i];
      const int64_t width = out_widths[module];
      expand_columns(segs[s], module, o, std::min(width, o + expand_chunk(width)), vt + segs[s].start, ld_t,
                     outs[module], width, tmp_ptr, rank_block, pairs);
    }
  }
}

}  // namespace loraserve_lora

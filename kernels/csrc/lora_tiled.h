// Segmented LoRA, short segments: their weight rows in place in an adapter's pages, and the split
// of their work across threads (included by lora_segments.cpp only; internal to it). The tile
// loops are in lora_tiles.h.
#pragma once

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "lora_tiles.h"

namespace loraserve_lora {

// meta[layer, group, s] = [a_offset, num_rows, (column, rank, b_offset, out_features) x 3]: the
// layout defined in kernels/lora.py (SegmentMeta), checked against these by tests/test_lora_kernel.py.
constexpr int64_t kMaxModules = 3;
constexpr int64_t kModuleBase = 2;    // where module 0's fields start
constexpr int64_t kModuleStride = 4;  // column, rank, b_offset, out_features
constexpr int64_t kMetaWidth = kModuleBase + kModuleStride * kMaxModules;
// Segments of 3 up to this many tokens (decode steps, short prefills) run as the register-tiled
// loops below, which read each weight row of the segment's adapter once, in place in its pages;
// longer ones go to MKL's grouped GEMM. Measured on SmolLM2 shapes (8 adapters, ranks 8-64, all
// four groups, weights cold in cache), tiled time / MKL time: 0.7 at 4 tokens per segment, 0.85
// at 8, about 1 at 24-32; on scattered pages, which MKL needs copied out first, 0.25-0.8.
constexpr int64_t kTiledMax = 32;

// One adapter's flat layer buffer through its page table (`table`, pages of `page_elems`
// elements starting at `layer`); `base` is its first element when the pages are consecutive.
struct AdapterBuffer {
  const float* layer = nullptr;
  const float* base = nullptr;  // nullptr: scattered pages
  const int64_t* table = nullptr;
  int64_t page_elems = 0;

  bool crosses_page(int64_t f, int64_t n) const { return base == nullptr && f % page_elems + n > page_elems; }

  // Elements [f, f + n) of the buffer: in place when they lie in one page, else copied to `buf`.
  const float* span(int64_t f, int64_t n, float* buf) const {
    if (base != nullptr) return base + f;
    const int64_t offset = f % page_elems;
    if (offset + n <= page_elems) return layer + table[f / page_elems] * page_elems + offset;
    for (int64_t done = 0; done < n;) {
      const int64_t at = f + done, count = std::min(page_elems - at % page_elems, n - done);
      std::memcpy(buf + done, layer + table[at / page_elems] * page_elems + at % page_elems, count * sizeof(float));
      done += count;
    }
    return buf;
  }
};

// A short segment's weight rows, in place (or copied when a row crosses a page boundary).
struct TiledSegment {
  int64_t start = 0, num = 0;
  const int64_t* meta = nullptr;
  const float* scale = nullptr;
  std::vector<const float*> a_rows;
  std::vector<const float*> b_rows[kMaxModules];
};

// Row pointers for `count` rows of `width` elements from element `offset` of `w`; rows that
// cross a page boundary are copied to `scratch` (advanced past them).
void collect_rows(const AdapterBuffer& w, int64_t offset, int64_t count, int64_t width,
                  std::vector<const float*>& rows, float*& scratch) {
  rows.resize(count);
  for (int64_t c = 0; c < count; ++c) {
    const int64_t f = offset + c * width;
    rows[c] = w.span(f, width, scratch);
    if (rows[c] == scratch) scratch += width;
  }
}

int64_t crossing_elements(const AdapterBuffer& w, int64_t offset, int64_t count, int64_t width) {
  int64_t total = 0;
  for (int64_t c = 0; c < count; ++c) total += w.crosses_page(offset + c * width, width) ? width : 0;
  return total;
}

// Output columns per expand work item: at most about kExpandBlock, a multiple of kExpandCols.
int64_t expand_chunk(int64_t width) {
  const int64_t chunks = (width + kExpandBlock - 1) / kExpandBlock;
  return (width / chunks + kExpandCols - 1) / kExpandCols * kExpandCols;
}

// Rows [c0, c1) of a segment's v (vt[row * ld_t + token], the segment's first token at column 0)
// from its tokens transposed in blocks of 8 (`xt`: [blocks, in, 8]).
inline void shrink_rows(const TiledSegment& seg, const float* xt, int64_t in, int64_t c0, int64_t c1, float* vt,
                        int64_t ld_t) {
  for (int64_t c = c0; c < c1; c += kShrinkRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kShrinkRows, c1 - c));
    const float* const* next = c + 2 * kShrinkRows <= seg.meta[1] ? seg.a_rows.data() + c + kShrinkRows : nullptr;
    for (int64_t t = 0, b = 0; t < seg.num;) {
      const float* xb = xt + b * in * kShrinkBlock;
      float* vb = vt + c * ld_t + t;
      const float* const* pf = t == 0 ? next : nullptr;
      if (kShrinkBlocks == 2 && seg.num - t > kShrinkBlock) {  // two blocks, the second maybe partial
        const int tb = static_cast<int>(std::min<int64_t>(kShrinkBlock, seg.num - t - kShrinkBlock));
        with_rows<kShrinkRows>(rows, [&](auto r) {
          shrink_tile<decltype(r)::value, 2>(xb, in, seg.a_rows.data() + c, vb, ld_t, tb, pf);
        });
        t += 2 * kShrinkBlock, b += 2;
      } else {
        const int tb = static_cast<int>(std::min<int64_t>(kShrinkBlock, seg.num - t));
        with_rows<kShrinkRows>(rows, [&](auto r) {
          shrink_tile<decltype(r)::value, 1>(xb, in, seg.a_rows.data() + c, vb, ld_t, tb, pf);
        });
        t += kShrinkBlock, ++b;
      }
    }
  }
}

// Columns [o0, o1) of a segment's module output from its v (as shrink_rows left it).
inline void expand_columns(const TiledSegment& seg, int64_t module, int64_t o0, int64_t o1, const float* vt,
                           int64_t ld_t, float* out, int64_t width, float* tmp) {
  const int64_t* mm = seg.meta + kModuleBase + kModuleStride * module;
  const int64_t column = mm[0], rank = mm[1];
  for_token_blocks(seg.num, [&](auto tb, int64_t t) {
    expand_tile<decltype(tb)::value>(vt + column * ld_t + t, ld_t, seg.b_rows[module].data(), rank, o0, o1,
                                     seg.scale[module], out + (seg.start + t) * width, width, tmp,
                                     seg.num <= kTokenBlock);
  });
}

// Each thread takes whole segments when there are at least this many per thread (decode steps
// over many adapters): no barriers between the phases, and x, v and the output rows of a
// segment stay in one core's cache. With fewer, the phases are split across threads by rows of A
// and columns of the outputs.
constexpr int64_t kSegmentsPerThread = 4;

// All short segments of one call.
void run_tiled(const std::vector<TiledSegment>& segs, const float* x, int64_t in, float* const* outs,
               const int64_t* out_widths, int64_t num_outputs) {
  int64_t max_chunk = 0, max_rows = 0, total_blocks = 0, max_blocks = 0;
  for (int64_t module = 0; module < num_outputs; ++module) {
    max_chunk = std::max(max_chunk, expand_chunk(out_widths[module]));
  }
  std::vector<int64_t> first_block(segs.size() + 1, 0);  // each segment's first token block
  for (size_t i = 0; i < segs.size(); ++i) {
    const int64_t blocks = (segs[i].num + kShrinkBlock - 1) / kShrinkBlock;
    first_block[i + 1] = first_block[i] + blocks;
    max_blocks = std::max(max_blocks, blocks);
    max_rows = std::max(max_rows, segs[i].meta[1]);
  }
  total_blocks = first_block.back();
  const int64_t block_elems = in * kShrinkBlock;
  const int max_threads = at::get_num_threads();
  if (static_cast<int64_t>(segs.size()) >= kSegmentsPerThread * max_threads || max_threads == 1) {
    // Largest first, so that the threads' last segments are small ones and they finish together.
    std::vector<int64_t> work(segs.size());
    for (size_t i = 0; i < segs.size(); ++i) {
      work[i] = segs[i].meta[1] * in;
      for (int64_t module = 0; module < num_outputs; ++module) {
        work[i] += segs[i].meta[kModuleBase + 1 + kModuleStride * module] * out_widths[module];
      }
    }
    std::vector<size_t> by_work(segs.size());
    for (size_t i = 0; i < segs.size(); ++i) by_work[i] = i;
    std::stable_sort(by_work.begin(), by_work.end(), [&](size_t a, size_t b) { return work[a] > work[b]; });
#pragma omp parallel num_threads(max_threads)
    {
      std::vector<float> xt(max_blocks * block_elems), vt(max_rows * max_blocks * kShrinkBlock),
          tmp(kTokenBlock * max_chunk);
#pragma omp for schedule(dynamic, 1)
      for (size_t i = 0; i < segs.size(); ++i) {
        const TiledSegment& seg = segs[by_work[i]];
        const int64_t ld_t = (seg.num + kShrinkBlock - 1) / kShrinkBlock * kShrinkBlock;
        for (int64_t t = 0, b = 0; t < seg.num; t += kShrinkBlock, ++b) {
          transpose_tokens(x + (seg.start + t) * in, in, static_cast<int>(std::min<int64_t>(kShrinkBlock, seg.num - t)),
                           xt.data() + b * block_elems);
        }
        shrink_rows(seg, xt.data(), in, 0, seg.meta[1], vt.data(), ld_t);
        for (int64_t module = 0; module < num_outputs; ++module) {
          if (seg.meta[kModuleBase + 1 + kModuleStride * module] == 0) continue;
          const int64_t width = out_widths[module], chunk = expand_chunk(width);
          for (int64_t o = 0; o < width; o += chunk) {
            expand_columns(seg, module, o, std::min(width, o + chunk), vt.data(), ld_t, outs[module], width,
                           tmp.data());
          }
        }
      }
    }
    return;
  }
  // Few segments: tokens transposed per segment, then shrink items (segment, up to 48 rows of A),
  // then expand items (segment, module, up to 512 output columns), each phase across threads; v
  // is shared, transposed: vt[row, token] over all of the call's tokens.
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
  thread_local std::vector<float> transposed, shared_v;  // grow to the largest need, then reused
  if (static_cast<int64_t>(transposed.size()) < total_blocks * block_elems) transposed.resize(total_blocks * block_elems);
  if (static_cast<int64_t>(shared_v.size()) < max_rows * num_tokens) shared_v.resize(max_rows * num_tokens);
  float* xt = transposed.data();
  float* vt = shared_v.data();
  const int64_t ld_t = num_tokens;
  const int64_t num_items = static_cast<int64_t>(std::max(shrinks.size(), expands.size()));
  const int num_threads = std::max(1, std::min<int>(max_threads, static_cast<int>(num_items)));
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> tmp(kTokenBlock * max_chunk);
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < segs.size(); ++i) {
      for (int64_t t = 0, b = first_block[i]; t < segs[i].num; t += kShrinkBlock, ++b) {
        const int tb = static_cast<int>(std::min<int64_t>(kShrinkBlock, segs[i].num - t));
        transpose_tokens(x + (segs[i].start + t) * in, in, tb, xt + b * block_elems);
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < shrinks.size(); ++i) {
      const auto [s, c] = shrinks[i];
      const TiledSegment& seg = segs[s];
      shrink_rows(seg, xt + first_block[s] * block_elems, in, c, std::min(seg.meta[1], c + kShrinkItemRows),
                  vt + seg.start, ld_t);
    }
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < expands.size(); ++i) {
      const auto [s, module, o] = expands[i];
      const int64_t width = out_widths[module];
      expand_columns(segs[s], module, o, std::min(width, o + expand_chunk(width)), vt + segs[s].start, ld_t,
                     outs[module], width, tmp.data());
    }
  }
}

}  // namespace loraserve_lora

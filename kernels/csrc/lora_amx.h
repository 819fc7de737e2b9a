// Segmented LoRA over a bfloat16 pool on AMX tiles (CPUs with amx_bf16 and avx512_bf16; built in
// where -march=native has them, used where the OS grants the tile state): the split of the work
// across threads. Included by lora_segments.cpp only; internal to it. The tile loops are in
// lora_amx_tiles.h. Every segment of 3 or more tokens whose length class the call puts on the
// tiles (tile_lengths) shrinks on them; of those, segments of up to kVectorExpandMax tokens expand
// on the vector loops of lora_tiles.h, longer ones on the tiles. (Segments that on_long_tiles
// takes, 32 or more tokens, run in lora_amx_long.h instead.)
#pragma once

#include <iterator>

#include "lora_amx_tiles.h"

#if defined(LORASERVE_LORA_AMX)
namespace loraserve_lora {

// Whether the tiles may be used (the OS granted the tile state).
inline bool amx_available() { return loraserve_amx::amx_permitted(); }

constexpr int64_t kAmxShrinkRows = 64;  // A rows per shrink work item
// Segments of up to this many tokens expand on the vector loops, longer ones on the tiles: the
// tiles' expand must first interleave B^T's rank rows, which one vector block of tokens does not
// repay (measured: level at 8 tokens, the tiles ahead from 12).
constexpr int64_t kVectorExpandMax = kTokenBlock;

// All segments of one call of 3 or more tokens (rows not yet bound), x the call's bfloat16 rows
// (read in place: packed into pairs per 16 tokens). With at least
// kSegmentsPerThread segments per thread, none with more than a thread's share of the work, each
// thread takes whole segments, largest first, v in its own buffer. Else the phases are split
// across threads, with v shared (vt[row * ld_t + token] over the call's tokens): tokens packed by
// (segment, up to 256 tokens), shrink items (segment, 64 rows of A, up to 256 tokens), expand
// items (segment, module, up to 512 output columns, up to 256 tokens). The expand of segments of at
// most kVectorExpandMax tokens runs on the vector loops with the call's `rank_block` and `expand_pairs`.
inline void run_tiled_amx(std::vector<TiledSegment<bf16_t>>& segs, const bf16_t* x, int64_t in,
                          bf16_t* const* outs, const int64_t* out_widths, int64_t num_outputs, int64_t rank_block,
                          bool expand_pairs) {
  int64_t max_rows = 0, max_rank = 0, max_num = 0, num_tokens = 0, max_chunk = 0, total_work = 0;
  std::vector<int64_t> first_block(segs.size() + 1, 0);  // each segment's first block of 16 tokens
  for (size_t i = 0; i < segs.size(); ++i) {
    const TiledSegment<bf16_t>& seg = segs[i];
    max_rows = std::max(max_rows, seg.meta[1]);
    for (int64_t module = 0; module < num_outputs; ++module) {
      max_rank = std::max(max_rank, seg.meta[kModuleBase + 1 + kModuleStride * module]);
    }
    max_num = std::max(max_num, seg.num);
    num_tokens = std::max(num_tokens, seg.start + seg.num);
    first_block[i + 1] = first_block[i] + (seg.num + kTileRows - 1) / kTileRows;
  }
  for (int64_t module = 0; module < num_outputs; ++module) {
    max_chunk = std::max(max_chunk, expand_chunk(out_widths[module]));
  }
  bind_all_rows(segs, in, num_outputs);
  std::vector<std::pair<int64_t, size_t>> by_work(segs.size());  // (-work, segment): largest first
  for (size_t i = 0; i < segs.size(); ++i) {
    const int64_t work = work_per_token(segs[i], in, out_widths, num_outputs) * segs[i].num;
    by_work[i] = {-work, i};
    total_work += work;
  }
  std::sort(by_work.begin(), by_work.end());
  const int max_threads = at::get_num_threads();
  const bool whole = static_cast<int64_t>(segs.size()) >= kSegmentsPerThread * max_threads &&
                     -by_work.front().first * max_threads <= total_work;
  std::vector<std::pair<int64_t, int64_t>> packs;                       // (segment, first block)
  std::vector<std::tuple<int64_t, int64_t, int64_t>> shrinks;           // (segment, first row, first block)
  std::vector<std::tuple<int64_t, int64_t, int64_t, int64_t>> expands;  // (segment, module, column, block)
  for (size_t i = 0; i < segs.size() && !whole; ++i) {  // the split phases' work items
    const int64_t s = static_cast<int64_t>(i), blocks = first_block[i + 1] - first_block[i];
    for (int64_t b = 0; b < blocks; b += kItemBlocks) {
      packs.emplace_back(s, b);
      for (int64_t c = 0; c < segs[i].meta[1]; c += kAmxShrinkRows) shrinks.emplace_back(s, c, b);
    }
    for (int64_t module = 0; module < num_outputs; ++module) {
      if (segs[i].meta[kModuleBase + 1 + kModuleStride * module] == 0) continue;
      const int64_t width = out_widths[module], chunk = expand_chunk(width);
      for (int64_t o = 0; o < width; o += chunk) {
        for (int64_t b = 0; b < blocks; b += kItemBlocks) expands.emplace_back(s, module, o, b);
      }
    }
  }
  const int64_t kpad = padded(in, kTileTerms), block_words = kpad / 2 * kTileRows;
  const int64_t rank_pad = padded(max_rank, kTileTerms);
  const int64_t item_tokens = std::min(padded(max_num, kTileRows), kItemBlocks * kTileRows);
  thread_local std::vector<uint32_t> pairs;
  thread_local std::vector<float> shared_v;
  uint32_t* xp = at_least(pairs, first_block.back() * block_words);
  float* vt = whole ? nullptr : at_least(shared_v, max_rows * num_tokens);
  const int64_t num_items = whole ? static_cast<int64_t>(segs.size())
                                  : static_cast<int64_t>(std::max(shrinks.size(), expands.size()));
  const int num_threads = std::max(1, std::min<int>(max_threads, static_cast<int>(num_items)));
  const int64_t* first = first_block.data();
  // Token blocks [b, b + kItemBlocks) of segment i packed as pairs.
  const auto pack = [&](int64_t i, int64_t b) {
    for (int64_t t = b * kTileRows; t < std::min(segs[i].num, (b + kItemBlocks) * kTileRows); t += kTileRows) {
      const int num = static_cast<int>(std::min<int64_t>(kTileRows, segs[i].num - t));
      const bf16_t* tokens[kTileRows];
      for (int n = 0; n < num; ++n) tokens[n] = x + (segs[i].start + t + n) * in;
      pack_pairs(tokens, num, in, xp + (first[i] + t / kTileRows) * block_words);
    }
  };
  // Columns [o, o + chunk) of a module for token blocks [b, b + kItemBlocks), from v (v_at[row * ld
  // + token], the segment's first token at 0).
  const auto expand = [&](int64_t i, int64_t module, int64_t o, int64_t b, const float* v_at, int64_t ld, float* tmp,
                          const ExpandScratch& scratch) {
    const int64_t width = out_widths[module], o1 = std::min(width, o + expand_chunk(width));
    if (segs[i].num > kVectorExpandMax) {
      const int64_t b1 = std::min(first[i + 1] - first[i], b + kItemBlocks);
      return amx_expand(segs[i], module, o, o1, b, b1, v_at, ld, outs[module], width, scratch);
    }
    expand_columns(segs[i], module, o, o1, v_at, ld, outs[module], width, tmp, rank_block, expand_pairs);
  };
#pragma omp parallel num_threads(num_threads)
  {
    thread_local std::vector<bf16_t> a_block, v_parts, b_pairs;
    thread_local std::vector<float> tile_out, tmp;
    bf16_t* a_ptr = at_least(a_block, kTileRows * kpad);
    float* tmp_ptr = at_least(tmp, kTokenBlock * max_chunk);
    const ExpandScratch scratch{at_least(v_parts, 2 * item_tokens * rank_pad),
                                at_least(b_pairs, kStripCols / kTileTerms * rank_pad * kTileTerms),
                                at_least(tile_out, kTileRows * kStripCols)};
    configure_tiles();
    if (whole) {
      thread_local std::vector<float> own_v;
      float* own = at_least(own_v, max_rows * padded(max_num, kTileRows));
#pragma omp for schedule(dynamic, 1)
      for (size_t k = 0; k < segs.size(); ++k) {
        const int64_t i = static_cast<int64_t>(by_work[k].second), blocks = first[i + 1] - first[i];
        const int64_t ld = blocks * kTileRows;
        for (int64_t b = 0; b < blocks; b += kItemBlocks) pack(i, b);
        amx_shrink(segs[i], xp + first[i] * block_words, in, 0, segs[i].meta[1], 0, blocks, own, ld, a_ptr,
                   scratch.c_rows);
        for (int64_t module = 0; module < num_outputs; ++module) {
          if (segs[i].meta[kModuleBase + 1 + kModuleStride * module] == 0) continue;
          for (int64_t o = 0; o < out_widths[module]; o += expand_chunk(out_widths[module])) {
            for (int64_t b = 0; b < blocks; b += kItemBlocks) expand(i, module, o, b, own, ld, tmp_ptr, scratch);
          }
        }
      }
      trim(own_v);
    } else {
#pragma omp for schedule(dynamic, 1)
      for (size_t k = 0; k < packs.size(); ++k) pack(packs[k].first, packs[k].second);
#pragma omp for schedule(dynamic, 1)
      for (size_t k = 0; k < shrinks.size(); ++k) {
        const auto [i, c, b] = shrinks[k];
        const int64_t b1 = std::min(first[i + 1] - first[i], b + kItemBlocks);
        amx_shrink(segs[i], xp + first[i] * block_words, in, c, std::min(segs[i].meta[1], c + kAmxShrinkRows), b, b1,
                   vt + segs[i].start, num_tokens, a_ptr, scratch.c_rows);
      }
#pragma omp for schedule(dynamic, 1)
      for (size_t k = 0; k < expands.size(); ++k) {
        const auto [i, module, o, b] = expands[k];
        expand(i, module, o, b, vt + segs[i].start, num_tokens, tmp_ptr, scratch);
      }
    }
    _tile_release();
  }
  trim(pairs);
  trim(shared_v);
}

}  // namespace loraserve_lora

#else
namespace loraserve_lora {
inline bool amx_available() { return false; }
}  // namespace loraserve_lora
#endif

namespace loraserve_lora {

// The segment-length classes of the choice between the tiles and the vector loops (and MKL):
// class c holds segments of up to kTileLengthBounds[c] tokens (and more than the class before);
// the last class, kNumTileLengthClasses - 1, every longer one. Segments of 1-2 tokens never
// reach the tiles. Bit c of a call's `tile_lengths` puts class c on the tiles; bit c of its
// `loop_lengths`, a class of more than 32 tokens off the tiles on the vector loops (in pieces)
// instead of MKL (lora_segments.cpp: on_loops).
constexpr int64_t kTileLengthBounds[] = {8, 16, 32, 64, 128, 256, 512};
constexpr int kNumTileLengthClasses = static_cast<int>(std::size(kTileLengthBounds)) + 1;

inline int tile_length_class(int64_t num) {
  int c = 0;
  while (c < kNumTileLengthClasses - 1 && num > kTileLengthBounds[c]) ++c;
  return c;
}

// Whether a segment of `num` tokens over a pool of W runs on AMX tiles: a bfloat16 pool, the tiles
// at hand, and its length class chosen for the tiles in `tile_lengths`.
template <typename W>
bool on_amx_tiles(int64_t num, int64_t tile_lengths) {
  return std::is_same_v<W, bf16_t> && ((tile_lengths >> tile_length_class(num)) & 1) != 0 && amx_available();
}

}  // namespace loraserve_lora

// Segmented LoRA over a bfloat16 pool on AMX tiles, long segments (prefill chunks): tokens as the
// tiles' rows, so that x is read in place and v and the outputs are token-major (included by
// lora_segments.cpp only; internal to it).
//
//   shrink:  v[t, c] = sum_k x[t, k] A[c, k]     16 tokens x 32 terms of x in place (an A tile);
//                                                16 rows of A packed in pairs once per segment
//   expand:  out[t, o] += scale * sum_r v[t, r] B^T[r, o]
//            v as [hi | lo] bfloat16 parts along the rank (v ~ hi + lo, ~16 of v's 24 bits), so
//            each product tile sums both over one K; B^T's rank rows packed in pairs once a call
//
// Sums in float32, each output rounded once to bfloat16 (as lora_amx_tiles.h, whose layout reads
// x through a transposed copy and is kept for segments too short to repay the packing of A).
#pragma once

#include "lora_amx_tiles.h"

#if defined(LORASERVE_LORA_AMX)
namespace loraserve_lora {

// Segments of at least this many tokens take these loops where x's rows are whole tile rows
// (in_features a multiple of 32); figures in benchmarks/RESULTS.md.
constexpr int64_t kLongTilesMin = 32;
constexpr int64_t kLongShrinkBlocks = 4;  // token blocks of 16 per shrink work item
constexpr int64_t kLongPassCols = 64;     // output columns per pass: 4 accumulator tiles
constexpr int64_t kLongItemCols = 256;    // B^T columns per packing work item

inline bool long_tiles_fit(int64_t num, int64_t in) { return num >= kLongTilesMin && in % kTileTerms == 0; }

// Where one long segment's data sits in the call's scratch.
struct LongSlot {
  int64_t rows_pad = 0;  // A's rows padded to 16
  uint32_t* a_pairs = nullptr;  // [rows_pad / 16][in / 32][16 pairs][16 rows]
  float* v = nullptr;           // [padded tokens][rows_pad]
  bf16_t* parts[kMaxModules] = {};  // each module's [padded tokens][2 * rank_pad]: hi then lo
  bf16_t* b_pairs[kMaxModules] = {};  // each module's B^T pairs (pack_b_pairs)
  int64_t rank_pad[kMaxModules] = {};
};

// v rows of token blocks [b0, b1) of the segment (x: its first row, stride `in`), then each
// module's hi/lo parts of them. A partial last block is copied (zero-padded) to `edge` [16, in].
inline void long_shrink(const TiledSegment<bf16_t>& seg, const LongSlot& slot, const bf16_t* x, int64_t in,
                        int64_t num_outputs, int64_t b0, int64_t b1, bf16_t* edge) {
  const int64_t x_stride = in * sizeof(bf16_t), chunk_words = kTileTerms / 2 * kTileRows;
  const int64_t group_words = in / 2 * kTileRows, v_stride = slot.rows_pad * sizeof(float);
  const auto block_rows = [&](int64_t b) -> const bf16_t* {
    const int64_t t0 = b * kTileRows, tokens = std::min<int64_t>(kTileRows, seg.num - t0);
    if (tokens == kTileRows) return x + t0 * in;
    std::memset(edge, 0, kTileRows * in * sizeof(bf16_t));
    std::memcpy(edge, x + t0 * in, tokens * in * sizeof(bf16_t));
    return edge;  // (only the segment's last block is partial)
  };
  for (int64_t b = b0; b < b1; b += 2) {
    const bool two = b + 1 < b1;
    const bf16_t* x0 = block_rows(b);
    const bf16_t* x1 = two ? block_rows(b + 1) : nullptr;
    for (int64_t g = 0; g < slot.rows_pad / kTileRows; g += 2) {
      const bool pair = g + 1 < slot.rows_pad / kTileRows;
      const uint32_t* a0 = slot.a_pairs + g * group_words;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t k = 0; k < in; k += kTileTerms) {
        _tile_loadd(4, x0 + k, x_stride);
        _tile_loadd(6, a0 + k / kTileTerms * chunk_words, kTileRows * sizeof(uint32_t));
        _tile_dpbf16ps(0, 4, 6);
        if (pair) {
          _tile_loadd(7, a0 + group_words + k / kTileTerms * chunk_words, kTileRows * sizeof(uint32_t));
          _tile_dpbf16ps(1, 4, 7);
        }
        if (two) {
          _tile_loadd(5, x1 + k, x_stride);
          _tile_dpbf16ps(2, 5, 6);
          if (pair) _tile_dpbf16ps(3, 5, 7);
        }
      }
      float* v0 = slot.v + b * kTileRows * slot.rows_pad + g * kTileRows;
      _tile_stored(0, v0, v_stride);
      if (pair) _tile_stored(1, v0 + kTileRows, v_stride);
      if (two) _tile_stored(2, v0 + kTileRows * slot.rows_pad, v_stride);
      if (two && pair) _tile_stored(3, v0 + kTileRows * slot.rows_pad + kTileRows, v_stride);
    }
  }
  // hi/lo parts (lo = v - hi rounded; zero where hi is not finite, so an infinite v stays one)
  const __m256i exponent = _mm256_set1_epi16(0x7F80);
  for (int64_t module = 0; module < num_outputs; ++module) {
    const int64_t* mm = seg.meta + kModuleBase + kModuleStride * module;
    const int64_t column = mm[0], rank = mm[1], rank_pad = slot.rank_pad[module];
    if (rank == 0) continue;
    for (int64_t t = b0 * kTileRows; t < b1 * kTileRows; ++t) {
      const float* v_row = slot.v + t * slot.rows_pad + column;
      bf16_t* hi = slot.parts[module] + t * 2 * rank_pad;
      for (int64_t r = 0; r < rank_pad; r += 16) {
        const __mmask16 live = r + 16 <= rank ? 0xFFFF : r >= rank ? 0 : (1u << (rank - r)) - 1;
        const __m512 v = _mm512_maskz_loadu_ps(live, v_row + r);
        const __m256i h = (__m256i)_mm512_cvtneps_pbh(v);
        const __m512 rest = _mm512_sub_ps(v, _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16)));
        const __mmask16 finite = _mm256_cmpneq_epi16_mask(_mm256_and_si256(h, exponent), exponent);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + r), h);
        _mm256_storeu_si256(reinterpret_cast<__m256i*>(hi + rank_pad + r),
                            _mm256_maskz_mov_epi16(finite, (__m256i)_mm512_cvtneps_pbh(rest)));
      }
    }
  }
}

// B^T's rank pairs of a module for columns [o0, o1) (a multiple of 32 from the module's first):
// `pairs` is the module's [32-column steps][rank chunks][2 tiles].
inline void pack_b_pairs(const TiledSegment<bf16_t>& seg, const LongSlot& slot, int64_t module, int64_t o0,
                         int64_t o1, bf16_t* pairs) {
  const int64_t rank = seg.meta[kModuleBase + 1 + kModuleStride * module], chunks = slot.rank_pad[module] / kTileTerms;
  constexpr int64_t kTile = kTileRows * kTileTerms, kStep = 2 * kTileRows;  // elements a tile; columns a step
  for (int64_t o = o0; o < o1; o += kStep) {
    for (int64_t rc = 0; rc < chunks; ++rc) {
      bf16_t* tiles = pairs + (o / kStep * chunks + rc) * 2 * kTile;
      pack_rank_pairs(seg.b_rows[module], rank, rc * kTileTerms, o, std::min(kStep, o1 - o), tiles, tiles + kTile);
    }
  }
}

// out[t, :] += scale * v_m[t] @ B_m^T for the segment's token blocks [b0, b1) over all the
// module's columns, 64 a pass; `c_rows` holds one pass's sums [16, 64].
inline void long_expand(const TiledSegment<bf16_t>& seg, const LongSlot& slot, int64_t module, int64_t b0, int64_t b1,
                        bf16_t* out, int64_t width, float* c_rows) {
  const int64_t rank_pad = slot.rank_pad[module], chunks = rank_pad / kTileTerms;
  constexpr int64_t kTile = kTileRows * kTileTerms, kStep = 2 * kTileRows;
  const bf16_t* parts = slot.parts[module];
  const int64_t part_stride = 2 * rank_pad * sizeof(bf16_t), b_stride = kTileTerms * sizeof(bf16_t);
  const int64_t step_elems = chunks * 2 * kTile;
  constexpr int64_t c_stride = kLongPassCols * sizeof(float);
  for (int64_t b = b0; b < b1; ++b) {
    const int64_t t0 = b * kTileRows, tokens = std::min<int64_t>(kTileRows, seg.num - t0);
    for (int64_t p = 0; p < width; p += kLongPassCols) {
      const int64_t cols = std::min(kLongPassCols, width - p), tiles_used = (cols + kTileRows - 1) / kTileRows;
      const bf16_t* pass = slot.b_pairs[module] + p / kStep * step_elems;
      _tile_zero(0);
      _tile_zero(1);
      _tile_zero(2);
      _tile_zero(3);
      for (int64_t rc = 0; rc < 2 * chunks; ++rc) {  // hi's chunks, then lo's: the same B^T pairs
        _tile_loadd(4, parts + b * kTileRows * 2 * rank_pad + rc * kTileTerms, part_stride);
        const bf16_t* b_pairs = pass + (rc % chunks) * 2 * kTile;
        _tile_loadd(6, b_pairs, b_stride);
        _tile_dpbf16ps(0, 4, 6);
        if (tiles_used > 1) {
          _tile_loadd(7, b_pairs + kTile, b_stride);
          _tile_dpbf16ps(1, 4, 7);
        }
        if (tiles_used > 2) {
          _tile_loadd(6, b_pairs + step_elems, b_stride);
          _tile_dpbf16ps(2, 4, 6);
        }
        if (tiles_used > 3) {
          _tile_loadd(7, b_pairs + step_elems + kTile, b_stride);
          _tile_dpbf16ps(3, 4, 7);
        }
      }
      _tile_stored(0, c_rows, c_stride);
      if (tiles_used > 1) _tile_stored(1, c_rows + kTileRows, c_stride);
      if (tiles_used > 2) _tile_stored(2, c_rows + 2 * kTileRows, c_stride);
      if (tiles_used > 3) _tile_stored(3, c_rows + 3 * kTileRows, c_stride);
      for (int64_t t = 0; t < tokens; ++t) {
        add_scaled(out + (seg.start + t0 + t) * width + p, c_rows + t * kLongPassCols, seg.scale[module], cols);
      }
    }
  }
}

// All long segments of one call (rows not yet bound; each long_tiles_fit), x in bfloat16. Phase
// one packs each segment's A (items of 16 rows) and each module's B^T (items of 256 columns);
// phase two takes items of (segment, 4 token blocks): their shrink, split and expand, all modules
// and columns, so that v and the output rows stay in one core's cache.
inline void run_long_amx(std::vector<TiledSegment<bf16_t>>& segs, const bf16_t* x, int64_t in, bf16_t* const* outs,
                         const int64_t* out_widths, int64_t num_outputs) {
  bind_all_rows(segs, in, num_outputs);
  std::vector<LongSlot> slots(segs.size());
  int64_t a_words = 0, v_floats = 0, part_elems = 0, pair_elems = 0;
  for (size_t i = 0; i < segs.size(); ++i) {  // sizes first, then pointers into the scratch
    const int64_t tokens = padded(segs[i].num, kTileRows);
    slots[i].rows_pad = padded(segs[i].meta[1], kTileRows);
    a_words += slots[i].rows_pad * in / 2;
    v_floats += tokens * slots[i].rows_pad;
    for (int64_t module = 0; module < num_outputs; ++module) {
      const int64_t rank_pad = padded(segs[i].meta[kModuleBase + 1 + kModuleStride * module], kTileTerms);
      slots[i].rank_pad[module] = rank_pad;
      part_elems += tokens * 2 * rank_pad;
      pair_elems += padded(out_widths[module], kTileTerms) * rank_pad;
    }
  }
  thread_local std::vector<uint32_t> a_scratch;
  thread_local std::vector<float> v_scratch;
  thread_local std::vector<bf16_t> part_scratch, pair_scratch;
  uint32_t* a_next = at_least(a_scratch, a_words);
  float* v_next = at_least(v_scratch, v_floats);
  bf16_t* part_next = at_least(part_scratch, part_elems);
  bf16_t* pair_next = at_least(pair_scratch, pair_elems);
  std::vector<std::tuple<size_t, int64_t, int64_t>> packs;  // (segment, module or -1 for A, first row / column)
  std::vector<std::pair<size_t, int64_t>> items;            // (segment, first token block)
  for (size_t i = 0; i < segs.size(); ++i) {
    const int64_t tokens = padded(segs[i].num, kTileRows);
    LongSlot& slot = slots[i];
    slot.a_pairs = a_next, a_next += slot.rows_pad * in / 2;
    slot.v = v_next, v_next += tokens * slot.rows_pad;
    for (int64_t g = 0; g < slot.rows_pad; g += kTileRows) packs.emplace_back(i, -1, g);
    for (int64_t module = 0; module < num_outputs; ++module) {
      slot.parts[module] = part_next, part_next += tokens * 2 * slot.rank_pad[module];
      slot.b_pairs[module] = pair_next, pair_next += padded(out_widths[module], kTileTerms) * slot.rank_pad[module];
      if (slot.rank_pad[module] == 0) continue;
      for (int64_t o = 0; o < out_widths[module]; o += kLongItemCols) packs.emplace_back(i, module, o);
    }
    for (int64_t b = 0; b < tokens / kTileRows; b += kLongShrinkBlocks) items.emplace_back(i, b);
  }
  const int num_threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(std::max(packs.size(), items.size()))));
#pragma omp parallel num_threads(num_threads)
  {
    thread_local std::vector<bf16_t> edge;
    thread_local std::vector<float> c_rows;
    bf16_t* edge_ptr = at_least(edge, kTileRows * in);
    float* c_ptr = at_least(c_rows, kTileRows * kLongPassCols);
    configure_tiles();
#pragma omp for schedule(dynamic, 1)
    for (size_t k = 0; k < packs.size(); ++k) {
      const auto [i, module, first] = packs[k];
      if (module < 0) {
        const int rows = static_cast<int>(std::min<int64_t>(kTileRows, segs[i].meta[1] - first));
        pack_pairs(segs[i].a_rows + first, rows, in, slots[i].a_pairs + first * in / 2);
      } else {
        const int64_t o1 = std::min(out_widths[module], first + kLongItemCols);
        pack_b_pairs(segs[i], slots[i], module, first, o1, slots[i].b_pairs[module]);
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (size_t k = 0; k < items.size(); ++k) {
      const auto [i, b] = items[k];
      const int64_t b1 = std::min(padded(segs[i].num, kTileRows) / kTileRows, b + kLongShrinkBlocks);
      long_shrink(segs[i], slots[i], x + segs[i].start * in, in, num_outputs, b, b1, edge_ptr);
      for (int64_t module = 0; module < num_outputs; ++module) {
        if (slots[i].rank_pad[module] == 0) continue;
        long_expand(segs[i], slots[i], module, b, b1, outs[module], out_widths[module], c_ptr);
      }
    }
    _tile_release();
  }
  trim(a_scratch);
  trim(v_scratch);
  trim(part_scratch);
  trim(pair_scratch);
}

}  // namespace loraserve_lora
#endif

namespace loraserve_lora {

// Whether a segment of `num` tokens over a pool of W, with rows of x of `in` terms, takes
// run_long_amx (on the tiles, its length class chosen for them, long enough, whole tile rows).
template <typename W>
bool on_long_tiles(int64_t num, int64_t in, int64_t tile_lengths) {
#if defined(LORASERVE_LORA_AMX)
  return on_amx_tiles<W>(num, tile_lengths) && long_tiles_fit(num, in);
#else
  (void)num, (void)in, (void)tile_lengths;
  return false;
#endif
}

}  // namespace loraserve_lora

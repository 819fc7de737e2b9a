// The AMX tile loops of the segmented LoRA over a bfloat16 pool (CPUs with amx_bf16; included
// through lora_amx.h only, which splits the work; internal to lora_segments.cpp).
//
//   shrink:  vt[c, t] = sum_k A[c, k] x[t, k]       16 rows x 32 terms of A in place; x^T as pairs
//   expand:  out[t, o] += scale * sum_r v[t, r] B^T[r, o]   v in two bfloat16 parts (hi + lo);
//            B^T's rank rows interleaved in pairs, once per 128 columns for all token blocks
//
// The tile dot products multiply bfloat16 pairs exactly and sum in float32 (bfloat16 denormals
// count as zero there); outputs are rounded once to bfloat16, as on the other paths.
#pragma once

#include "amx_tiles.h"
#include "lora_tiled.h"

#if defined(LORASERVE_AMX)
#define LORASERVE_LORA_AMX 1

namespace loraserve_lora {

using loraserve_amx::configure_tiles;
using loraserve_amx::kTileRows;
using loraserve_amx::kTileTerms;
using loraserve_amx::padded;
constexpr int64_t kPrefetchAhead = 2 * kTileTerms;  // terms ahead that A's rows are prefetched

// dst[p * 16 + n] = the pair (rows[n][2p], rows[n][2p + 1]) as one 32-bit word (low half first)
// for `num` <= 16 bfloat16 rows of `in` terms (tokens of x, or rows of A); zero past them and past
// `in`. Per 32 terms: each row's 16 words are one load (the pairs lie in memory in that order),
// then a 16 x 16 transpose of words.
inline void pack_pairs(const bf16_t* const* rows, int num, int64_t in, uint32_t* dst) {
  for (int64_t k = 0; k < in; k += kTileTerms) {
    const int64_t terms = std::min<int64_t>(kTileTerms, in - k);
    const __mmask32 mask = terms >= 32 ? ~__mmask32{0} : (__mmask32{1} << terms) - 1;
    __m512i r[kTileRows];
    for (int n = 0; n < kTileRows; ++n) {
      r[n] = n < num ? _mm512_maskz_loadu_epi16(mask, rows[n] + k) : _mm512_setzero_si512();
    }
    loraserve_amx::store_transposed_words(r, dst + k / 2 * kTileRows);
  }
}

// Rows [c0, c1) of the segment's vt (vt[row * ld_t + token]) for its token blocks [b0, b1) of
// 16, from its token pairs `xp` (one [pairs, 16] block per 16 tokens, from its first; two blocks
// a pass). 16 rows of A are read in place when each follows the last by `in` elements and `in`
// is a multiple of 32, else copied (zero-padded) to `block` ([16, padded(in, 32)] bfloat16).
inline void amx_shrink(const TiledSegment<bf16_t>& seg, const uint32_t* xp, int64_t in, int64_t c0, int64_t c1,
                       int64_t b0, int64_t b1, float* vt, int64_t ld_t, bf16_t* block, float* cbuf) {
  const int64_t kpad = padded(in, kTileTerms), block_words = kpad / 2 * kTileRows;
  for (int64_t c = c0; c < c1; c += kTileRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kTileRows, c1 - c));
    const bf16_t* const* a = seg.a_rows + c;
    bool in_place = rows == kTileRows && in == kpad;
    for (int i = 1; in_place && i < kTileRows; ++i) in_place = a[i] == a[0] + i * in;
    const bf16_t* tile_base = a[0];
    int64_t stride = in;
    if (!in_place) {
      std::memset(block, 0, kTileRows * kpad * sizeof(bf16_t));
      for (int i = 0; i < rows; ++i) std::memcpy(block + i * kpad, a[i], in * sizeof(bf16_t));
      tile_base = block, stride = kpad;
    }
    for (int64_t b = b0; b < b1; b += 2) {
      const bool two = b + 1 < b1;
      const uint32_t* first = xp + b * block_words;
      _tile_zero(0);
      _tile_zero(1);
      for (int64_t k = 0; k < kpad; k += kTileTerms) {
        if (b == b0 && k + kPrefetchAhead < kpad) {  // 16 row streams: more than the hardware prefetchers follow
          for (int i = 0; i < kTileRows; ++i) _mm_prefetch(tile_base + i * stride + k + kPrefetchAhead, _MM_HINT_T0);
        }
        _tile_loadd(2, tile_base + k, stride * sizeof(bf16_t));
        _tile_loadd(3, first + k / 2 * kTileRows, kTileRows * sizeof(uint32_t));
        _tile_dpbf16ps(0, 2, 3);
        if (two) {
          _tile_loadd(4, first + block_words + k / 2 * kTileRows, kTileRows * sizeof(uint32_t));
          _tile_dpbf16ps(1, 2, 4);
        }
      }
      _tile_stored(0, cbuf, kTileRows * sizeof(float));
      if (two) _tile_stored(1, cbuf + kTileRows * kTileRows, kTileRows * sizeof(float));
      for (int64_t j = 0; j < (two ? 2 : 1); ++j) {
        const int64_t t0 = (b + j) * kTileRows, tokens = std::min<int64_t>(kTileRows, seg.num - t0);
        const float* tile = cbuf + j * kTileRows * kTileRows;
        for (int i = 0; i < rows; ++i) {
          std::memcpy(vt + (c + i) * ld_t + t0, tile + i * kTileRows, tokens * sizeof(float));
        }
      }
    }
  }
}

// v_parts: the module's v for the segment's tokens [t0, t1) in two bfloat16 parts, v ~ hi + lo
// (lo = v - hi rounded; zero where hi is not finite), so that the tile products keep ~16 bits of
// v's 24: hi [padded(t1 - t0, 16), rank_pad], then lo alike (zero past the tokens and the rank).
inline void split_v(const float* vt, int64_t ld_t, int64_t column, int64_t rank, int64_t rank_pad, int64_t t0,
                    int64_t t1, bf16_t* v_parts) {
  const int64_t rows = padded(t1 - t0, kTileRows);
  bf16_t *hi = v_parts, *lo = v_parts + rows * rank_pad;
  std::memset(v_parts, 0, 2 * rows * rank_pad * sizeof(bf16_t));
  for (int64_t r = 0; r < rank; ++r) {
    const float* v_row = vt + (column + r) * ld_t;
    for (int64_t t = t0; t < t1; ++t) {
      const bf16_t h = loraserve_bf16::rounded_bits(v_row[t]);
      const bool finite = (h & 0x7F80u) != 0x7F80u;
      hi[(t - t0) * rank_pad + r] = h;
      lo[(t - t0) * rank_pad + r] = finite ? loraserve_bf16::rounded_bits(v_row[t] - loraserve_bf16::widened(h)) : 0;
    }
  }
}

// Two B tiles [16, 32]: rank rows r0 + 2p and r0 + 2p + 1 of B^T interleaved over columns
// [o, o + 16) (`b0`) and [o + 16, o + 32) (`b1`); zero past `rank` and past `cols` columns.
inline void pack_rank_pairs(const bf16_t* const* b, int64_t rank, int64_t r0, int64_t o, int64_t cols, bf16_t* b0,
                            bf16_t* b1) {
  const __mmask32 mask = cols >= 32 ? ~__mmask32{0} : (__mmask32{1} << cols) - 1;
  alignas(64) static constexpr uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  for (int p = 0; p < kTileRows; ++p) {
    const int64_t ra = r0 + 2 * p, rb = ra + 1;
    const __m512i even = ra < rank ? _mm512_maskz_loadu_epi16(mask, b[ra] + o) : _mm512_setzero_si512();
    const __m512i odd = rb < rank ? _mm512_maskz_loadu_epi16(mask, b[rb] + o) : _mm512_setzero_si512();
    _mm512_storeu_si512(b0 + p * kTileTerms, _mm512_permutex2var_epi16(even, low, odd));
    _mm512_storeu_si512(b1 + p * kTileTerms, _mm512_permutex2var_epi16(even, high, odd));
  }
}

// Scratch of one thread for amx_expand.
struct ExpandScratch {
  bf16_t* v_parts;  // split_v's [2, up to kItemBlocks x 16, rank_pad]
  bf16_t* b_pairs;  // [kStripCols / 32, rank_pad / 32, 2 tiles, 16, 32]
  float* c_rows;    // [16, kStripCols]
};
constexpr int64_t kStripCols = 128;  // output columns of B^T packed at a time
constexpr int64_t kItemBlocks = 16;  // token blocks of 16 per work item: 256 tokens

// out[t, o0:o1] += scale * v_m[t] @ B_m^T[:, o0:o1] for the segment's token blocks [b0, b1) of
// 16 (at most kItemBlocks), on the tiles. Per strip of 128 columns, B^T is packed once for all
// of those blocks, then each block is multiplied and added to the output.
inline void amx_expand(const TiledSegment<bf16_t>& seg, int64_t module, int64_t o0, int64_t o1, int64_t b0,
                       int64_t b1, const float* vt, int64_t ld_t, bf16_t* out, int64_t width,
                       const ExpandScratch& scratch) {
  const int64_t* mm = seg.meta + kModuleBase + kModuleStride * module;
  const int64_t rank = mm[1], rank_pad = padded(rank, kTileTerms), chunks = rank_pad / kTileTerms;
  const int64_t part = (b1 - b0) * kTileRows * rank_pad;
  split_v(vt, ld_t, mm[0], rank, rank_pad, b0 * kTileRows, std::min(seg.num, b1 * kTileRows), scratch.v_parts);
  constexpr int64_t kCols = 2 * kTileRows, kTile = kTileRows * kTileTerms;  // columns a step, elements a B tile
  const int64_t v_stride = rank_pad * sizeof(bf16_t), b_stride = kTileTerms * sizeof(bf16_t);
  for (int64_t s0 = o0; s0 < o1; s0 += kStripCols) {
    const int64_t s1 = std::min(o1, s0 + kStripCols), steps = (s1 - s0 + kCols - 1) / kCols;
    for (int64_t step = 0; step < steps; ++step) {
      const int64_t o = s0 + step * kCols;
      for (int64_t rc = 0; rc < chunks; ++rc) {
        bf16_t* tiles = scratch.b_pairs + (step * chunks + rc) * 2 * kTile;
        pack_rank_pairs(seg.b_rows[module], rank, rc * kTileTerms, o, std::min(kCols, s1 - o), tiles,
                        tiles + kTile);
      }
    }
    for (int64_t b = b0; b < b1; ++b) {
      const bf16_t *hi = scratch.v_parts + (b - b0) * kTileRows * rank_pad, *lo = hi + part;
      for (int64_t step = 0; step < steps; ++step) {
        _tile_zero(0);
        _tile_zero(1);
        for (int64_t rc = 0; rc < chunks; ++rc) {
          const bf16_t* tiles = scratch.b_pairs + (step * chunks + rc) * 2 * kTile;
          _tile_loadd(4, tiles, b_stride);
          _tile_loadd(5, tiles + kTile, b_stride);
          _tile_loadd(6, hi + rc * kTileTerms, v_stride);
          _tile_loadd(7, lo + rc * kTileTerms, v_stride);
          _tile_dpbf16ps(0, 6, 4);
          _tile_dpbf16ps(1, 6, 5);
          _tile_dpbf16ps(0, 7, 4);
          _tile_dpbf16ps(1, 7, 5);
        }
        _tile_stored(0, scratch.c_rows + step * kCols, kStripCols * sizeof(float));
        _tile_stored(1, scratch.c_rows + step * kCols + kTileRows, kStripCols * sizeof(float));
      }
      const int64_t t0 = b * kTileRows, tokens = std::min<int64_t>(kTileRows, seg.num - t0);
      for (int64_t t = 0; t < tokens; ++t) {
        add_scaled(out + (seg.start + t0 + t) * width + s0, scratch.c_rows + t * kStripCols, seg.scale[module],
                   s1 - s0);
      }
    }
  }
}

}  // namespace loraserve_lora

#endif

// The AMX tile pieces of the bfloat16 prefill attention (prefill_attention_amx.h walks them):
// keys and values gathered from their pages and packed as B tiles, and the two tile products.
//
//   scores[v, j] = sum_d q[v, d] k[j, d]        q: 16 query vectors in place; k packed as pairs of d
//   partial[v, c] = sum_j p[v, j] value[j, c]   p: bfloat16 probabilities; values packed as pairs of j
#pragma once

#include "amx_tiles.h"

#if defined(LORASERVE_AMX)

#include <algorithm>
#include <cstdint>

namespace loraserve_prefill_amx {

using loraserve_amx::kTileRows;
using loraserve_amx::kTileTerms;

constexpr int64_t kBlockKeys = 64;              // keys per step of the walk
constexpr int64_t kKeyTiles = kBlockKeys / 16;  // score tiles per 16 query vectors
constexpr int64_t kKeyChunks = kBlockKeys / 32; // probability tiles (32 keys each)
constexpr int64_t kPassTiles = 4;               // output tiles (16 columns each) per pass
constexpr int64_t kTileWords = kTileRows * 16;  // 32-bit words of a tile

// Where key or value j of the item's sequence and KV head lies: the row in its page.
struct Rows {
  const uint16_t* kv;
  const int64_t* table;
  int64_t block_size, page_stride, row_stride, half_stride, head_offset;
  const uint16_t* key(int64_t j) const {
    return kv + table[j / block_size] * page_stride + (j % block_size) * row_stride + head_offset;
  }
  const uint16_t* value(int64_t j) const { return key(j) + half_stride; }
};

// Keys [j0, j0 + num) (num <= 64) as B tiles: k_tiles[(c * kKeyTiles + n) * kTileWords + p * 16 + i]
// = the pair (terms 32c + 2p, 32c + 2p + 1) of key j0 + 16n + i; zero past num and head_dim.
inline void pack_keys(const Rows& rows, int64_t j0, int64_t num, int64_t head_dim, int64_t chunks, uint32_t* k_tiles) {
  for (int64_t n = 0; n * kTileRows < num; ++n) {
    for (int64_t c = 0; c < chunks; ++c) {
      const int64_t terms = std::min<int64_t>(kTileTerms, head_dim - c * kTileTerms);
      const __mmask32 mask = terms >= 32 ? ~__mmask32{0} : (__mmask32{1} << terms) - 1;
      __m512i r[kTileRows];
      for (int64_t i = 0; i < kTileRows; ++i) {
        const int64_t j = n * kTileRows + i;
        r[i] = j < num ? _mm512_maskz_loadu_epi16(mask, rows.key(j0 + j) + c * kTileTerms) : _mm512_setzero_si512();
      }
      loraserve_amx::store_transposed_words(r, k_tiles + (c * kKeyTiles + n) * kTileWords);
    }
  }
}

// Values [j0, j0 + num) as B tiles of pairs of keys: v_tiles[((kc * col_tiles + ct) * 16 + p) * 32
// + 2 i + e] = column 16 ct + i of value j0 + 32 kc + 2p + e; zero past num and head_dim.
inline void pack_values(const Rows& rows, int64_t j0, int64_t num, int64_t head_dim, int64_t col_tiles,
                        uint16_t* v_tiles) {
  alignas(64) static constexpr uint16_t kLow[32] = {0, 32, 1, 33, 2, 34, 3, 35, 4, 36, 5, 37, 6, 38, 7, 39,
                                                    8, 40, 9, 41, 10, 42, 11, 43, 12, 44, 13, 45, 14, 46, 15, 47};
  alignas(64) static constexpr uint16_t kHigh[32] = {16, 48, 17, 49, 18, 50, 19, 51, 20, 52, 21, 53, 22, 54, 23, 55,
                                                     24, 56, 25, 57, 26, 58, 27, 59, 28, 60, 29, 61, 30, 62, 31, 63};
  const __m512i low = _mm512_load_si512(kLow), high = _mm512_load_si512(kHigh);
  const int64_t tile_elems = 2 * kTileWords;
  for (int64_t kc = 0; kc * 32 < num; ++kc) {
    for (int64_t p = 0; p < kTileRows; ++p) {
      const int64_t ja = kc * 32 + 2 * p, jb = ja + 1;
      for (int64_t ct = 0; ct < col_tiles; ct += 2) {
        const int64_t cols = std::min<int64_t>(32, head_dim - ct * 16);
        const __mmask32 mask = cols >= 32 ? ~__mmask32{0} : (__mmask32{1} << cols) - 1;
        const __m512i even = ja < num ? _mm512_maskz_loadu_epi16(mask, rows.value(j0 + ja) + ct * 16)
                                      : _mm512_setzero_si512();
        const __m512i odd = jb < num ? _mm512_maskz_loadu_epi16(mask, rows.value(j0 + jb) + ct * 16)
                                     : _mm512_setzero_si512();
        uint16_t* dst = v_tiles + ((kc * col_tiles + ct) * kTileRows + p) * 32;
        _mm512_storeu_si512(dst, _mm512_permutex2var_epi16(even, low, odd));
        if (ct + 1 < col_tiles) _mm512_storeu_si512(dst + tile_elems, _mm512_permutex2var_epi16(even, high, odd));
      }
    }
  }
}

// c[0:16, 16 t : 16 t + 16] = sum over chunks ch of A_ch @ B_ch,t for the output tiles t < n (<= 4):
// A_ch the 16 rows x 32 bfloat16 at a + 32 ch (rows a_stride elements apart), B_ch,t the packed
// tile (1 KiB) at b + ch * b_chunk + t (in tiles); rows of c c_stride floats apart.
inline void tile_products(const uint16_t* a, int64_t a_stride, const char* b, int64_t b_chunk, int64_t chunks,
                          int64_t n, float* c, int64_t c_stride) {
  constexpr int64_t kTileBytes = 1024;
  _tile_zero(0);
  _tile_zero(1);
  _tile_zero(2);
  _tile_zero(3);
  for (int64_t ch = 0; ch < chunks; ++ch) {
    const char* bt = b + ch * b_chunk * kTileBytes;
    _tile_loadd(4, a + ch * kTileTerms, a_stride * 2);
    _tile_loadd(5, bt, 64);
    _tile_dpbf16ps(0, 4, 5);
    if (n > 1) {
      _tile_loadd(6, bt + kTileBytes, 64);
      _tile_dpbf16ps(1, 4, 6);
    }
    if (n > 2) {
      _tile_loadd(7, bt + 2 * kTileBytes, 64);
      _tile_dpbf16ps(2, 4, 7);
    }
    if (n > 3) {
      _tile_loadd(5, bt + 3 * kTileBytes, 64);
      _tile_dpbf16ps(3, 4, 5);
    }
  }
  _tile_stored(0, c, c_stride * 4);
  if (n > 1) _tile_stored(1, c + 16, c_stride * 4);
  if (n > 2) _tile_stored(2, c + 32, c_stride * 4);
  if (n > 3) _tile_stored(3, c + 48, c_stride * 4);
}

// scores[0:16, 0:16 n_tiles] = q (16 vectors, terms_pad apart) @ keys^T, from pack_keys' tiles.
inline void score_tiles(const uint16_t* q, int64_t terms_pad, const uint32_t* k, int64_t n_tiles, float* scores) {
  tile_products(q, terms_pad, reinterpret_cast<const char*>(k), kKeyTiles, terms_pad / kTileTerms, n_tiles, scores,
                kBlockKeys);
}

// partial[0:16, 0:16 col_tiles] = probs (16 x 32 k_chunks keys) @ values, from pack_values' tiles.
inline void value_tiles(const uint16_t* probs, const uint16_t* v, int64_t k_chunks, int64_t col_tiles,
                        float* partial) {
  const char* tiles = reinterpret_cast<const char*>(v);
  for (int64_t ct0 = 0; ct0 < col_tiles; ct0 += kPassTiles) {
    tile_products(probs, kBlockKeys, tiles + ct0 * 1024, col_tiles, k_chunks, std::min(kPassTiles, col_tiles - ct0),
                  partial + ct0 * 16, col_tiles * 16);
  }
}

}  // namespace loraserve_prefill_amx

#endif

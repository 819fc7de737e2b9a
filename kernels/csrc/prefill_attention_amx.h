// Paged prefill attention over a bfloat16 pool on AMX tiles (CPUs with amx_bf16 and avx512_bf16;
// built in where -march=native has them, used where the OS grants the tile state). Included by
// prefill_attention.cpp only, which checks the arguments; same semantics and shapes as its vector
// loops (kernels/cpu.py: paged_prefill_attention):
//
//   out[t, h] = sum_j softmax_j(scale * q[t, h] . k[j, g(h)]) v[j, g(h)]   over j <= position(t)
//
// Work items are (sequence, KV head, 64 query rows): their 64 x group query vectors, 16 to a tile.
// An item walks its context 64 keys at a time (as far as its last row may look): those keys are
// packed as B tiles of pairs of head_dim terms, the values as B tiles of pairs of keys (the tile
// pieces: prefill_amx_tiles.h). Per 16
// query vectors, the scores come out of the tiles in float32; an online-softmax step (float32)
// turns them into probabilities, rounded once to bfloat16 for the tile product with the values
// (as FlashAttention rounds P); the running sums use the rounded probabilities, so the weights
// of each output sum to one. Query and key products are exact (bfloat16 pairs summed in float32;
// denormals count as zero there). Any head_dim: padded with zeros to 32 terms.
#pragma once

#include "amx_tiles.h"

#if defined(LORASERVE_AMX)
#define LORASERVE_PREFILL_AMX 1

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_common.h"
#include "prefill_amx_tiles.h"
#include "scratch.h"
#include "simd16.h"

namespace loraserve_prefill_amx {

using loraserve_amx::padded;
using loraserve_simd::f32x16;
using loraserve_simd::i32x16;
using loraserve_simd::splat16;

constexpr int64_t kItemRows = 64;  // query rows per work item

inline f32x16 exp16(f32x16 x) {
  return loraserve_attention::exp_lanes_nonpositive<f32x16, i32x16>(x, splat16(-87.0f), splat16(12582912.0f));
}

inline __m512 as_m512(f32x16 v) {
  __m512 r;
  std::memcpy(&r, &v, sizeof(r));
  return r;
}
inline float hmax16(f32x16 v) { return _mm512_reduce_max_ps(as_m512(v)); }
inline float hsum16(f32x16 v) { return _mm512_reduce_add_ps(as_m512(v)); }

// The bfloat16 nearest each of 16 floats (to even; as torch rounds), as 16 x 16 bits.
inline __m256i rounded16(f32x16 v) {
  const __m256bh bits = _mm512_cvtneps_pbh(as_m512(v));
  __m256i r;
  std::memcpy(&r, &bits, sizeof(r));
  return r;
}

// 16 bfloat16 (bits) widened to floats.
inline f32x16 widened16(__m256i bits) {
  const __m512i words = _mm512_slli_epi32(_mm512_cvtepu16_epi32(bits), 16);
  f32x16 r;
  std::memcpy(&r, &words, sizeof(r));
  return r;
}

// Per-thread buffers of one item (all from cache-line starts).
struct Scratch {
  uint16_t* q;       // [vectors_pad, terms_pad] the item's query vectors, zero-padded
  uint32_t* k;       // pack_keys' tiles
  uint16_t* v;       // pack_values' tiles
  float* scores;     // [16, kBlockKeys]
  uint16_t* probs;   // [16, kBlockKeys]
  float* partial;    // [16, cols_pad]: P @ V of this block
  float* acc;        // [vectors_pad, cols_pad]
  float* max_score;  // [vectors_pad]
  float* sum;        // [vectors_pad]
};

// One online-softmax step for 16 query vectors (from v0) over keys [j0, j0 + seen): their scores
// in, probabilities (bfloat16, zero past each vector's visible keys and up to k_chunks x 32) out;
// max_score and sum updated; correction[r] the factor on vector r's earlier sums.
inline void softmax_step(const float* scores, int64_t v0, int64_t vectors, int64_t group, int64_t first_pos,
                         int64_t j0, int64_t seen, int64_t k_chunks, float scale, float* max_score, float* sum,
                         uint16_t* probs, float* correction) {
  constexpr i32x16 kLanes = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
  const f32x16 minus_inf = splat16(-std::numeric_limits<float>::infinity());
  const int64_t n_tiles = (seen + 15) / 16;
  for (int64_t r = 0; r < kTileRows; ++r) {
    const int64_t v = v0 + r;
    uint16_t* row = probs + r * kBlockKeys;
    const int64_t visible = v < vectors ? std::min(seen, first_pos + v / group + 1 - j0) : 0;
    correction[r] = 1.f;
    if (visible <= 0) {
      std::memset(row, 0, k_chunks * 32 * sizeof(uint16_t));
      continue;
    }
    f32x16 s[kKeyTiles];
    float block_max = -std::numeric_limits<float>::infinity();
    for (int64_t n = 0; n < n_tiles; ++n) {
      const auto seen_lanes = kLanes + static_cast<int32_t>(n * 16) < static_cast<int32_t>(visible);
      s[n] = seen_lanes ? loraserve_simd::load16(scores + r * kBlockKeys + n * 16) * scale : minus_inf;
      block_max = std::max(block_max, hmax16(s[n]));
    }
    const float new_max = std::max(max_score[v], block_max);
    correction[r] = loraserve_attention::exp_nonpositive(max_score[v] - new_max);
    f32x16 total = splat16(0.f);
    for (int64_t n = 0; n < 2 * k_chunks; ++n) {
      __m256i bits = _mm256_setzero_si256();
      if (n < n_tiles) {
        const auto seen_lanes = kLanes + static_cast<int32_t>(n * 16) < static_cast<int32_t>(visible);
        bits = rounded16(seen_lanes ? exp16(s[n] - new_max) : splat16(0.f));
        total += widened16(bits);
      }
      _mm256_storeu_si256(reinterpret_cast<__m256i*>(row + n * 16), bits);
    }
    sum[v] = sum[v] * correction[r] + hsum16(total);
    max_score[v] = new_max;
  }
}

// The attention of all prefill chunks of a step (arguments checked by the caller; bfloat16).
inline void prefill(const at::Tensor& query, const at::Tensor& kv, const std::vector<int64_t>& starts,
                    const std::vector<int64_t>& cached, const at::Tensor& block_tables, double scale,
                    at::Tensor& out) {
  using loraserve_scratch::at_least;
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t num_kv_heads = kv.size(3), group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const auto* q_ptr = reinterpret_cast<const uint16_t*>(query.data_ptr<at::BFloat16>());
  const auto* kv_ptr = reinterpret_cast<const uint16_t*>(kv.data_ptr<at::BFloat16>());
  auto* out_ptr = reinterpret_cast<uint16_t*>(out.data_ptr<at::BFloat16>());
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t terms_pad = padded(head_dim, kTileTerms), chunks = terms_pad / kTileTerms;
  const int64_t col_tiles = padded(head_dim, 16) / 16, cols_pad = col_tiles * 16;
  const int64_t vectors_pad = padded(kItemRows * group, kTileRows);
  const float fscale = static_cast<float>(scale);

  const std::vector<loraserve_attention::PrefillItem> items =
      loraserve_attention::prefill_items(starts, num_kv_heads, kItemRows);
  const int64_t num_items = static_cast<int64_t>(items.size());
  const int num_threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(num_items)));
#pragma omp parallel num_threads(num_threads)
  {
    thread_local std::vector<uint16_t> q_buf, v_buf, p_buf;
    thread_local std::vector<uint32_t> k_buf;
    thread_local std::vector<float> s_buf, part_buf, acc_buf, stat_buf;
    float* stats = at_least(stat_buf, 2 * vectors_pad);
    const Scratch sc{at_least(q_buf, vectors_pad * terms_pad),
                     at_least(k_buf, chunks * kKeyTiles * kTileWords),
                     at_least(v_buf, kKeyChunks * col_tiles * 2 * kTileWords),
                     at_least(s_buf, kTileRows * kBlockKeys),
                     at_least(p_buf, kTileRows * kBlockKeys),
                     at_least(part_buf, kTileRows * cols_pad),
                     at_least(acc_buf, vectors_pad * cols_pad),
                     stats,
                     stats + vectors_pad};
    loraserve_amx::configure_tiles();
#pragma omp for schedule(dynamic, 1)
    for (int64_t item_index = 0; item_index < num_items; ++item_index) {
      const auto [seq, kv_head, row0, rows] = items[item_index];
      const int64_t first_row = starts[seq] + row0, first_pos = cached[seq] + row0;
      const int64_t vectors = rows * group, m_tiles = (vectors + kTileRows - 1) / kTileRows;
      std::memset(sc.q, 0, m_tiles * kTileRows * terms_pad * sizeof(uint16_t));
      for (int64_t i = 0; i < rows; ++i)  // vector i * group + hh: row i, head hh of the group
        for (int64_t hh = 0; hh < group; ++hh)
          std::memcpy(sc.q + (i * group + hh) * terms_pad,
                      q_ptr + ((first_row + i) * num_heads + kv_head * group + hh) * head_dim,
                      head_dim * sizeof(uint16_t));
      std::fill(sc.acc, sc.acc + m_tiles * kTileRows * cols_pad, 0.f);
      std::fill(sc.max_score, sc.max_score + vectors_pad, -std::numeric_limits<float>::infinity());
      std::fill(sc.sum, sc.sum + vectors_pad, 0.f);
      const Rows kv_rows{kv_ptr,          tables + seq * max_blocks, kv.size(2), kv.stride(0), kv.stride(2),
                         kv.stride(1), kv_head * head_dim};
      const int64_t num_keys = first_pos + rows;  // the last row sees positions < this
      for (int64_t j0 = 0; j0 < num_keys; j0 += kBlockKeys) {
        const int64_t block = std::min(kBlockKeys, num_keys - j0);
        pack_keys(kv_rows, j0, block, head_dim, chunks, sc.k);
        pack_values(kv_rows, j0, block, head_dim, col_tiles, sc.v);
        for (int64_t m = 0; m < m_tiles; ++m) {
          const int64_t v0 = m * kTileRows, v_last = std::min(vectors, v0 + kTileRows) - 1;
          const int64_t seen = std::min(block, first_pos + v_last / group + 1 - j0);  // keys the tile's last row sees
          if (seen <= 0) continue;
          const int64_t n_tiles = (seen + 15) / 16, k_chunks = (seen + 31) / 32;
          float correction[kTileRows];
          score_tiles(sc.q + v0 * terms_pad, terms_pad, sc.k, n_tiles, sc.scores);
          softmax_step(sc.scores, v0, vectors, group, first_pos, j0, seen, k_chunks, fscale, sc.max_score, sc.sum,
                       sc.probs, correction);
          value_tiles(sc.probs, sc.v, k_chunks, col_tiles, sc.partial);
          for (int64_t r = 0; r < kTileRows && v0 + r < vectors; ++r) {
            float* a = sc.acc + (v0 + r) * cols_pad;
            const float* p = sc.partial + r * cols_pad;
            const f32x16 c = splat16(correction[r]);
            for (int64_t d = 0; d < cols_pad; d += 16)
              loraserve_simd::store16(a + d, loraserve_simd::load16(a + d) * c + loraserve_simd::load16(p + d));
          }
        }
      }
      for (int64_t v = 0; v < vectors; ++v) {
        const int64_t i = v / group, hh = v % group;
        const f32x16 inv = splat16(1.f / sc.sum[v]);  // every row sees at least its own position
        uint16_t* dst = out_ptr + ((first_row + i) * num_heads + kv_head * group + hh) * head_dim;
        for (int64_t d = 0; d < head_dim; d += 16) {
          const int64_t cols = std::min<int64_t>(16, head_dim - d);
          const __mmask16 mask = cols >= 16 ? __mmask16{0xFFFF} : static_cast<__mmask16>((1u << cols) - 1);
          _mm256_mask_storeu_epi16(dst + d, mask, rounded16(loraserve_simd::load16(sc.acc + v * cols_pad + d) * inv));
        }
      }
    }
    _tile_release();
  }
}

}  // namespace loraserve_prefill_amx

#endif

// Paged decode attention over bfloat16 KV by AVX512-BF16 pair dots; included by cpu_kernels.cpp
// only, compiled where the build targets AVX512-BF16. Same semantics, arguments and work split as
// decode_attention_wide.h, for bfloat16 query, KV and output only:
//   out[s, h] = softmax_j(scale * q[s, h] . K[s, j, h / group]) @ V[s, j, h / group],  j < context_lens[s]
// with K/V row j of sequence s in page block_tables[s, j / B], row j % B; scores and accumulation
// float32, the output rounded once to nearest even.
//
// What differs from the 16-lane kernel: the scores never widen the keys. VDPBF16PS multiplies the
// bfloat16 query and key as they are, two terms a lane (each product exact in float32), into
// float32 sums, so a head's 16 scores of a tile take head_dim / 32 instructions a row and one
// transposing sum; the scale is applied to the sums (a float32 rounding, as scaling the query is).
// The value rows are widened in registers as they are read, once for up to four heads of a group,
// not through a float32 scratch copy of the page. Needs block_size % 16 == 0 and head_dim a
// multiple of 32 up to 128; can_run_pairs says so.
#pragma once

#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define LORASERVE_DECODE_ATTENTION_PAIRS 1

#include <ATen/Parallel.h>
#include <immintrin.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "bf16_bits.h"
#include "decode_attention_wide.h"
#include "online_softmax.h"
#include "simd16.h"

namespace loraserve_attention {

inline bool can_run_pairs(int64_t head_dim, int64_t block_size) {
  return block_size % 16 == 0 && head_dim % 32 == 0 && head_dim >= 32 && head_dim <= 128;
}

// Scores of one head for 16 rows of bfloat16 keys (rows of stride row_stride): scale * (q . key_r),
// q given as kPairs vectors of 16 bfloat16 pairs.
template <int kPairs>
inline f32x16 pair_head_scores(const __m512bh* q, const uint16_t* key, int64_t row_stride, f32x16 scale) {
  __m512 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = _mm512_setzero_ps();
  for (int c = 0; c < kPairs; ++c) {
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) {
      const __m512bh k = (__m512bh)_mm512_loadu_si512(key + i * row_stride + 32 * c);
      acc[reversed4(i)] = _mm512_dpbf16_ps(acc[reversed4(i)], k, q[c]);
    }
  }
  f32x16 sums[16];
  for (int i = 0; i < 16; ++i) std::memcpy(&sums[i], &acc[i], sizeof(f32x16));
  return transposed_sums(sums) * scale;
}

// o_h = o_h * correction_h + sum_r p_h[r] * value_r for NH heads of one group over `rows` bfloat16
// value rows, each widened once in registers (outputs in wide_order<uint16_t>, at stride head_dim).
template <int kVecs, int NH>
inline void pair_value_rows(const uint16_t* value, int64_t row_stride, int64_t rows, const float* scores,
                            int64_t block_size, const float* corrections, float* out) {
  using u16x32 = uint16_t __attribute__((vector_size(64)));
  f32x16 acc[NH][kVecs];
  for (int h = 0; h < NH; ++h) {
    const f32x16 corr = splat16(corrections[h]);
    for (int c = 0; c < kVecs; ++c) acc[h][c] = load16(out + h * kVecs * 16 + 16 * c) * corr;
  }
  for (int64_t r = 0; r < rows; ++r) {
    f32x16 v[kVecs];
    for (int c = 0; c < kVecs; c += 2)
      loraserve_bf16::load_unpacked<f32x16, u16x32>(value + r * row_stride + 16 * c, v[c], v[c + 1]);
    for (int h = 0; h < NH; ++h) {
      const f32x16 p = splat16(scores[h * block_size + r]);
      for (int c = 0; c < kVecs; ++c) acc[h][c] += p * v[c];
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < kVecs; ++c) store16(out + h * kVecs * 16 + 16 * c, acc[h][c]);
}

// kPairs = head_dim / 32; query, KV and output bfloat16 (as their bits).
template <int kPairs>
void decode_attention_pairs(const at::Tensor& query, const at::Tensor& kv, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, at::Tensor& out) {
  constexpr int kVecs = 2 * kPairs;  // float32 vectors of a head's output
  constexpr int64_t head_dim = 32 * kPairs;
  constexpr int kHeadsAtOnce = std::max(1, std::min(4, 24 / kVecs - 1));  // as decode_attention_wide
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t block_size = kv.size(2), num_kv_heads = kv.size(3);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t page_stride = kv.stride(0), kv_stride = kv.stride(1), row_stride = kv.stride(2);
  const uint16_t* q_ptr = static_cast<const uint16_t*>(query.data_ptr());
  const uint16_t* kv_ptr = static_cast<const uint16_t*>(kv.data_ptr());
  const int64_t* table_ptr = block_tables.data_ptr<int64_t>();
  const int64_t* len_ptr = context_lens.data_ptr<int64_t>();
  uint16_t* out_ptr = static_cast<uint16_t*>(out.data_ptr());
  const f32x16 fscale = splat16(static_cast<float>(scale));
  const int64_t page_bytes = 2 * kv_stride * static_cast<int64_t>(sizeof(uint16_t));
  const int64_t tiles_per_page = block_size / 16;
  // A page's lines are issued evenly over its work, as in decode_attention_wide.
  const int64_t value_calls = num_kv_heads * ((group + kHeadsAtOnce - 1) / kHeadsAtOnce);
  const int64_t lines_per_call = (page_bytes / 64) / (num_heads * tiles_per_page + value_calls) + 1;
  const int num_threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(num_seqs)));

#pragma omp parallel num_threads(num_threads)
  {
    const int64_t padded_heads = (num_heads + 15) / 16 * 16;
    std::vector<float> scores(num_heads * block_size), maxes(padded_heads), sums(num_heads),
        new_maxes(padded_heads, 0.f), corrections(padded_heads), acc_out(num_heads * head_dim);
    std::vector<__m512bh> q(num_heads * kPairs);
    PagePrefetcher prefetcher;
#pragma omp for schedule(dynamic, kSeqsPerItem)
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
      const int64_t n = len_ptr[seq];
      const int64_t* table = table_ptr + seq * max_blocks;
      const int64_t num_blocks = (n + block_size - 1) / block_size;
      const uint16_t* src = q_ptr + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * kPairs; ++i) q[i] = (__m512bh)_mm512_loadu_si512(src + 32 * i);
      float* dst = acc_out.data();
      std::fill(dst, dst + num_heads * head_dim, 0.f);
      std::fill(maxes.begin(), maxes.begin() + num_heads, -std::numeric_limits<float>::infinity());
      std::fill(sums.begin(), sums.end(), 0.f);

      for (int64_t b = 0; b < num_blocks; ++b) {
        const uint16_t* page = kv_ptr + table[b] * page_stride;
        const int64_t rows = std::min(block_size, n - b * block_size);
        prefetch_page_ahead(prefetcher, kv_ptr, table_ptr, len_ptr, seq, b, num_seqs, max_blocks, block_size, page_stride,
                            page_bytes);
        // Scores of rows past n are computed from whatever the page holds there and then ignored.
        for (int64_t t = 0; t < tiles_per_page; ++t) {
          for (int64_t h = 0; h < num_heads; ++h) {
            const uint16_t* key = page + t * 16 * row_stride + (h / group) * head_dim;
            store16(scores.data() + h * block_size + t * 16,
                    pair_head_scores<kPairs>(q.data() + h * kPairs, key, row_stride, fscale));
            prefetcher.advance(lines_per_call);
          }
        }
        online_softmax_page<f32x16>(scores.data(), num_heads, padded_heads, block_size, rows, maxes.data(),
                                    new_maxes.data(), corrections.data(), sums.data());
        const uint16_t* values = page + kv_stride;
        for (int64_t g = 0; g < num_kv_heads; ++g) {
          for (int64_t h = g * group; h < (g + 1) * group; h += kHeadsAtOnce) {
            const uint16_t* value = values + g * head_dim;
            const float* s = scores.data() + h * block_size;
            float* o = dst + h * head_dim;
            prefetcher.advance(lines_per_call);
            with_head_count<kHeadsAtOnce>((g + 1) * group - h, [&](auto heads) {
              pair_value_rows<kVecs, decltype(heads)::value>(value, row_stride, rows, s, block_size,
                                                             corrections.data() + h, o);
            });
          }
        }
      }
      uint16_t* rounded = out_ptr + seq * num_heads * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        const float inv = 1.f / sums[h];
        for (int64_t i = 0; i < head_dim; ++i)
          rounded[h * head_dim + i] = loraserve_bf16::rounded_bits(dst[h * head_dim + wide_order<uint16_t>(i)] * inv);
      }
    }
  }
}

}  // namespace loraserve_attention

#endif  // __AVX512BF16__

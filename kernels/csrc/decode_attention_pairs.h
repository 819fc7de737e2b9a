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
#include "decode_attention_pages.h"
#include "decode_attention_wide.h"
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

// kPairs = head_dim / 32; query, KV and output bfloat16 (as their bits).
template <int kPairs>
void decode_attention_pairs(const at::Tensor& query, const at::Tensor& kv, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, at::Tensor& out) {
  constexpr int kVecs = 2 * kPairs;  // float32 vectors of a head's output
  constexpr int64_t head_dim = 32 * kPairs;
  constexpr int kHeadsAtOnce = heads_at_once(kVecs);
  const PagedArgs<uint16_t> a(query, kv, block_tables, context_lens, out);
  const int64_t num_heads = a.num_heads, block_size = a.block_size, row_stride = a.row_stride;
  const f32x16 fscale = splat16(static_cast<float>(scale));
  const int64_t lines = lines_per_call(a, kHeadsAtOnce);

#pragma omp parallel num_threads(a.num_threads)
  {
    SoftmaxState<f32x16> softmax(num_heads, block_size);
    std::vector<float> acc_out(num_heads * head_dim);
    std::vector<__m512bh> q(num_heads * kPairs);
    PagePrefetcher prefetcher;
#pragma omp for schedule(dynamic, kSeqsPerItem)
    for (int64_t seq = 0; seq < a.num_seqs; ++seq) {
      const uint16_t* src = a.q + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * kPairs; ++i) q[i] = (__m512bh)_mm512_loadu_si512(src + 32 * i);
      float* dst = acc_out.data();
      std::fill(dst, dst + num_heads * head_dim, 0.f);
      softmax.start_sequence();

      for_each_page(a, seq, prefetcher, [&](const uint16_t* page, int64_t rows) {
        // Scores of rows past n are computed from whatever the page holds there and then ignored.
        for (int64_t t = 0; t < block_size / 16; ++t) {
          for (int64_t h = 0; h < num_heads; ++h) {
            const uint16_t* key = page + t * 16 * row_stride + (h / a.group) * head_dim;
            store16(softmax.head_scores(h) + t * 16,
                    pair_head_scores<kPairs>(q.data() + h * kPairs, key, row_stride, fscale));
            prefetcher.advance(lines);
          }
        }
        softmax.update(rows);
        for_head_runs<kHeadsAtOnce>(a.num_kv_heads, a.group, [&](int64_t g, int64_t h, auto heads) {
          prefetcher.advance(lines);
          // value rows widened in registers once for the run's heads, no scratch page
          value_rows<kVecs, decltype(heads)::value, uint16_t>(page + a.kv_stride + g * head_dim, row_stride, rows,
                                                              softmax.head_scores(h), block_size,
                                                              softmax.corrections.data() + h, dst + h * head_dim);
        });
      });
      finish_heads<kVecs, uint16_t>(dst, softmax.sums.data(), num_heads, a.out + seq * num_heads * head_dim);
    }
  }
}

}  // namespace loraserve_attention

#endif  // __AVX512BF16__

// Paged decode attention, float32, register-tiled (included by cpu_kernels.cpp only). Same
// semantics, arguments and work split as the generic decode_attention_impl there:
//   out[s, h] = softmax_j(scale * q[s, h] . K[s, j, h / group]) @ V[s, j, h / group],  j < context_lens[s]
// with K/V row j of sequence s in page block_tables[s, j / B], row j % B. One sequence per work
// item; scores and accumulation float32.
//
// Why a second version: the generic loops reach ~14 GB/s of KV even with the KV hot in cache (one
// horizontal sum per score, the accumulators loaded and stored for every row), so they are
// compute-bound. Here a score pass takes 8 rows of one head at a time (8 vector accumulators,
// one 8-way transposing sum), and the value pass keeps one head's accumulator in registers
// across a page's rows. Both read each page front to back for its first head and from L1 for
// the rest, and prefetch the next page's rows as they go (pages are a few KB: the hardware
// prefetchers lose the stream at each page boundary).
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "attention_common.h"
#include "simd8.h"

namespace loraserve_attention {

using loraserve_simd::f32x8;
using loraserve_simd::lane_sums;
using loraserve_simd::load8;
using loraserve_simd::splat8;
using loraserve_simd::store8;

inline void prefetch_rows(const float* first, int64_t num_rows, int64_t row_stride, int64_t row_bytes) {
  for (int64_t r = 0; r < num_rows; ++r) prefetch_row(first + r * row_stride, row_bytes);
}

// Whether the tiled version applies: rows in groups of 8 inside a page, head_dim in {32, 64, 128}.
inline bool can_tile(int64_t head_dim, int64_t block_size) {
  return block_size % 8 == 0 && (head_dim == 32 || head_dim == 64 || head_dim == 128);
}

// kChunks = head_dim / 8 vectors per head row.
template <int kChunks>
void decode_attention_tiled(const at::Tensor& query, const at::Tensor& kv, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, at::Tensor& out) {
  constexpr int64_t head_dim = kChunks * 8;
  const int64_t num_seqs = query.size(0), num_heads = query.size(1);
  const int64_t block_size = kv.size(2), num_kv_heads = kv.size(3);
  const int64_t group = num_heads / num_kv_heads, max_blocks = block_tables.size(1);
  const int64_t page_stride = kv.stride(0), kv_stride = kv.stride(1), row_stride = kv.stride(2);
  const int64_t row_bytes = num_kv_heads * head_dim * static_cast<int64_t>(sizeof(float));
  const float* q_ptr = query.data_ptr<float>();
  const float* kv_ptr = kv.data_ptr<float>();
  const int64_t* table_ptr = block_tables.data_ptr<int64_t>();
  const int64_t* len_ptr = context_lens.data_ptr<int64_t>();
  float* out_ptr = out.data_ptr<float>();
  const float fscale = static_cast<float>(scale);
  const int num_threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(num_seqs)));

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores, q(num_heads * head_dim), sums(num_heads);
#pragma omp for schedule(dynamic, 1)
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
      const int64_t n = len_ptr[seq];
      const int64_t* table = table_ptr + seq * max_blocks;
      const int64_t num_blocks = (n + block_size - 1) / block_size;
      const int64_t padded = num_blocks * block_size;  // scores of the last page's unused rows: ignored
      scores.resize(num_heads * padded);
      const float* src = q_ptr + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) q[i] = src[i] * fscale;

      // scores[h, j] = q[h] . K[j, h / group], 8 rows of one head at a time
      for (int64_t b = 0; b < num_blocks; ++b) {
        const float* page = kv_ptr + table[b] * page_stride;
        const float* next = b + 1 < num_blocks ? kv_ptr + table[b + 1] * page_stride : nullptr;
        const int64_t rows = std::min(block_size, n - b * block_size);
        for (int64_t r0 = 0; r0 < rows; r0 += 8) {
          if (next != nullptr) prefetch_rows(next + r0 * row_stride, 8, row_stride, row_bytes);
          for (int64_t h = 0; h < num_heads; ++h) {
            const float* key = page + r0 * row_stride + (h / group) * head_dim;
            const float* qh = q.data() + h * head_dim;
            f32x8 acc[8] = {};
            for (int c = 0; c < kChunks; ++c) {
              const f32x8 qc = load8(qh + 8 * c);
              for (int i = 0; i < 8; ++i) acc[i] += qc * load8(key + i * row_stride + 8 * c);
            }
            store8(scores.data() + h * padded + b * block_size + r0, lane_sums(acc));
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        sums[h] = exp_shifted_in_place(scores.data() + h * padded, n);
      }

      // out[h] = sum_j p[h, j] V[j, h / group], one head's accumulator in registers per page
      float* dst = out_ptr + seq * num_heads * head_dim;
      std::fill(dst, dst + num_heads * head_dim, 0.f);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const float* page = kv_ptr + table[b] * page_stride + kv_stride;
        const float* next = b + 1 < num_blocks ? kv_ptr + table[b + 1] * page_stride + kv_stride : nullptr;
        const int64_t rows = std::min(block_size, n - b * block_size);
        if (next != nullptr) prefetch_rows(next, rows, row_stride, row_bytes);
        for (int64_t h = 0; h < num_heads; ++h) {
          const float* value = page + (h / group) * head_dim;
          const float* p = scores.data() + h * padded + b * block_size;
          f32x8 acc[kChunks];
          for (int c = 0; c < kChunks; ++c) acc[c] = load8(dst + h * head_dim + 8 * c);
          for (int64_t r = 0; r < rows; ++r) {
            const f32x8 pr = splat8(p[r]);
            for (int c = 0; c < kChunks; ++c) acc[c] += pr * load8(value + r * row_stride + 8 * c);
          }
          for (int c = 0; c < kChunks; ++c) store8(dst + h * head_dim + 8 * c, acc[c]);
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        const f32x8 inv = splat8(1.f / sums[h]);
        for (int c = 0; c < kChunks; ++c) store8(dst + h * head_dim + 8 * c, load8(dst + h * head_dim + 8 * c) * inv);
      }
    }
  }
}

}  // namespace loraserve_attention

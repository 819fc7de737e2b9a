// Paged decode attention, register-tiled, over float32 or bfloat16 KV (bfloat16 widened to float32
// as it is read, the output rounded once to nearest even); included by cpu_kernels.cpp only. Same
// semantics, arguments and work split as the generic decode_attention_impl there:
//   out[s, h] = softmax_j(scale * q[s, h] . K[s, j, h / group]) @ V[s, j, h / group],  j < context_lens[s]
// with K/V row j of sequence s in page block_tables[s, j / B], row j % B. One sequence per work
// item; scores and accumulation float32.
//
// Why a second version: the generic loops reach ~14 GB/s of KV even with the KV hot in cache (one
// horizontal sum per score, the accumulators loaded and stored for every row), so they are
// compute-bound. Here scores take 8 rows of one head at a time (8 vector accumulators, one 8-way
// transposing sum), and each head's output accumulator stays in registers across a page's rows.
// One pass over the pages with an online softmax (each head's running max and sum; the output
// rescaled when the max grows) reads every page once, K half then V half, and the page two ahead is
// prefetched into L2 a few lines per step of work: with the KV cold in DRAM, demand misses left
// compute and memory serialized (~7.5 GB/s a thread, vs ~16 hot), a burst of prefetches fills the
// miss buffers and stalls the loads just the same, and prefetching into L1 took ~1.3x as long as
// into L2 (SmolLM2's 64-sequence decode, 30 layers of cold KV).
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_common.h"
#include "bf16_bits.h"
#include "decode_attention_pages.h"
#include "simd8.h"

namespace loraserve_attention {

using loraserve_simd::f32x8;
using loraserve_simd::lane_sums;
using loraserve_simd::load8;
using loraserve_simd::splat8;
using loraserve_simd::store8;

inline bool can_tile(int64_t head_dim, int64_t block_size) {
  return block_size % 8 == 0 &&
         (head_dim == 16 || head_dim == 32 || head_dim == 48 || head_dim == 64 || head_dim == 96 || head_dim == 128);
}

// The tiled kernel's element types: float, or bfloat16 as its bits (uint16_t). 16 elements of a
// row load as two vectors of 8 floats: in order for float; for bfloat16, each word unpacked under a
// zero word (a shuffle, which leaves the FMA ports to the FMAs; a shift would compete for them),
// which takes elements 0-3 and 8-11 into the first vector and 4-7 and 12-15 into the second. A
// bfloat16 query and output use the same order (kv_order swaps the middle quarters of each 16), so
// the dot products and the value sums need no shuffle back.
inline void load_kv16(const float* p, f32x8& first, f32x8& second) {
  first = load8(p);
  second = load8(p + 8);
}
inline void load_kv16(const uint16_t* p, f32x8& first, f32x8& second) {
  using u16x16 = uint16_t __attribute__((vector_size(32)));
  loraserve_bf16::load_unpacked<f32x8, u16x16>(p, first, second);
}
// Where element i of a row sits in load_kv16's two vectors (self-inverse): in place for float; for
// bfloat16 the middle quarters of each 16 swap places.
template <typename T>
constexpr int64_t kv_order(int64_t i) {
  if constexpr (std::is_same_v<T, float>) return i;
  const int64_t quarter = (i / 4) % 4;
  return quarter == 1 ? i + 4 : quarter == 2 ? i - 4 : i;
}
inline float widen_kv(float x) { return x; }
inline float widen_kv(uint16_t x) { return loraserve_bf16::widened(x); }

// kChunks = head_dim / 8 vectors per head row (even); T = float or uint16_t (bfloat16 bits) for query, KV
// and output alike.
template <int kChunks, typename T>
void decode_attention_tiled(const at::Tensor& query, const at::Tensor& kv, const at::Tensor& block_tables,
                            const at::Tensor& context_lens, double scale, at::Tensor& out) {
  static_assert(kChunks % 2 == 0, "rows load 16 elements at a time; kv_order permutes within 16");
  constexpr bool kFloat = std::is_same_v<T, float>;
  constexpr int64_t head_dim = kChunks * 8;
  const PagedArgs<T> a(query, kv, block_tables, context_lens, out);
  const int64_t num_heads = a.num_heads, block_size = a.block_size, group = a.group, row_stride = a.row_stride;
  const float fscale = static_cast<float>(scale);
  // A page's lines are issued over the first half of one page's work, counted in value rows
  // (num_heads * block_size of them) and score tiles (an eighth as many, each about as much work
  // as 8 value rows: given 3 rows' share), which over the whole page issue >= twice the page's
  // lines (measured: 0.95x the time of spreading them over all of it).
  const int64_t lines_per_row = 2 * std::max<int64_t>(1, (3 * (a.page_bytes / 64) + 4 * num_heads * block_size - 1) /
                                                             (4 * num_heads * block_size));
  const int64_t lines_per_tile = 3 * lines_per_row;

#pragma omp parallel num_threads(a.num_threads)
  {
    SoftmaxState<f32x8> softmax(num_heads, block_size);
    std::vector<float> q(num_heads * head_dim);
    std::vector<float> sums_out(kFloat ? 0 : num_heads * head_dim);  // bfloat16: the output until it is rounded
    PagePrefetcher prefetcher;
#pragma omp for schedule(dynamic, kSeqsPerItem)
    for (int64_t seq = 0; seq < a.num_seqs; ++seq) {
      const T* src = a.q + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) q[kv_order<T>(i)] = widen_kv(src[i]) * fscale;
      float* dst = sums_out.data();
      if constexpr (kFloat) dst = a.out + seq * num_heads * head_dim;
      std::fill(dst, dst + num_heads * head_dim, 0.f);
      softmax.start_sequence();

      // One pass over the pages, K half then V half of each: the page's scores (padded rows past n
      // are computed and ignored), then each head's online-softmax update of max, sum and output.
      for_each_page(a, seq, prefetcher, [&](const T* page, int64_t rows) {
        for (int64_t r0 = 0; r0 < rows; r0 += 8) {
          for (int64_t g = 0; g < a.num_kv_heads; ++g) {
            const T* key = page + r0 * row_stride + g * head_dim;
            for (int64_t h = g * group; h < (g + 1) * group; ++h) {
              const float* qh = q.data() + h * head_dim;
              f32x8 acc[8] = {};
              for (int c = 0; c < kChunks; c += 2) {
                const f32x8 q0 = load8(qh + 8 * c), q1 = load8(qh + 8 * c + 8);
                for (int i = 0; i < 8; ++i) {
                  f32x8 k0, k1;
                  load_kv16(key + i * row_stride + 8 * c, k0, k1);
                  acc[i] += q0 * k0;
                  acc[i] += q1 * k1;
                }
              }
              store8(softmax.head_scores(h) + r0, lane_sums(acc));
              prefetcher.advance(lines_per_tile);
            }
          }
        }
        softmax.update(rows);
        const T* values = page + a.kv_stride;
        for (int64_t g = 0; g < a.num_kv_heads; ++g) {
          const T* value = values + g * head_dim;
          for (int64_t h = g * group; h < (g + 1) * group; ++h) {
            const float* s = softmax.head_scores(h);
            float* o = dst + h * head_dim;
            const f32x8 corr = splat8(softmax.corrections[h]);
            f32x8 acc[kChunks];
            for (int c = 0; c < kChunks; ++c) acc[c] = load8(o + 8 * c) * corr;
            for (int64_t r = 0; r < rows; ++r) {
              prefetcher.advance(lines_per_row);
              const f32x8 pr = splat8(s[r]);
              for (int c = 0; c < kChunks; c += 2) {
                f32x8 v0, v1;
                load_kv16(value + r * row_stride + 8 * c, v0, v1);
                acc[c] += pr * v0;
                acc[c + 1] += pr * v1;
              }
            }
            for (int c = 0; c < kChunks; ++c) store8(o + 8 * c, acc[c]);
          }
        }
      });
      for (int64_t h = 0; h < num_heads; ++h) {
        const f32x8 inv = splat8(1.f / softmax.sums[h]);
        for (int c = 0; c < kChunks; ++c) store8(dst + h * head_dim + 8 * c, load8(dst + h * head_dim + 8 * c) * inv);
      }
      if constexpr (!kFloat) {
        T* rounded = a.out + seq * num_heads * head_dim;
        for (int64_t i = 0; i < num_heads * head_dim; ++i) rounded[i] = loraserve_bf16::rounded_bits(dst[kv_order<T>(i)]);
      }
    }
  }
}

}  // namespace loraserve_attention

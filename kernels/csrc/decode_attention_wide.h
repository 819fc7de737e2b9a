// Paged decode attention on 16-lane vectors (AVX-512), over float32 or bfloat16 KV; included by
// cpu_kernels.cpp only, compiled where the build targets AVX-512. Same semantics, arguments and
// work split as decode_attention_tiled.h (the 8-lane kernel, which stays the choice elsewhere):
//   out[s, h] = softmax_j(scale * q[s, h] . K[s, j, h / group]) @ V[s, j, h / group],  j < context_lens[s]
// with K/V row j of sequence s in page block_tables[s, j / B], row j % B; scores and accumulation
// float32, a bfloat16 output rounded once to nearest even.
//
// What differs from the 8-lane kernel, besides the width: a head's scores of 16 rows come out of
// 16 accumulators in one transposing sum (4 levels of two shuffles and an add: 45 ops for 16
// scores), each row's accumulator placed at the bit-reversed index of its row so the sums come out
// in row order; the value rows serve up to four heads of a group per load; a bfloat16 page is
// widened once into a float32 scratch copy (in the unpacked order of bf16_bits.h), which every
// head of a group then reads, instead of unpacking each row once per head. Pages are prefetched two
// ahead into L2 as in the 8-lane kernel. Needs block_size % 16 == 0 and head_dim % 16 == 0 (bfloat16:
// % 32); can_run_wide says so.
#pragma once

#if defined(__AVX512F__)
#define LORASERVE_DECODE_ATTENTION_WIDE 1

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention_common.h"
#include "bf16_bits.h"
#include "decode_attention_pages.h"
#include "decode_attention_tiled.h"
#include "simd16.h"

namespace loraserve_attention {

using loraserve_simd::f32x16;
using loraserve_simd::i32x16;
using loraserve_simd::load16;
using loraserve_simd::splat16;
using loraserve_simd::store16;

inline bool can_run_wide(int64_t head_dim, int64_t block_size, bool bfloat16) {
  return block_size % 16 == 0 && head_dim % (bfloat16 ? 32 : 16) == 0 && head_dim >= 16 && head_dim <= 128;
}

#if defined(__clang__)
#define LORASERVE_SHUFFLE16(a, b, ...) __builtin_shufflevector(a, b, __VA_ARGS__)
#else
#define LORASERVE_SHUFFLE16(a, b, ...) __builtin_shuffle(a, b, i32x16{__VA_ARGS__})
#endif

// Lane i of the result is the sum of the 16 lanes of acc[reversed(i)] (reversed: the 4-bit
// bit reversal, its own inverse): each level halves the vectors, the two shuffles of a pair
// placing half of each one's partial sums side by side.
inline f32x16 transposed_sums(const f32x16* acc) {
  f32x16 r[8], u[4], w[2];
  for (int j = 0; j < 8; ++j)  // lanes 0-7: acc[2j]'s halves summed, 8-15: acc[2j+1]'s
    r[j] = LORASERVE_SHUFFLE16(acc[2 * j], acc[2 * j + 1], 0, 1, 2, 3, 4, 5, 6, 7, 16, 17, 18, 19, 20, 21, 22, 23) +
           LORASERVE_SHUFFLE16(acc[2 * j], acc[2 * j + 1], 8, 9, 10, 11, 12, 13, 14, 15, 24, 25, 26, 27, 28, 29, 30, 31);
  for (int j = 0; j < 4; ++j)
    u[j] = LORASERVE_SHUFFLE16(r[2 * j], r[2 * j + 1], 0, 1, 2, 3, 16, 17, 18, 19, 8, 9, 10, 11, 24, 25, 26, 27) +
           LORASERVE_SHUFFLE16(r[2 * j], r[2 * j + 1], 4, 5, 6, 7, 20, 21, 22, 23, 12, 13, 14, 15, 28, 29, 30, 31);
  for (int j = 0; j < 2; ++j)
    w[j] = LORASERVE_SHUFFLE16(u[2 * j], u[2 * j + 1], 0, 1, 16, 17, 4, 5, 20, 21, 8, 9, 24, 25, 12, 13, 28, 29) +
           LORASERVE_SHUFFLE16(u[2 * j], u[2 * j + 1], 2, 3, 18, 19, 6, 7, 22, 23, 10, 11, 26, 27, 14, 15, 30, 31);
  return LORASERVE_SHUFFLE16(w[0], w[1], 0, 16, 2, 18, 4, 20, 6, 22, 8, 24, 10, 26, 12, 28, 14, 30) +
         LORASERVE_SHUFFLE16(w[0], w[1], 1, 17, 3, 19, 5, 21, 7, 23, 9, 25, 11, 27, 13, 29, 15, 31);
}

constexpr int reversed4(int i) { return ((i & 1) << 3) | ((i & 2) << 1) | ((i & 4) >> 1) | ((i & 8) >> 3); }

// Where element i of a bfloat16 row sits once widened by load_unpacked in 32-element steps (self-inverse
// only for float, where it is i): within each 8 words, 0-3 go to the first vector, 4-7 to the second.
template <typename T>
constexpr int64_t wide_order(int64_t i) {
  if constexpr (std::is_same_v<T, float>) return i;
  const int64_t within = i % 32;
  return i - within + (within % 8 < 4 ? 0 : 16) + within / 8 * 4 + within % 4;
}

// Scores of one head for 16 rows of keys (rows of stride row_stride, float32): q . key_r.
template <int kVecs>
inline f32x16 head_scores(const float* qh, const float* key, int64_t row_stride) {
  f32x16 acc[16];
  for (int i = 0; i < 16; ++i) acc[i] = splat16(0.f);
  for (int c = 0; c < kVecs; ++c) {
    const f32x16 q = load16(qh + 16 * c);
#pragma GCC unroll 16
    for (int i = 0; i < 16; ++i) acc[reversed4(i)] += q * load16(key + i * row_stride + 16 * c);
  }
  return transposed_sums(acc);
}

// Row r of values as kVecs float32 vectors: float read as it is; bfloat16 widened in registers, in
// wide_order<uint16_t>.
template <int kVecs>
inline void load_value_row(const float* row, f32x16* v) {
  for (int c = 0; c < kVecs; ++c) v[c] = load16(row + 16 * c);
}
template <int kVecs>
inline void load_value_row(const uint16_t* row, f32x16* v) {
  static_assert(kVecs % 2 == 0, "bfloat16 rows widen 32 elements at a time");
  for (int c = 0; c < kVecs; c += 2)
    loraserve_bf16::load_unpacked<f32x16, uint16_t __attribute__((vector_size(64)))>(row + 16 * c, v[c], v[c + 1]);
}

// o_h = o_h * correction_h + sum_r p_h[r] * value_r for NH heads of one group (their outputs,
// scores and corrections at stride head_dim, block_size and 1), over `rows` value rows, each row
// loaded once for all NH heads (T: float, or uint16_t for bfloat16 bits).
template <int kVecs, int NH, typename T>
inline void value_rows(const T* value, int64_t row_stride, int64_t rows, const float* scores, int64_t block_size,
                       const float* corrections, float* out) {
  f32x16 acc[NH][kVecs];
  for (int h = 0; h < NH; ++h) {
    const f32x16 corr = splat16(corrections[h]);
    for (int c = 0; c < kVecs; ++c) acc[h][c] = load16(out + h * kVecs * 16 + 16 * c) * corr;
  }
  for (int64_t r = 0; r < rows; ++r) {
    f32x16 v[kVecs];
    load_value_row<kVecs>(value + r * row_stride, v);
    for (int h = 0; h < NH; ++h) {
      const f32x16 p = splat16(scores[h * block_size + r]);
      for (int c = 0; c < kVecs; ++c) acc[h][c] += p * v[c];
    }
  }
  for (int h = 0; h < NH; ++h)
    for (int c = 0; c < kVecs; ++c) store16(out + h * kVecs * 16 + 16 * c, acc[h][c]);
}

// Calls f(std::integral_constant<int, NH>{}) with NH = min(count, kMax), 1 to 4: the number of a
// group's heads one value-rows call serves, as a compile-time constant.
template <int kMax, typename F>
inline void with_head_count(int64_t count, F&& f) {
  switch (std::min<int64_t>(kMax, count)) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: if constexpr (kMax >= 2) f(std::integral_constant<int, 2>{}); break;
    case 3: if constexpr (kMax >= 3) f(std::integral_constant<int, 3>{}); break;
    default: if constexpr (kMax >= 4) f(std::integral_constant<int, 4>{}); break;
  }
}

// How many heads of a group one value-rows call serves: those whose value accumulators fit the
// registers beside the value row (24 of 32), 1 to 4.
constexpr int heads_at_once(int vecs) { return std::max(1, std::min(4, 24 / vecs - 1)); }

// fn(g, h, heads) for each KV head g and each run of a group's query heads from h, up to kMax at a
// time (heads: std::integral_constant<int, NH>, the run's length).
template <int kMax, typename F>
inline void for_head_runs(int64_t num_kv_heads, int64_t group, F&& fn) {
  for (int64_t g = 0; g < num_kv_heads; ++g)
    for (int64_t h = g * group; h < (g + 1) * group; h += kMax)
      with_head_count<kMax>((g + 1) * group - h, [&](auto heads) { fn(g, h, heads); });
}

// Lines of the page ahead to prefetch at each head's score tile and each value-rows call, so that
// a page's lines are issued evenly over its work (measured: 0.84x the time of issuing them all
// during the score tiles, twice as many 1.15x).
template <typename T>
inline int64_t lines_per_call(const PagedArgs<T>& a, int heads_per_call) {
  const int64_t value_calls = a.num_kv_heads * ((a.group + heads_per_call - 1) / heads_per_call);
  return (a.page_bytes / 64) / (a.num_heads * (a.block_size / 16) + value_calls) + 1;
}

// Each head's output divided by its softmax sum: acc [num_heads, kVecs * 16] float32 (the output
// itself for float; for bfloat16, in wide_order<uint16_t>, rounded once to nearest even into out).
template <int kVecs, typename T>
inline void finish_heads(float* acc, const float* sums, int64_t num_heads, T* out) {
  constexpr int64_t head_dim = kVecs * 16;
  for (int64_t h = 0; h < num_heads; ++h) {
    const f32x16 inv = splat16(1.f / sums[h]);
    for (int c = 0; c < kVecs; ++c) store16(acc + h * head_dim + 16 * c, load16(acc + h * head_dim + 16 * c) * inv);
  }
  if constexpr (!std::is_same_v<T, float>) {
    for (int64_t h = 0; h < num_heads; ++h)
      for (int64_t i = 0; i < head_dim; ++i)
        out[h * head_dim + i] = loraserve_bf16::rounded_bits(acc[h * head_dim + wide_order<T>(i)]);
  }
}

// kVecs = head_dim / 16; T = float or uint16_t (bfloat16 bits) for query, KV and output alike.
template <int kVecs, typename T>
void decode_attention_wide(const at::Tensor& query, const at::Tensor& kv, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, double scale, at::Tensor& out) {
  constexpr bool kFloat = std::is_same_v<T, float>;
  static_assert(kFloat || kVecs % 2 == 0, "bfloat16 rows widen 32 elements at a time");
  constexpr int64_t head_dim = kVecs * 16;
  constexpr int kHeadsAtOnce = heads_at_once(kVecs);
  const PagedArgs<T> a(query, kv, block_tables, context_lens, out);
  const int64_t num_heads = a.num_heads, block_size = a.block_size, num_kv_heads = a.num_kv_heads;
  const float fscale = static_cast<float>(scale);
  const int64_t lines = lines_per_call(a, kHeadsAtOnce);

#pragma omp parallel num_threads(a.num_threads)
  {
    SoftmaxState<f32x16> softmax(num_heads, block_size);
    std::vector<float> q(num_heads * head_dim);
    std::vector<float> sums_out(kFloat ? 0 : num_heads * head_dim);      // bfloat16: the output until it is rounded
    std::vector<float> widened(kFloat ? 0 : 2 * block_size * num_kv_heads * head_dim);  // bfloat16: one page as float32
    PagePrefetcher prefetcher;
#pragma omp for schedule(dynamic, kSeqsPerItem)
    for (int64_t seq = 0; seq < a.num_seqs; ++seq) {
      const T* src = a.q + seq * num_heads * head_dim;
      for (int64_t h = 0; h < num_heads; ++h)
        for (int64_t i = 0; i < head_dim; ++i)
          q[h * head_dim + wide_order<T>(i)] = widen_kv(src[h * head_dim + i]) * fscale;
      float* dst = sums_out.data();
      if constexpr (kFloat) dst = a.out + seq * num_heads * head_dim;
      std::fill(dst, dst + num_heads * head_dim, 0.f);
      softmax.start_sequence();

      for_each_page(a, seq, prefetcher, [&](const T* page, int64_t rows) {
        // The page as float32 rows: in place for float; for bfloat16 widened once into `widened`
        // (rows of num_kv_heads * head_dim, K half then V half; rows past n left as they were).
        const float* keys;
        int64_t stride = a.row_stride, half = a.kv_stride;
        if constexpr (kFloat) {
          keys = page;
        } else {
          const int64_t width = num_kv_heads * head_dim;
          for (int64_t part = 0; part < 2; ++part)
            for (int64_t r = 0; r < rows; ++r) {
              const T* from = page + part * a.kv_stride + r * a.row_stride;
              float* to = widened.data() + (part * block_size + r) * width;
              for (int64_t e = 0; e < width; e += 32) {
                f32x16 first, second;
                loraserve_bf16::load_unpacked<f32x16, uint16_t __attribute__((vector_size(64)))>(from + e, first,
                                                                                                  second);
                store16(to + e, first);
                store16(to + e + 16, second);
              }
            }
          keys = widened.data();
          stride = width;
          half = block_size * width;
        }
        for (int64_t t = 0; t < block_size / 16; ++t) {
          for (int64_t h = 0; h < num_heads; ++h) {
            const float* key = keys + t * 16 * stride + (h / a.group) * head_dim;
            store16(softmax.head_scores(h) + t * 16, head_scores<kVecs>(q.data() + h * head_dim, key, stride));
            prefetcher.advance(lines);
          }
        }
        softmax.update(rows);
        for_head_runs<kHeadsAtOnce>(num_kv_heads, a.group, [&](int64_t g, int64_t h, auto heads) {
          prefetcher.advance(lines);
          value_rows<kVecs, decltype(heads)::value, float>(keys + half + g * head_dim, stride, rows, softmax.head_scores(h),
                                                    block_size, softmax.corrections.data() + h, dst + h * head_dim);
        });
      });
      finish_heads<kVecs, T>(dst, softmax.sums.data(), num_heads, a.out + seq * num_heads * head_dim);
    }
  }
}

}  // namespace loraserve_attention

#endif  // __AVX512F__

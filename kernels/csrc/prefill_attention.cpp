// Paged prefill attention for all the prompts (or prompt chunks) of a step in one call; semantics
// and shapes in kernels/cpu.py (paged_prefill_attention), reference kernels/paged_attention.py.
//
// Work items are (sequence, KV head, block of 64 query rows), scheduled dynamically. An item walks
// the sequence's context kChunk positions at a time (one vector register: 16 lanes with AVX-512,
// 8 otherwise), as far as its last row may look (causal): those keys and values of its KV head are
// gathered from their pages (any block size, any dtype) into float buffers, keys transposed; then,
// 6 query vectors (row x head of the group) at a time, kChunk scores each come out of one
// accumulator over head_dim (6 independent chains, each key row loaded once), and an
// online-softmax step folds them into the vectors' outputs, kChunk columns at a time in registers.
// In bfloat16 on a CPU with AVX512-BF16 the keys stay bfloat16: gathered as head_dim pairs, each
// dot product instruction takes two terms of every score (the products exact, the sums float32, the
// scale applied to the sums), about half the instructions of widening them (benchmarks/RESULTS.md,
// 2026-12-07); the values are widened.
// Every page id a sequence uses is checked against the pool before any work starts.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif

#include "attention_common.h"
#include "prefill_attention_amx.h"
#include "simd16.h"
#include "simd8.h"

namespace {

// Without AVX-512 a 16-lane vector is two registers that GCC moves through the stack at every
// use (the kernel ran ~8x slower than its arithmetic allows on an AVX2 CPU): there it is 8 lanes.
#if defined(__AVX512F__)
using VecF = loraserve_simd::f32x16;
using VecI = loraserve_simd::i32x16;
constexpr int64_t kChunk = 16;  // context positions per step: one score vector
constexpr VecI kLaneIds = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};
inline VecF splat_v(float x) { return loraserve_simd::splat16(x); }

#if defined(__clang__)
#define LORASERVE_SHUFFLE16(v, ...) __builtin_shufflevector(v, v, __VA_ARGS__)
#else
#define LORASERVE_SHUFFLE16(v, ...) __builtin_shuffle(v, VecI{__VA_ARGS__})
#endif

// The largest lane, by a tree of lane swaps (no serial chain through the lanes).
inline float hmax_v(VecF m) {
  VecF t = LORASERVE_SHUFFLE16(m, 8, 9, 10, 11, 12, 13, 14, 15, 0, 1, 2, 3, 4, 5, 6, 7);
  m = m > t ? m : t;
  t = LORASERVE_SHUFFLE16(m, 4, 5, 6, 7, 0, 1, 2, 3, 12, 13, 14, 15, 8, 9, 10, 11);
  m = m > t ? m : t;
  t = LORASERVE_SHUFFLE16(m, 2, 3, 0, 1, 6, 7, 4, 5, 10, 11, 8, 9, 14, 15, 12, 13);
  m = m > t ? m : t;
  t = LORASERVE_SHUFFLE16(m, 1, 0, 3, 2, 5, 4, 7, 6, 9, 8, 11, 10, 13, 12, 15, 14);
  m = m > t ? m : t;
  return m[0];
}

inline VecF exp_v(VecF x) {
  return loraserve_attention::exp_lanes_nonpositive<VecF, VecI>(x, splat_v(-87.0f), splat_v(12582912.0f));
}
#else
using VecF = loraserve_simd::f32x8;
using VecI = loraserve_simd::i32x8;
using loraserve_simd::i32x8;  // (LORASERVE_SHUFFLE2 names it)
constexpr int64_t kChunk = 8;
constexpr VecI kLaneIds = {0, 1, 2, 3, 4, 5, 6, 7};
inline VecF splat_v(float x) { return loraserve_simd::splat8(x); }

inline float hmax_v(VecF m) {
  VecF t = LORASERVE_SHUFFLE2(m, m, 4, 5, 6, 7, 0, 1, 2, 3);
  m = m > t ? m : t;
  t = LORASERVE_SHUFFLE2(m, m, 2, 3, 0, 1, 6, 7, 4, 5);
  m = m > t ? m : t;
  t = LORASERVE_SHUFFLE2(m, m, 1, 0, 3, 2, 5, 4, 7, 6);
  m = m > t ? m : t;
  return m[0];
}

inline VecF exp_v(VecF x) { return loraserve_attention::exp8_nonpositive(x); }
#endif

inline VecF load_v(const float* p) {
  VecF v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store_v(float* p, VecF v) { std::memcpy(p, &v, sizeof(v)); }

constexpr int64_t kQueryBlock = 64;  // query rows per work item (the gathered keys and values serve them all)
constexpr int64_t kVecBlock = 6;     // query vectors whose scores and outputs are computed together

// bfloat16 scores by AVX512-BF16 pair dots where the CPU has them: the query and the gathered keys
// stay bfloat16, each dot product takes two head_dim terms (products exact, sums float32), and the
// scale multiplies the sums. Without them (or for float32 and float16) the keys are widened.
#if defined(__AVX512BF16__) && defined(__AVX512F__)
#define LORASERVE_PREFILL_PAIR_DOTS 1
constexpr bool kPairDots = true;
// scores[b] += sum over pairs p of q_b's pair p . keys' pair p, 16 keys (lanes) at once
inline void pair_dot_scores(const uint32_t* keys_p, const uint32_t* const* qs, int64_t num_pairs, VecF* scores,
                            int64_t nb) {
  __m512 acc[kVecBlock];
  for (int64_t b = 0; b < kVecBlock; ++b) acc[b] = _mm512_setzero_ps();
  for (int64_t p = 0; p < num_pairs; ++p) {
    const __m512bh key = (__m512bh)_mm512_loadu_si512(keys_p + p * kChunk);
    for (int64_t b = 0; b < kVecBlock; ++b)
      acc[b] = _mm512_dpbf16_ps(acc[b], key, (__m512bh)_mm512_set1_epi32(static_cast<int>(qs[b][p])));
  }
  for (int64_t b = 0; b < nb; ++b) scores[b] = (VecF)acc[b];
}
#else
constexpr bool kPairDots = false;
#endif

template <typename scalar_t>
void prefill_impl(const at::Tensor& query, const at::Tensor& kv, const std::vector<int64_t>& starts,
                  const std::vector<int64_t>& cached, const at::Tensor& block_tables, double scale, at::Tensor& out) {
  const int64_t num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = kv.size(2), num_kv_heads = kv.size(3), group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t page_stride = kv.stride(0), half_stride = kv.stride(1), row_stride = kv.stride(2);
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* kv_ptr = kv.data_ptr<scalar_t>();
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);
  constexpr bool kPairs = kPairDots && std::is_same_v<scalar_t, at::BFloat16>;
  const bool pairs = kPairs && head_dim % 2 == 0;  // bfloat16 scores by pair dots (queries and keys as pairs)
  const int64_t num_pairs = head_dim / 2;

  const std::vector<loraserve_attention::PrefillItem> items =
      loraserve_attention::prefill_items(starts, num_kv_heads, kQueryBlock);

  const int64_t num_items = static_cast<int64_t>(items.size());
  const int num_threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(num_items)));
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t vecs = kQueryBlock * group;  // query vectors of an item: rows x heads of the group
    // keys and queries as floats for the widening loops, as bfloat16 pairs for the pair dots
    std::vector<float> keys_t(pairs ? 0 : head_dim * kChunk), q(pairs ? 0 : vecs * head_dim);
    std::vector<float> values(kChunk * head_dim), acc(vecs * head_dim);
    std::vector<float> max_score(vecs);
    std::vector<VecF> sums(vecs);
    std::vector<uint32_t> keys_p(pairs ? num_pairs * kChunk : 0), q_p(pairs ? vecs * num_pairs : 0);  // bf16 pairs
#pragma omp for schedule(dynamic, 1)
    for (int64_t item_index = 0; item_index < num_items; ++item_index) {
      const loraserve_attention::PrefillItem item = items[item_index];
      const int64_t first_row = starts[item.seq] + item.row0, num_cached = cached[item.seq];
      const int64_t* table = tables + item.seq * max_blocks;
      for (int64_t i = 0; i < item.rows; ++i)
        for (int64_t hh = 0; hh < group; ++hh) {
          const scalar_t* src = q_ptr + ((first_row + i) * num_heads + item.kv_head * group + hh) * head_dim;
          if (pairs) {
            std::memcpy(q_p.data() + (i * group + hh) * num_pairs, src, head_dim * sizeof(scalar_t));
            continue;
          }
          float* dst = q.data() + (i * group + hh) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * fscale;
        }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(max_score.begin(), max_score.end(), -std::numeric_limits<float>::infinity());
      std::fill(sums.begin(), sums.end(), splat_v(0.f));
      const int64_t num_keys = num_cached + item.row0 + item.rows;  // the last row sees positions < this
      for (int64_t j0 = 0; j0 < num_keys; j0 += kChunk) {
        const int64_t chunk = std::min(kChunk, num_keys - j0);
        for (int64_t jj = 0; jj < kChunk; ++jj) {
          if (jj >= chunk) {
            if (pairs) {
              for (int64_t p = 0; p < num_pairs; ++p) keys_p[p * kChunk + jj] = 0;
            } else {
              for (int64_t d = 0; d < head_dim; ++d) keys_t[d * kChunk + jj] = 0.f;
            }
            continue;
          }
          const int64_t pos = j0 + jj;
          const scalar_t* row = kv_ptr + table[pos / block_size] * page_stride + (pos % block_size) * row_stride +
                                item.kv_head * head_dim;
          const scalar_t* value_row = row + half_stride;
          if (pairs) {  // the key's bfloat16 pairs as they are, the values widened
            for (int64_t p = 0; p < num_pairs; ++p) std::memcpy(&keys_p[p * kChunk + jj], row + 2 * p, sizeof(uint32_t));
            for (int64_t d = 0; d < head_dim; ++d) values[jj * head_dim + d] = static_cast<float>(value_row[d]);
            continue;
          }
          for (int64_t d = 0; d < head_dim; ++d) {
            keys_t[d * kChunk + jj] = static_cast<float>(row[d]);
            values[jj * head_dim + d] = static_cast<float>(value_row[d]);
          }
        }
        // the query vectors (row-major: row i, head hh -> i * group + hh) whose rows see position j0
        const int64_t v_begin = std::max<int64_t>(0, j0 - num_cached - item.row0) * group;
        const int64_t v_end = item.rows * group;
        for (int64_t v0 = v_begin; v0 < v_end; v0 += kVecBlock) {
          const int64_t nv = std::min(kVecBlock, v_end - v0);
          // scores of kVecBlock query vectors at once: independent accumulators, each key row loaded once
          VecF scores[kVecBlock];
#if defined(LORASERVE_PREFILL_PAIR_DOTS)  // (a call in a discarded branch must still name a declared function)
          if (pairs) {
            const uint32_t* qps[kVecBlock];
            for (int64_t b = 0; b < kVecBlock; ++b) qps[b] = q_p.data() + std::min(v0 + b, v_end - 1) * num_pairs;
            pair_dot_scores(keys_p.data(), qps, num_pairs, scores, nv);
            for (int64_t b = 0; b < nv; ++b) scores[b] *= fscale;
          }
#endif
          if (!pairs) {
            const float* qs[kVecBlock];
            for (int64_t b = 0; b < kVecBlock; ++b) qs[b] = q.data() + std::min(v0 + b, v_end - 1) * head_dim;
            for (int64_t b = 0; b < kVecBlock; ++b) scores[b] = splat_v(0.f);
            for (int64_t d = 0; d < head_dim; ++d) {
              const VecF key = load_v(keys_t.data() + d * kChunk);
              for (int64_t b = 0; b < kVecBlock; ++b) scores[b] += splat_v(qs[b][d]) * key;
            }
          }
          float p[kVecBlock][kChunk];
          float correction[kVecBlock];
          for (int64_t b = 0; b < nv; ++b) {  // the online-softmax step of each vector
            const int64_t v = v0 + b, i = v / group;
            const int64_t valid = std::min(chunk, num_cached + item.row0 + i + 1 - j0);  // causal: <= own
            const auto visible_lanes = kLaneIds < static_cast<int32_t>(valid);
            const VecF masked = visible_lanes ? scores[b] : splat_v(-std::numeric_limits<float>::infinity());
            const float new_max = std::max(max_score[v], hmax_v(masked));
            correction[b] = loraserve_attention::exp_nonpositive(max_score[v] - new_max);
            const VecF probs = visible_lanes ? exp_v(scores[b] - new_max) : splat_v(0.f);
            store_v(p[b], probs);
            sums[v] = sums[v] * correction[b] + probs;  // lane-wise: one horizontal sum at the end
            max_score[v] = new_max;
          }
          // acc_v = acc_v * correction + p_v @ V, kChunk columns of head_dim at a time held in registers
          // (two column vectors per pass where they fit: each broadcast probability feeds two FMAs)
          int64_t d0 = 0;
          for (; d0 + 2 * kChunk <= head_dim; d0 += 2 * kChunk) {
            VecF low[kVecBlock], high[kVecBlock];
            for (int64_t b = 0; b < nv; ++b) {
              const float* a = acc.data() + (v0 + b) * head_dim + d0;
              low[b] = load_v(a) * correction[b];
              high[b] = load_v(a + kChunk) * correction[b];
            }
            for (int64_t jj = 0; jj < chunk; ++jj) {
              const VecF value_low = load_v(values.data() + jj * head_dim + d0);
              const VecF value_high = load_v(values.data() + jj * head_dim + d0 + kChunk);
              for (int64_t b = 0; b < nv; ++b) {
                const VecF weight = splat_v(p[b][jj]);
                low[b] += weight * value_low;
                high[b] += weight * value_high;
              }
            }
            for (int64_t b = 0; b < nv; ++b) {
              float* a = acc.data() + (v0 + b) * head_dim + d0;
              store_v(a, low[b]);
              store_v(a + kChunk, high[b]);
            }
          }
          for (; d0 + kChunk <= head_dim; d0 += kChunk) {
            VecF out[kVecBlock];
            for (int64_t b = 0; b < nv; ++b) out[b] = load_v(acc.data() + (v0 + b) * head_dim + d0) * correction[b];
            for (int64_t jj = 0; jj < chunk; ++jj) {
              const VecF value = load_v(values.data() + jj * head_dim + d0);
              for (int64_t b = 0; b < nv; ++b) out[b] += splat_v(p[b][jj]) * value;
            }
            for (int64_t b = 0; b < nv; ++b) store_v(acc.data() + (v0 + b) * head_dim + d0, out[b]);
          }
          for (int64_t b = 0; b < nv; ++b) {  // the columns past the last multiple of kChunk
            float* a = acc.data() + (v0 + b) * head_dim;
            for (int64_t d = d0; d < head_dim; ++d) {
              float total = a[d] * correction[b];
              for (int64_t jj = 0; jj < chunk; ++jj) total += p[b][jj] * values[jj * head_dim + d];
              a[d] = total;
            }
          }
        }
      }
      for (int64_t i = 0; i < item.rows; ++i)
        for (int64_t hh = 0; hh < group; ++hh) {
          const int64_t v = i * group + hh;
          float total = 0.f;
          for (int jj = 0; jj < kChunk; ++jj) total += sums[v][jj];
          const float inv = 1.f / total;  // every row sees at least its own position
          scalar_t* dst = out_ptr + ((first_row + i) * num_heads + item.kv_head * group + hh) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[v * head_dim + d] * inv);
        }
    }
  }
}

}  // namespace

bool prefill_attention_amx() {
#if defined(LORASERVE_PREFILL_AMX)
  return loraserve_amx::amx_permitted();
#else
  return false;
#endif
}

at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& kv, const at::Tensor& query_starts,
                                   const at::Tensor& cached_lens, const at::Tensor& block_tables, double scale,
                                   bool tiles) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous [num_tokens, heads, head_dim]");
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2, "kv must be [num_pages, 2, block_size, kv_heads, head_dim]");
  TORCH_CHECK(kv.stride(4) == 1 && kv.stride(3) == kv.size(4), "kv rows must be contiguous");
  TORCH_CHECK(query.size(1) % kv.size(3) == 0 && query.size(2) == kv.size(4), "query and kv heads do not match");
  TORCH_CHECK(query.scalar_type() == kv.scalar_type(), "query and kv dtypes differ");
  TORCH_CHECK(query_starts.scalar_type() == at::kLong && query_starts.dim() == 1, "query_starts: int64 [num_seqs + 1]");
  TORCH_CHECK(cached_lens.scalar_type() == at::kLong && cached_lens.numel() + 1 == query_starts.numel(),
              "cached_lens: int64 [num_seqs]");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.dim() == 2 && block_tables.is_contiguous() &&
                  block_tables.size(0) == cached_lens.numel(),
              "block_tables: contiguous int64 [num_seqs, max_blocks]");
  const auto starts_acc = query_starts.contiguous();
  const auto cached_acc = cached_lens.contiguous();
  const std::vector<int64_t> starts(starts_acc.data_ptr<int64_t>(), starts_acc.data_ptr<int64_t>() + starts_acc.numel());
  const std::vector<int64_t> cached(cached_acc.data_ptr<int64_t>(), cached_acc.data_ptr<int64_t>() + cached_acc.numel());
  TORCH_CHECK(!starts.empty() && starts.front() == 0 && starts.back() == query.size(0),
              "query_starts must run from 0 to the number of query rows");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (int64_t s = 0; s + 1 < static_cast<int64_t>(starts.size()); ++s) {
    TORCH_CHECK(starts[s + 1] >= starts[s] && cached[s] >= 0, "query_starts must not decrease; cached_lens >= 0");
    loraserve_attention::check_block_table(s, cached[s] + starts[s + 1] - starts[s], tables + s * max_blocks,
                                           max_blocks, kv.size(2), kv.size(0));
  }
  at::Tensor out = at::empty_like(query);
#if defined(LORASERVE_PREFILL_AMX)
  if (tiles && query.scalar_type() == at::kBFloat16 && prefill_attention_amx()) {
    loraserve_prefill_amx::prefill(query, kv, starts, cached, block_tables, scale, out);
    return out;
  }
#endif
  switch (query.scalar_type()) {
    case at::kFloat:
      prefill_impl<float>(query, kv, starts, cached, block_tables, scale, out);
      break;
    case at::kBFloat16:
      prefill_impl<at::BFloat16>(query, kv, starts, cached, block_tables, scale, out);
      break;
    case at::kHalf:
      prefill_impl<at::Half>(query, kv, starts, cached, block_tables, scale, out);
      break;
    default:
      TORCH_CHECK(false, "paged_prefill_attention: float32, bfloat16 or float16");
  }
  return out;
}

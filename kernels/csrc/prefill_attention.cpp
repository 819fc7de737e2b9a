// Paged prefill attention for all the prompts (or prompt chunks) of a step in one call; semantics
// and shapes in kernels/cpu.py (paged_prefill_attention), reference kernels/paged_attention.py.
//
// Work items are (sequence, KV head, block of 16 query rows), scheduled dynamically. An item walks
// the sequence's context 16 positions at a time, as far as its last row may look (causal): the 16
// keys and values of its KV head are gathered from their pages (any block size, any dtype) into
// float buffers, keys transposed, then for each query row of the block and each query head of the
// group, 16 scores come out of one 16-lane accumulator over head_dim, and an online-softmax step
// folds them into that row's output. Every page id a sequence uses is checked against the pool
// before any work starts.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "attention_common.h"

namespace {

using f32x16 = float __attribute__((vector_size(64)));
constexpr int64_t kChunk = 16;      // context positions per step: one 16-lane score vector
constexpr int64_t kQueryBlock = 16;  // query rows per work item

inline f32x16 load16(const float* p) {
  f32x16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void store16(float* p, f32x16 v) { std::memcpy(p, &v, sizeof(v)); }
inline f32x16 splat16(float x) { return f32x16{x, x, x, x, x, x, x, x, x, x, x, x, x, x, x, x}; }

struct WorkItem {
  int64_t seq, kv_head, row0, rows;
};

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

  std::vector<WorkItem> items;
  for (int64_t s = 0; s + 1 < static_cast<int64_t>(starts.size()); ++s)
    for (int64_t g = 0; g < num_kv_heads; ++g)
      for (int64_t r = 0; r < starts[s + 1] - starts[s]; r += kQueryBlock)
        items.push_back({s, g, r, std::min(kQueryBlock, starts[s + 1] - starts[s] - r)});

  const int64_t num_items = static_cast<int64_t>(items.size());
  const int num_threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(num_items)));
#pragma omp parallel num_threads(num_threads)
  {
    const int64_t vecs = kQueryBlock * group;  // query vectors of an item: rows x heads of the group
    std::vector<float> keys_t(head_dim * kChunk), values(kChunk * head_dim), q(vecs * head_dim), acc(vecs * head_dim);
    std::vector<float> max_score(vecs), sum(vecs);
#pragma omp for schedule(dynamic, 1)
    for (int64_t item_index = 0; item_index < num_items; ++item_index) {
      const WorkItem item = items[item_index];
      const int64_t first_row = starts[item.seq] + item.row0, num_cached = cached[item.seq];
      const int64_t* table = tables + item.seq * max_blocks;
      for (int64_t i = 0; i < item.rows; ++i)
        for (int64_t hh = 0; hh < group; ++hh) {
          const scalar_t* src = q_ptr + ((first_row + i) * num_heads + item.kv_head * group + hh) * head_dim;
          float* dst = q.data() + (i * group + hh) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<float>(src[d]) * fscale;
        }
      std::fill(acc.begin(), acc.end(), 0.f);
      std::fill(max_score.begin(), max_score.end(), -std::numeric_limits<float>::infinity());
      std::fill(sum.begin(), sum.end(), 0.f);
      const int64_t num_keys = num_cached + item.row0 + item.rows;  // the last row sees positions < this
      for (int64_t j0 = 0; j0 < num_keys; j0 += kChunk) {
        const int64_t chunk = std::min(kChunk, num_keys - j0);
        for (int64_t jj = 0; jj < kChunk; ++jj) {
          if (jj >= chunk) {
            for (int64_t d = 0; d < head_dim; ++d) keys_t[d * kChunk + jj] = 0.f;
            continue;
          }
          const int64_t pos = j0 + jj;
          const scalar_t* row = kv_ptr + table[pos / block_size] * page_stride + (pos % block_size) * row_stride +
                                item.kv_head * head_dim;
          const scalar_t* value_row = row + half_stride;
          for (int64_t d = 0; d < head_dim; ++d) {
            keys_t[d * kChunk + jj] = static_cast<float>(row[d]);
            values[jj * head_dim + d] = static_cast<float>(value_row[d]);
          }
        }
        for (int64_t i = 0; i < item.rows; ++i) {
          const int64_t visible = num_cached + item.row0 + i + 1 - j0;  // causal: positions <= own
          if (visible <= 0) continue;
          const int64_t valid = std::min(chunk, visible);
          for (int64_t hh = 0; hh < group; ++hh) {
            const int64_t v = i * group + hh;
            const float* qv = q.data() + v * head_dim;
            f32x16 scores = splat16(0.f);
            for (int64_t d = 0; d < head_dim; ++d) scores += splat16(qv[d]) * load16(keys_t.data() + d * kChunk);
            float s[kChunk];
            store16(s, scores);
            float chunk_max = -std::numeric_limits<float>::infinity();
            for (int64_t jj = 0; jj < valid; ++jj) chunk_max = std::max(chunk_max, s[jj]);
            const float new_max = std::max(max_score[v], chunk_max);
            const float correction = loraserve_attention::exp_nonpositive(max_score[v] - new_max);
            float chunk_sum = 0.f;
            for (int64_t jj = 0; jj < kChunk; ++jj) {
              s[jj] = jj < valid ? loraserve_attention::exp_nonpositive(s[jj] - new_max) : 0.f;
              chunk_sum += s[jj];
            }
            sum[v] = sum[v] * correction + chunk_sum;
            max_score[v] = new_max;
            float* a = acc.data() + v * head_dim;
            for (int64_t d = 0; d < head_dim; ++d) a[d] *= correction;
            for (int64_t jj = 0; jj < valid; ++jj) {
              const float p = s[jj];
              const float* value = values.data() + jj * head_dim;
#pragma omp simd
              for (int64_t d = 0; d < head_dim; ++d) a[d] += p * value[d];
            }
          }
        }
      }
      for (int64_t i = 0; i < item.rows; ++i)
        for (int64_t hh = 0; hh < group; ++hh) {
          const int64_t v = i * group + hh;
          const float inv = 1.f / sum[v];  // every row sees at least its own position
          scalar_t* dst = out_ptr + ((first_row + i) * num_heads + item.kv_head * group + hh) * head_dim;
          for (int64_t d = 0; d < head_dim; ++d) dst[d] = static_cast<scalar_t>(acc[v * head_dim + d] * inv);
        }
    }
  }
}

}  // namespace

at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& kv, const at::Tensor& query_starts,
                                   const at::Tensor& cached_lens, const at::Tensor& block_tables, double scale) {
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
  const int64_t num_pages = kv.size(0), block_size = kv.size(2), max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  for (size_t s = 0; s + 1 < starts.size(); ++s) {
    TORCH_CHECK(starts[s + 1] >= starts[s] && cached[s] >= 0, "query_starts must not decrease; cached_lens >= 0");
    const int64_t context = cached[s] + starts[s + 1] - starts[s];
    const int64_t blocks = (context + block_size - 1) / block_size;
    TORCH_CHECK(blocks <= max_blocks, "sequence ", s, " needs ", blocks, " blocks, its table has ", max_blocks);
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t page = tables[s * max_blocks + b];
      TORCH_CHECK(page >= 0 && page < num_pages, "sequence ", s, " block ", b, ": page ", page,
                  " is outside the pool of ", num_pages);
    }
  }
  at::Tensor out = at::empty_like(query);
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

// What the register-tiled paged decode attentions share (decode_attention_tiled.h, _wide.h and
// _pairs.h): their arguments unpacked, the walk over one sequence's pages with the prefetch of the
// page two ahead, and one thread's online-softmax state. The kernels differ only in how they take
// a page's scores and value sums. Included by those headers only.
#pragma once

#include <ATen/Parallel.h>
#include <torch/extension.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "online_softmax.h"

namespace loraserve_attention {

// The kernels' arguments: query [num_seqs, num_heads, head_dim]; kv [num_pages, 2, block_size,
// num_kv_heads, head_dim] (a page's K half, then its V half at kv_stride; rows contiguous);
// block_tables [num_seqs, max_blocks] and context_lens [num_seqs], int64; out like query.
// T: the element type of query, kv and out (float, or uint16_t for bfloat16 bits).
template <typename T>
struct PagedArgs {
  int64_t num_seqs, num_heads, block_size, num_kv_heads, group, max_blocks;
  int64_t page_stride, kv_stride, row_stride;
  int64_t page_bytes;  // K and V halves
  const T* q;
  const T* kv;
  const int64_t* tables;
  const int64_t* lens;
  T* out;
  int num_threads;  // torch's, at most one per sequence

  PagedArgs(const at::Tensor& query, const at::Tensor& kv_pages, const at::Tensor& block_tables,
            const at::Tensor& context_lens, at::Tensor& output) {
    num_seqs = query.size(0);
    num_heads = query.size(1);
    block_size = kv_pages.size(2);
    num_kv_heads = kv_pages.size(3);
    group = num_heads / num_kv_heads;
    max_blocks = block_tables.size(1);
    page_stride = kv_pages.stride(0);
    kv_stride = kv_pages.stride(1);
    row_stride = kv_pages.stride(2);
    page_bytes = 2 * kv_stride * static_cast<int64_t>(sizeof(T));
    q = static_cast<const T*>(query.data_ptr());
    kv = static_cast<const T*>(kv_pages.data_ptr());
    tables = block_tables.data_ptr<int64_t>();
    lens = context_lens.data_ptr<int64_t>();
    out = static_cast<T*>(output.data_ptr());
    num_threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(num_seqs)));
  }
};

// Prefetches a page a few cache lines per call, so the misses overlap the current page's work.
struct PagePrefetcher {
  const char* next = nullptr;
  const char* end = nullptr;

  void start(const void* page, int64_t bytes) {
    next = reinterpret_cast<const char*>(page);
    end = next + bytes;
  }
  void advance(int64_t lines) {
    for (; lines > 0 && next < end; --lines, next += 64) __builtin_prefetch(next, 0, 2);  // into L2
  }
};

// Pages prefetched this far ahead of the one being read (measured: 2 beats 1), counted across
// sequences: a sequence's last pages prefetch the next one's first.
constexpr int64_t kPrefetchDistance = 2;
// Consecutive sequences per work item, so that the next sequence's pages prefetched at the end of
// one are mostly read by the same thread.
constexpr int64_t kSeqsPerItem = 8;

// Starts the prefetch of the page kPrefetchDistance ahead of page b of sequence seq: that
// sequence's, or past its end the next sequence's first pages (short contexts would otherwise start
// every sequence on cold pages).
template <typename T>
inline void prefetch_page_ahead(PagePrefetcher& prefetcher, const PagedArgs<T>& a, int64_t seq, int64_t b) {
  const int64_t num_blocks = (a.lens[seq] + a.block_size - 1) / a.block_size, ahead = b + kPrefetchDistance;
  if (ahead < num_blocks) {
    prefetcher.start(a.kv + a.tables[seq * a.max_blocks + ahead] * a.page_stride, a.page_bytes);
  } else if (seq + 1 < a.num_seqs && (ahead - num_blocks) * a.block_size < a.lens[seq + 1]) {
    prefetcher.start(a.kv + a.tables[(seq + 1) * a.max_blocks + ahead - num_blocks] * a.page_stride, a.page_bytes);
  }
}

// page_fn(page, rows) for each page of sequence seq in order (page: its first element; rows: the
// context's rows in it), each after the prefetch of the page kPrefetchDistance ahead has started.
template <typename T, typename PageFn>
inline void for_each_page(const PagedArgs<T>& a, int64_t seq, PagePrefetcher& prefetcher, PageFn&& page_fn) {
  const int64_t n = a.lens[seq];
  const int64_t* table = a.tables + seq * a.max_blocks;
  const int64_t num_blocks = (n + a.block_size - 1) / a.block_size;
  for (int64_t b = 0; b < num_blocks; ++b) {
    const T* page = a.kv + table[b] * a.page_stride;
    const int64_t rows = std::min(a.block_size, n - b * a.block_size);
    prefetch_page_ahead(prefetcher, a, seq, b);
    page_fn(page, rows);
  }
}

// One thread's online softmax over a sequence's pages (online_softmax.h): the page's scores
// [num_heads, block_size], and per head (padded to F's lanes: the corrections are computed that
// many at a time) the running max and sum, the page's new max and the factor that rescales what
// was summed under the old max.
template <typename F>
struct SoftmaxState {
  static constexpr int64_t kLanes = sizeof(F) / sizeof(float);
  int64_t num_heads, padded_heads, block_size;
  std::vector<float> scores, maxes, sums, new_maxes, corrections;

  SoftmaxState(int64_t heads, int64_t block)
      : num_heads(heads),
        padded_heads((heads + kLanes - 1) / kLanes * kLanes),
        block_size(block),
        scores(heads * block),
        maxes(padded_heads),
        sums(heads),
        new_maxes(padded_heads, 0.f),
        corrections(padded_heads) {}

  float* head_scores(int64_t h) { return scores.data() + h * block_size; }
  void start_sequence() {
    std::fill(maxes.begin(), maxes.begin() + num_heads, -std::numeric_limits<float>::infinity());
    std::fill(sums.begin(), sums.end(), 0.f);
  }
  // After a page's scores: turns them into its softmax terms and sets each head's correction.
  void update(int64_t rows) {
    online_softmax_page<F>(scores.data(), num_heads, padded_heads, block_size, rows, maxes.data(), new_maxes.data(),
                           corrections.data(), sums.data());
  }
};

}  // namespace loraserve_attention

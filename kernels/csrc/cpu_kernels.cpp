// Compiled CPU kernels of loraserve: paged decode attention and segmented LoRA.
// Semantics and argument shapes are documented in kernels/cpu.py; the torch
// references they are tested against are kernels/paged_attention.py and kernels/lora.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

extern "C" {
// MKL's grouped batch GEMM, exported by libtorch_cpu (LP64: 32-bit ints).
void cblas_sgemm_batch(int layout, const int* transa, const int* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float** a, const int* lda, const float** b, const int* ldb,
                       const float* beta, float** c, const int* ldc, int group_count, const int* group_size);
}

namespace {

constexpr int kRowMajor = 101;
constexpr int kNoTrans = 111;
constexpr int kTrans = 112;

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(at::Half x) { return static_cast<float>(x); }

// exp(x) for x <= 0 in a form the compiler vectorizes (Cephes' expf: range reduction
// by ln 2, degree-6 polynomial, exponent bits; about 1 ulp). Inputs below -87 give ~0.
inline float exp_nonpositive(float x) {
  x = std::max(x, -87.0f);
  const float n = std::nearbyint(x * 1.44269504088896341f);
  const float r = x - n * 0.693359375f + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof(scale));
  return p * scale;
}

// One sequence per work item (dynamic schedule: contexts differ in length): every query
// head reads the cached rows of its KV head (GQA: h / group), each page's rows are read
// front to back for all heads at once. Scores and accumulation are float32.
template <typename scalar_t>
void decode_attention_impl(const at::Tensor& query, const at::Tensor& kv, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = kv.size(2), num_kv_heads = kv.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t page_stride = kv.stride(0), kv_stride = kv.stride(1), row_stride = kv.stride(2);
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* kv_ptr = kv.data_ptr<scalar_t>();
  const int64_t* table_ptr = block_tables.data_ptr<int64_t>();
  const int64_t* len_ptr = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);
  const int num_threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(num_seqs)));

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores, acc(num_heads * head_dim), q(num_heads * head_dim), sums(num_heads);
#pragma omp for schedule(dynamic, 1)
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
      const int64_t n = len_ptr[seq];
      const int64_t* table = table_ptr + seq * max_blocks;
      const int64_t num_blocks = (n + block_size - 1) / block_size;
      scores.resize(num_heads * n);
      const scalar_t* src = q_ptr + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) q[i] = to_float(src[i]) * fscale;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const scalar_t* page = kv_ptr + table[b] * page_stride;
        const int64_t rows = std::min(block_size, n - b * block_size);
        for (int64_t r = 0; r < rows; ++r) {
          const scalar_t* row = page + r * row_stride;
          for (int64_t h = 0; h < num_heads; ++h) {
            const scalar_t* key = row + (h / group) * head_dim;
            const float* qh = q.data() + h * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * to_float(key[d]);
            scores[h * n + b * block_size + r] = dot;
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = scores.data() + h * n;
        float max_score = -std::numeric_limits<float>::infinity();
#pragma omp simd reduction(max : max_score)
        for (int64_t j = 0; j < n; ++j) max_score = std::max(max_score, s[j]);
        float sum = 0.f;
#pragma omp simd reduction(+ : sum)
        for (int64_t j = 0; j < n; ++j) {
          s[j] = exp_nonpositive(s[j] - max_score);
          sum += s[j];
        }
        sums[h] = sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const scalar_t* page = kv_ptr + table[b] * page_stride + kv_stride;
        const int64_t rows = std::min(block_size, n - b * block_size);
        for (int64_t r = 0; r < rows; ++r) {
          const scalar_t* row = page + r * row_stride;
          for (int64_t h = 0; h < num_heads; ++h) {
            const scalar_t* value = row + (h / group) * head_dim;
            const float p = scores[h * n + b * block_size + r];
            float* a = acc.data() + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * to_float(value[d]);
          }
        }
      }
      scalar_t* dst = out_ptr + seq * num_heads * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        const float inv = 1.f / sums[h];
        for (int64_t d = 0; d < head_dim; ++d) dst[h * head_dim + d] = static_cast<scalar_t>(acc[h * head_dim + d] * inv);
      }
    }
  }
}

}  // namespace

at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& kv, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale) {
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous [num_seqs, heads, head_dim]");
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2, "kv must be [num_pages, 2, block_size, kv_heads, head_dim]");
  TORCH_CHECK(kv.stride(4) == 1 && kv.stride(3) == kv.size(4), "kv rows must be contiguous");
  TORCH_CHECK(query.size(1) % kv.size(3) == 0 && query.size(2) == kv.size(4), "query and kv heads do not match");
  TORCH_CHECK(query.scalar_type() == kv.scalar_type(), "query and kv dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(), "block_tables: int64");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(), "context_lens: int64");
  at::Tensor out = at::empty_like(query);
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(query, kv, block_tables, context_lens, scale, out);
  });
  return out;
}

// meta[layer, group, s] = [a_offset, num_rows, (column, rank, b_offset, out_features) x 3]
constexpr int64_t kMetaWidth = 14;
constexpr int64_t kMaxModules = 3;
// Segments of at most this many tokens (decode steps over many adapters) are GEMV-shaped and
// bound by reading the weights: they run as plain loops that read each weight row once for all
// of the segment's tokens, several segments in parallel. Longer ones go to MKL.
constexpr int64_t kSmallSegment = 2;  // measured: MKL is faster from 4 tokens on

// One adapter's flat layer buffer through its page table (`table`, pages of `page_elems`
// elements starting at `layer`); `base` is its first element when the pages are consecutive.
struct AdapterBuffer {
  const float* layer = nullptr;
  const float* base = nullptr;  // nullptr: scattered pages
  const int64_t* table = nullptr;
  int64_t page_elems = 0;

  // Elements [f, f + n) of the buffer: in place when they lie in one page, else copied to `buf`.
  const float* span(int64_t f, int64_t n, float* buf) const {
    const int64_t offset = f % page_elems;
    if (offset + n <= page_elems) return layer + table[f / page_elems] * page_elems + offset;
    for (int64_t done = 0; done < n;) {
      const int64_t at = f + done, count = std::min(page_elems - at % page_elems, n - done);
      std::memcpy(buf + done, layer + table[at / page_elems] * page_elems + at % page_elems, count * sizeof(float));
      done += count;
    }
    return buf;
  }
};

// Where one long segment's matrices of this layer and group are: A (stacked rows) and each B^T.
struct SegmentWeights {
  const float* a = nullptr;
  const float* b[kMaxModules] = {nullptr, nullptr, nullptr};
};

// A segment of a few tokens, row by row: each weight row is read once (in place, or copied
// when it crosses a page boundary) for all the segment's tokens.
void small_segment(const float* x, int64_t in_features, const AdapterBuffer& w, const int64_t* m,
                   const float* scale, int64_t start, int64_t num, float* v, int64_t ldv, float* const* outs,
                   int64_t num_outputs, std::vector<float>& tmp, float* row_buf) {
  for (int64_t c = 0; c < m[1]; ++c) {
    const float* a_row = w.span(m[0] + c * in_features, in_features, row_buf);
    for (int64_t t = 0; t < num; ++t) {
      const float* x_row = x + (start + t) * in_features;
      float dot = 0.f;
#pragma omp simd reduction(+ : dot)
      for (int64_t k = 0; k < in_features; ++k) dot += x_row[k] * a_row[k];
      v[(start + t) * ldv + c] = dot;
    }
  }
  for (int64_t module = 0; module < num_outputs; ++module) {
    const int64_t* mm = m + 2 + 4 * module;
    const int64_t column = mm[0], rank = mm[1], b_offset = mm[2], out_features = mm[3];
    if (rank == 0) continue;
    // tmp[t] = v_m[t] @ B_m^T first, then out[t] += scale * tmp[t], as one GEMM with alpha would.
    tmp.assign(num * out_features, 0.f);
    for (int64_t r = 0; r < rank; ++r) {
      const float* b_row = w.span(b_offset + r * out_features, out_features, row_buf);
      for (int64_t t = 0; t < num; ++t) {
        const float coef = v[(start + t) * ldv + column + r];
        float* acc = tmp.data() + t * out_features;
#pragma omp simd
        for (int64_t o = 0; o < out_features; ++o) acc[o] += coef * b_row[o];
      }
    }
    const float s = scale[module];
    for (int64_t t = 0; t < num; ++t) {
      float* out = outs[module] + (start + t) * out_features;
      const float* acc = tmp.data() + t * out_features;
#pragma omp simd
      for (int64_t o = 0; o < out_features; ++o) out[o] += s * acc[o];
    }
  }
}

void lora_segments(const at::Tensor& x, const std::vector<at::Tensor>& outputs, const at::Tensor& storage,
                   int64_t layer, int64_t group, const at::Tensor& bounds, const at::Tensor& page_tables,
                   const at::Tensor& meta, const at::Tensor& scales) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && storage.scalar_type() == at::kFloat, "lora_segments is float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous(), "x must be a contiguous [num_tokens, in_features]");
  TORCH_CHECK(storage.dim() == 3 && storage.is_contiguous(), "storage must be a contiguous [layers, pages, elems]");
  TORCH_CHECK(meta.dim() == 4 && meta.size(3) == kMetaWidth && meta.is_contiguous(), "meta: [L, G, S, 14] int64");
  TORCH_CHECK(scales.dim() == 4 && scales.size(3) == kMaxModules && scales.is_contiguous(), "scales: [L, G, S, 3]");
  TORCH_CHECK(bounds.dim() == 2 && bounds.size(1) == 4 && bounds.is_contiguous(), "bounds: [S, 4] int64");
  TORCH_CHECK(page_tables.dim() == 2 && page_tables.size(0) == bounds.size(0) && page_tables.is_contiguous() &&
                  page_tables.scalar_type() == at::kLong,
              "page_tables: [S, max_pages] int64");
  TORCH_CHECK(static_cast<int64_t>(outputs.size()) <= kMaxModules, "at most 3 outputs per group");
  for (const auto& out : outputs) {
    TORCH_CHECK(out.scalar_type() == at::kFloat && out.is_contiguous() && out.size(0) == x.size(0),
                "outputs must be contiguous float32 [num_tokens, out_features]");
  }
  const int64_t num_segments = bounds.size(0), in_features = x.size(1), num_outputs = outputs.size();
  const int64_t page_elems = storage.size(2), max_pages = page_tables.size(1);
  const int64_t* meta_ptr = meta.data_ptr<int64_t>() + (layer * meta.size(1) + group) * num_segments * kMetaWidth;
  const float* scale_ptr = scales.data_ptr<float>() + (layer * scales.size(1) + group) * num_segments * kMaxModules;
  const int64_t* bound_ptr = bounds.data_ptr<int64_t>();
  const int64_t* table_ptr = page_tables.data_ptr<int64_t>();
  const float* layer_ptr = storage.data_ptr<float>() + layer * storage.stride(0);
  int64_t max_rows = 0;
  for (int64_t s = 0; s < num_segments; ++s) max_rows = std::max(max_rows, meta_ptr[s * kMetaWidth + 1]);
  if (max_rows == 0) return;
  at::Tensor v = at::empty({x.size(0), max_rows}, x.options());  // [num_tokens, max_rows]
  float* v_ptr = v.data_ptr<float>();
  const float* x_ptr = x.data_ptr<float>();
  const int ldv = static_cast<int>(max_rows);
  std::vector<float*> out_ptrs;
  for (const auto& out : outputs) out_ptrs.push_back(out.data_ptr<float>());

  // Each segment's weights. An adapter on consecutive pages is read in place. One on scattered
  // pages is followed through its page table: row by row for short segments; for long ones
  // (MKL needs whole matrices) this group's A rows and each B^T are copied out page by page.
  std::vector<AdapterBuffer> buffers(num_segments);
  std::vector<SegmentWeights> weights(num_segments);
  std::vector<std::vector<float>> copies(num_segments);
  std::vector<int64_t> small, large;
  int64_t max_row = in_features;
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t* m = meta_ptr + s * kMetaWidth;
    const int64_t num = bound_ptr[s * 4 + 1] - bound_ptr[s * 4];
    if (m[1] == 0 || num == 0) continue;
    // (offset in the adapter's layer buffer, elements) of A, then of each present B^T.
    std::vector<std::pair<int64_t, int64_t>> spans = {{m[0], m[1] * in_features}};
    for (int64_t module = 0; module < num_outputs; ++module) {
      const int64_t* mm = m + 2 + 4 * module;
      if (mm[1] == 0) continue;
      TORCH_CHECK(outputs[module].size(1) == mm[3], "output ", module, " width does not match the adapter");
      spans.emplace_back(mm[2], mm[1] * mm[3]);
      max_row = std::max(max_row, mm[3]);
    }
    AdapterBuffer& buffer = buffers[s];
    buffer.layer = layer_ptr;
    buffer.page_elems = page_elems;
    buffer.table = table_ptr + s * max_pages;
    for (const auto& span : spans) {
      TORCH_CHECK(span.first + span.second <= max_pages * page_elems, "adapter weights run past its page table");
    }
    if (num <= kSmallSegment) {
      // Row by row through the page table even on consecutive pages: measured 2-3x faster
      // here than the same loops over one flat pointer.
      small.push_back(s);
      continue;
    }
    if (bound_ptr[s * 4 + 2] == 0) buffer.base = layer_ptr + bound_ptr[s * 4 + 3];
    large.push_back(s);
    std::vector<const float*> where(spans.size());
    if (buffer.base != nullptr) {
      for (size_t i = 0; i < spans.size(); ++i) where[i] = buffer.base + spans[i].first;
    } else {
      int64_t total = 0;
      for (const auto& span : spans) total += span.second;
      copies[s].resize(total);
      for (size_t i = 0, at = 0; i < spans.size(); at += spans[i].second, ++i) {
        float* dst = copies[s].data() + at;
        const float* src = buffer.span(spans[i].first, spans[i].second, dst);
        if (src != dst) std::memcpy(dst, src, spans[i].second * sizeof(float));
        where[i] = dst;
      }
    }
    weights[s].a = where[0];
    for (int64_t module = 0, i = 1; module < num_outputs; ++module) {
      if (m[3 + 4 * module] != 0) weights[s].b[module] = where[i++];
    }
  }
  if (!small.empty()) {
    const int num_threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(small.size())));
#pragma omp parallel num_threads(num_threads)
    {
      std::vector<float> tmp, row_buf(max_row);
#pragma omp for schedule(dynamic, 1)
      for (size_t i = 0; i < small.size(); ++i) {
        const int64_t s = small[i];
        small_segment(x_ptr, in_features, buffers[s], meta_ptr + s * kMetaWidth, scale_ptr + s * kMaxModules,
                      bound_ptr[s * 4], bound_ptr[s * 4 + 1] - bound_ptr[s * 4], v_ptr, ldv, out_ptrs.data(),
                      num_outputs, tmp, row_buf.data());
      }
    }
  }
  if (large.empty()) return;
  // Longer segments: the shrinks of all of them in one grouped MKL call, then all expands in another.
  std::vector<int> ta, tb, ms, ns, ks, lda, ldb, ldc, sizes;
  std::vector<float> alpha, beta;
  std::vector<const float*> a_ptrs, b_ptrs;
  std::vector<float*> c_ptrs;
  auto add = [&](int trans_b, int m, int n, int k, float al, const float* a, int la, const float* b, int lb, float be,
                 float* c, int lc) {
    ta.push_back(kNoTrans); tb.push_back(trans_b); ms.push_back(m); ns.push_back(n); ks.push_back(k);
    alpha.push_back(al); a_ptrs.push_back(a); lda.push_back(la); b_ptrs.push_back(b); ldb.push_back(lb);
    beta.push_back(be); c_ptrs.push_back(c); ldc.push_back(lc); sizes.push_back(1);
  };
  auto run = [&]() {
    cblas_sgemm_batch(kRowMajor, ta.data(), tb.data(), ms.data(), ns.data(), ks.data(), alpha.data(), a_ptrs.data(),
                      lda.data(), b_ptrs.data(), ldb.data(), beta.data(), c_ptrs.data(), ldc.data(),
                      static_cast<int>(sizes.size()), sizes.data());
    ta.clear(); tb.clear(); ms.clear(); ns.clear(); ks.clear(); lda.clear(); ldb.clear(); ldc.clear();
    sizes.clear(); alpha.clear(); beta.clear(); a_ptrs.clear(); b_ptrs.clear(); c_ptrs.clear();
  };
  // v[seg, :rows] = x[seg] @ A^T
  for (const int64_t s : large) {
    const int64_t start = bound_ptr[s * 4], num = bound_ptr[s * 4 + 1] - start;
    add(kTrans, num, meta_ptr[s * kMetaWidth + 1], in_features, 1.f, x_ptr + start * in_features, in_features,
        weights[s].a, in_features, 0.f, v_ptr + start * ldv, ldv);
  }
  run();
  // out_m[seg] += scale_m * v[seg, column:column+rank] @ B_m^T
  for (const int64_t s : large) {
    const int64_t* m = meta_ptr + s * kMetaWidth;
    const int64_t start = bound_ptr[s * 4], num = bound_ptr[s * 4 + 1] - start;
    for (int64_t module = 0; module < num_outputs; ++module) {
      const int64_t* mm = m + 2 + 4 * module;
      const int64_t column = mm[0], rank = mm[1], out_features = mm[3];
      if (rank == 0) continue;
      add(kNoTrans, num, out_features, rank, scale_ptr[s * kMaxModules + module], v_ptr + start * ldv + column, ldv,
          weights[s].b[module], out_features, 1.f, out_ptrs[module] + start * out_features, out_features);
    }
  }
  if (!sizes.empty()) run();
}

// ---- fused elementwise ops of a Llama layer (float32) ----------------------------------
// RMSNorm as Hugging Face's LlamaRMSNorm computes it in float32:
//   out[t] = weight * (x[t] * (1 / sqrt(mean(x[t]^2) + eps)))
// With ``residual``: residual[t] += x[t] first, and the norm is taken of the sum.
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const c10::optional<at::Tensor>& residual) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "rms_norm is float32 only");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && weight.is_contiguous() && weight.numel() == x.size(1),
              "rms_norm: x [num_tokens, hidden] contiguous, weight [hidden]");
  const int64_t rows = x.size(0), hidden = x.size(1);
  float* sum_ptr = nullptr;
  if (residual.has_value()) {
    TORCH_CHECK(residual->scalar_type() == at::kFloat && residual->is_contiguous() && residual->sizes() == x.sizes(),
                "rms_norm: residual must match x");
    sum_ptr = residual->data_ptr<float>();
  }
  at::Tensor out = at::empty_like(x);
  const float* x_ptr = x.data_ptr<float>();
  const float* w_ptr = weight.data_ptr<float>();
  float* out_ptr = out.data_ptr<float>();
  const float feps = static_cast<float>(eps);
  at::parallel_for(0, rows, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* src = x_ptr + t * hidden;
      if (sum_ptr != nullptr) {
        float* acc = sum_ptr + t * hidden;
#pragma omp simd
        for (int64_t i = 0; i < hidden; ++i) acc[i] += src[i];
        src = acc;
      }
      float squares = 0.f;
#pragma omp simd reduction(+ : squares)
      for (int64_t i = 0; i < hidden; ++i) squares += src[i] * src[i];
      const float inv = 1.f / std::sqrt(squares / static_cast<float>(hidden) + feps);
      float* dst = out_ptr + t * hidden;
#pragma omp simd
      for (int64_t i = 0; i < hidden; ++i) dst[i] = w_ptr[i] * (src[i] * inv);
    }
  });
  return out;
}

// Rotary embedding in place, as apply_rope in models/llama.py (rotate-half form):
//   x[t, h, i]        = x[t, h, i] * cos[t, i] - x[t, h, i + D/2] * sin[t, i]
//   x[t, h, i + D/2]  = x[t, h, i + D/2] * cos[t, i + D/2] + x[t, h, i] * sin[t, i + D/2]
// (built without FMA contraction, so each product is rounded as torch rounds it).
#pragma GCC push_options
#pragma GCC optimize("fp-contract=off")
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat && sin.scalar_type() == at::kFloat,
              "rope_ is float32 only");
  TORCH_CHECK(x.dim() == 3 && x.is_contiguous() && cos.is_contiguous() && sin.is_contiguous(),
              "rope_: x [num_tokens, heads, head_dim] contiguous, cos/sin [num_tokens, head_dim]");
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), half = dim / 2;
  TORCH_CHECK(cos.size(0) == tokens && cos.size(1) == dim && sin.sizes() == cos.sizes(), "rope_: cos/sin shape");
  float* x_ptr = x.data_ptr<float>();
  const float* c_ptr = cos.data_ptr<float>();
  const float* s_ptr = sin.data_ptr<float>();
  at::parallel_for(0, tokens, 16, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* c = c_ptr + t * dim;
      const float* s = s_ptr + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        float* v = x_ptr + (t * heads + h) * dim;
#pragma omp simd
        for (int64_t i = 0; i < half; ++i) {
          const float lo = v[i], hi = v[i + half];
          const float lo_cos = lo * c[i], hi_sin = -hi * s[i];
          const float hi_cos = hi * c[i + half], lo_sin = lo * s[i + half];
          v[i] = lo_cos + hi_sin;
          v[i + half] = hi_cos + lo_sin;
        }
      }
    }
  });
}
#pragma GCC pop_options

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (see kernels/cpu.py)");
  m.def("lora_segments", &lora_segments, "segmented LoRA shrink + expand (see kernels/cpu.py)");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally adding a residual in place first (see kernels/cpu.py)");
  m.def("rope_", &rope_, "rotary embedding in place (see kernels/cpu.py)");
}

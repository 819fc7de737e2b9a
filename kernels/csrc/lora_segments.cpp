// Segmented LoRA of loraserve's compiled CPU kernels (bound in cpu_kernels.cpp): for each
// segment of tokens using one adapter, shrink v = x @ A^T and expand out_m += scale_m * v_m @ B_m^T,
// with the adapter's weights read in place from the pool's pages. Semantics and argument shapes
// are documented in kernels/cpu.py; the torch reference is kernels/lora.py.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "lora_tiled.h"

extern "C" {
// MKL's grouped batch GEMM, exported by libtorch_cpu when torch is built with MKL (LP64: 32-bit
// ints). Weak: a torch without MKL leaves it null, and long segments then run one ATen GEMM pair
// each instead (lora_grouped_gemm() says which), rather than the whole extension failing to load.
void cblas_sgemm_batch(int layout, const int* transa, const int* transb, const int* m, const int* n, const int* k,
                       const float* alpha, const float** a, const int* lda, const float** b, const int* ldb,
                       const float* beta, float** c, const int* ldc, int group_count, const int* group_size)
    __attribute__((weak));
}

namespace {

using namespace loraserve_lora;

constexpr int kRowMajor = 101;
constexpr int kNoTrans = 111;
constexpr int kTrans = 112;

bool use_grouped_gemm = true;  // tests turn it off to run the fallback on a torch that has MKL

bool grouped_gemm_available() { return use_grouped_gemm && cblas_sgemm_batch != nullptr; }

// The fallback of one batch of row-major GEMMs: C = alpha * A @ op(B) + beta * C, one ATen call each.
void gemm_one(int trans_b, int m, int n, int k, float alpha, const float* a, int lda, const float* b, int ldb,
              float beta, float* c, int ldc) {
  const auto options = at::TensorOptions().dtype(at::kFloat);
  at::Tensor lhs = at::from_blob(const_cast<float*>(a), {m, k}, {lda, 1}, options);
  at::Tensor rhs = trans_b == kTrans ? at::from_blob(const_cast<float*>(b), {n, k}, {ldb, 1}, options).t()
                                  : at::from_blob(const_cast<float*>(b), {k, n}, {ldb, 1}, options);
  at::Tensor out = at::from_blob(c, {m, n}, {ldc, 1}, options);
  if (beta == 0.f) {
    at::mm_out(out, lhs, rhs);
    if (alpha != 1.f) out.mul_(alpha);
  } else {
    out.mul_(beta).addmm_(lhs, rhs, 1.f, alpha);
  }
}

// Segments of at most this many tokens (decode steps over many adapters) are bound by reading
// the weights: small_segment reads each weight row once for all of the segment's tokens.
constexpr int64_t kSmallSegment = 2;

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
    const int64_t* mm = m + kModuleBase + kModuleStride * module;
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

}  // namespace

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
  const int64_t page_elems = storage.size(2), max_pages = page_tables.size(1), num_pages = storage.size(1);
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
  // pages is followed through its page table: short segments take row pointers into its pages
  // (copying only rows that cross a page boundary); for long ones (MKL needs whole matrices)
  // this group's A rows and each B^T are copied out page by page.
  std::vector<AdapterBuffer> buffers(num_segments);
  std::vector<SegmentWeights> weights(num_segments);
  std::vector<std::vector<float>> copies(num_segments);
  std::vector<TiledSegment> tiled;
  tiled.reserve(num_segments);
  std::vector<int64_t> small, large;
  int64_t max_row = in_features;
  std::vector<int64_t> out_widths;
  for (const auto& out : outputs) out_widths.push_back(out.size(1));
  for (int64_t s = 0; s < num_segments; ++s) {
    const int64_t* m = meta_ptr + s * kMetaWidth;
    const int64_t num = bound_ptr[s * 4 + 1] - bound_ptr[s * 4];
    if (m[1] == 0 || num == 0) continue;
    // (offset in the adapter's layer buffer, elements) of A, then of each present B^T.
    std::pair<int64_t, int64_t> spans[1 + kMaxModules] = {{m[0], m[1] * in_features}};
    size_t num_spans = 1;
    for (int64_t module = 0; module < num_outputs; ++module) {
      const int64_t* mm = m + kModuleBase + kModuleStride * module;
      if (mm[1] == 0) continue;
      TORCH_CHECK(outputs[module].size(1) == mm[3], "output ", module, " width does not match the adapter");
      spans[num_spans++] = {mm[2], mm[1] * mm[3]};
      max_row = std::max(max_row, mm[3]);
    }
    AdapterBuffer& buffer = buffers[s];
    buffer.layer = layer_ptr;
    buffer.page_elems = page_elems;
    buffer.table = table_ptr + s * max_pages;
    int64_t end = 0;
    for (size_t i = 0; i < num_spans; ++i) end = std::max(end, spans[i].first + spans[i].second);
    TORCH_CHECK(end <= max_pages * page_elems, "adapter weights run past its page table");
    for (int64_t p = 0; p < (end + page_elems - 1) / page_elems; ++p) {  // every page read, checked
      TORCH_CHECK(buffer.table[p] >= 0 && buffer.table[p] < num_pages, "segment ", s, ": page id ", buffer.table[p],
                  " is outside the pool of ", num_pages, " pages");
    }
    TORCH_CHECK(bound_ptr[s * 4 + 2] != 0 || bound_ptr[s * 4 + 3] + end <= num_pages * page_elems,
                "segment ", s, ": its consecutive pages run past the pool");
    if (num <= kSmallSegment) {
      // Row by row through the page table even on consecutive pages: measured 2-3x faster
      // here than the same loops over one flat pointer, and ~2x faster than the tiled loops at
      // 1-2 tokens in the 1000-adapter benchmark.
      small.push_back(s);
      continue;
    }
    if (bound_ptr[s * 4 + 2] == 0) buffer.base = layer_ptr + bound_ptr[s * 4 + 3];
    if (num <= kTiledMax) {
      TiledSegment seg;
      seg.start = bound_ptr[s * 4];
      seg.num = num;
      seg.meta = m;
      seg.scale = scale_ptr + s * kMaxModules;
      seg.buffer = &buffer;
      tiled.push_back(seg);
      continue;
    }
    large.push_back(s);
    const float* where[1 + kMaxModules] = {};
    if (buffer.base != nullptr) {
      for (size_t i = 0; i < num_spans; ++i) where[i] = buffer.base + spans[i].first;
    } else {
      int64_t total = 0;
      for (size_t i = 0; i < num_spans; ++i) total += spans[i].second;
      copies[s].resize(total);
      for (size_t i = 0, at = 0; i < num_spans; at += spans[i].second, ++i) {
        float* dst = copies[s].data() + at;
        const float* src = buffer.span(spans[i].first, spans[i].second, dst);
        if (src != dst) std::memcpy(dst, src, spans[i].second * sizeof(float));
        where[i] = dst;
      }
    }
    weights[s].a = where[0];
    for (int64_t module = 0, i = 1; module < num_outputs; ++module) {
      if (m[kModuleBase + 1 + kModuleStride * module] != 0) weights[s].b[module] = where[i++];
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
  if (!tiled.empty()) {
    run_tiled(tiled, x_ptr, in_features, out_ptrs.data(), out_widths.data(), num_outputs);
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
    if (grouped_gemm_available()) {
      cblas_sgemm_batch(kRowMajor, ta.data(), tb.data(), ms.data(), ns.data(), ks.data(), alpha.data(),
                        a_ptrs.data(), lda.data(), b_ptrs.data(), ldb.data(), beta.data(), c_ptrs.data(), ldc.data(),
                        static_cast<int>(sizes.size()), sizes.data());
    } else {
      for (size_t i = 0; i < sizes.size(); ++i) {
        gemm_one(tb[i], ms[i], ns[i], ks[i], alpha[i], a_ptrs[i], lda[i], b_ptrs[i], ldb[i], beta[i], c_ptrs[i],
                 ldc[i]);
      }
    }
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
      const int64_t* mm = m + kModuleBase + kModuleStride * module;
      const int64_t column = mm[0], rank = mm[1], out_features = mm[3];
      if (rank == 0) continue;
      add(kNoTrans, num, out_features, rank, scale_ptr[s * kMaxModules + module], v_ptr + start * ldv + column, ldv,
          weights[s].b[module], out_features, 1.f, out_ptrs[module] + start * out_features, out_features);
    }
  }
  if (!sizes.empty()) run();
}

// Whether long segments run as MKL grouped GEMMs (false: one ATen GEMM pair each); `enable` false
// forces the fallback (tests).
bool lora_grouped_gemm(bool enable) {
  use_grouped_gemm = enable;
  return grouped_gemm_available();
}

// The segment metadata layout these kernels read: {width, max modules, module base, module stride}.
std::vector<int64_t> lora_meta_layout() { return {kMetaWidth, kMaxModules, kModuleBase, kModuleStride}; }

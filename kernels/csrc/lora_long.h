// Segmented LoRA, long segments: the shrinks of all of them as one grouped MKL GEMM call, then
// all expands as another (included by lora_segments.cpp only; internal to it).
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
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

namespace loraserve_lora {

constexpr int kRowMajor = 101;
constexpr int kNoTrans = 111;
constexpr int kTrans = 112;

inline bool use_grouped_gemm = true;  // tests turn it off to run the fallback on a torch that has MKL

inline bool grouped_gemm_available() { return use_grouped_gemm && cblas_sgemm_batch != nullptr; }

// The fallback of one batch of row-major GEMMs: C = alpha * A @ op(B) + beta * C, one ATen call each.
inline void gemm_one(int trans_b, int m, int n, int k, float alpha, const float* a, int lda, const float* b,
                     int ldb, float beta, float* c, int ldc) {
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

// Where one long segment's matrices of this layer and group are: A (stacked rows) and each B^T.
struct SegmentWeights {
  const float* a = nullptr;
  const float* b[kMaxModules] = {nullptr, nullptr, nullptr};
};

// w's matrices in place in the adapter's layer buffer `base` (float32, consecutive pages).
inline void set_weights(SegmentWeights& w, const int64_t* m, int64_t num_outputs, const float* base) {
  w.a = base + m[0];
  for (int64_t module = 0; module < num_outputs; ++module) {
    const int64_t* mm = m + kModuleBase + kModuleStride * module;
    if (mm[1] != 0) w.b[module] = base + mm[2];
  }
}

// Long segments `large` (their buffers checked by the caller): v[seg] = x[seg] @ A^T, then
// out_m[seg] += scale_m * v[seg, column:column+rank] @ B_m^T. MKL reads float32 matrices: a
// float32 adapter on consecutive pages in place; otherwise this group's A rows and each B^T are
// copied out page by page (widened from bfloat16). bfloat16 outputs: the products go to float32
// `expanded` first, then are added to the outputs (rounded once).
template <typename W>
void run_long(const std::vector<int64_t>& large, const std::vector<AdapterBuffer<W>>& buffers,
              const int64_t* meta_ptr, const float* scale_ptr, const int64_t* bound_ptr, const float* x_ptr,
              int64_t in_features, float* v_ptr, int ldv, W* const* out_ptrs, const int64_t* out_widths,
              int64_t num_outputs) {
  std::vector<SegmentWeights> weights(large.size());  // per entry of `large`
  std::vector<int64_t> copy_at(large.size(), -1);
  int64_t copied_elems = 0;
  for (size_t i = 0; i < large.size(); ++i) {
    const int64_t* m = meta_ptr + large[i] * kMetaWidth;
    if (std::is_same_v<W, float> && buffers[large[i]].base != nullptr) {
      set_weights(weights[i], m, num_outputs, reinterpret_cast<const float*>(buffers[large[i]].base));
      continue;
    }
    copy_at[i] = copied_elems;
    copied_elems += m[1] * in_features;
    for (int64_t module = 0; module < num_outputs; ++module) {
      const int64_t* mm = m + kModuleBase + kModuleStride * module;
      copied_elems += mm[1] * mm[3];
    }
  }
  thread_local std::vector<float> copied;  // reused across calls
  float* copied_ptr = at_least(copied, copied_elems);
  const int copy_threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(large.size())));
#pragma omp parallel for schedule(dynamic, 1) num_threads(copy_threads) if (copied_elems > 0)
  for (size_t i = 0; i < large.size(); ++i) {
    const int64_t s = large[i];
    if (copy_at[i] < 0) continue;
    // A (stacked rows), then each present B^T, one after another as float32.
    const int64_t* m = meta_ptr + s * kMetaWidth;
    float* dst = copied_ptr + copy_at[i];
    buffers[s].widen_to(m[0], m[1] * in_features, dst);
    weights[i].a = dst;
    dst += m[1] * in_features;
    for (int64_t module = 0; module < num_outputs; ++module) {
      const int64_t* mm = m + kModuleBase + kModuleStride * module;
      if (mm[1] == 0) continue;
      buffers[s].widen_to(mm[2], mm[1] * mm[3], dst);
      weights[i].b[module] = dst;
      dst += mm[1] * mm[3];
    }
  }
  // The shrinks of all of them in one grouped MKL call, then all expands in another.
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
  for (size_t i = 0; i < large.size(); ++i) {
    const int64_t s = large[i], start = bound_ptr[s * 4], num = bound_ptr[s * 4 + 1] - start;
    add(kTrans, num, meta_ptr[s * kMetaWidth + 1], in_features, 1.f, x_ptr + start * in_features, in_features,
        weights[i].a, in_features, 0.f, v_ptr + start * ldv, ldv);
  }
  run();
  // out_m[seg] += scale_m * v[seg, column:column+rank] @ B_m^T
  thread_local std::vector<float> expanded;
  int64_t expanded_elems = 0;
  if constexpr (!std::is_same_v<W, float>) {
    for (const int64_t s : large) {
      const int64_t num = bound_ptr[s * 4 + 1] - bound_ptr[s * 4];
      for (int64_t module = 0; module < num_outputs; ++module) {
        if (meta_ptr[s * kMetaWidth + kModuleBase + kModuleStride * module + 1] != 0) {
          expanded_elems += num * out_widths[module];
        }
      }
    }
  }
  float* expanded_ptr = at_least(expanded, expanded_elems);
  std::vector<std::pair<W*, int64_t>> to_add;  // (output rows, elements), in expanded's order
  for (size_t i = 0; i < large.size(); ++i) {
    const int64_t s = large[i], start = bound_ptr[s * 4], num = bound_ptr[s * 4 + 1] - start;
    const int64_t* m = meta_ptr + s * kMetaWidth;
    for (int64_t module = 0; module < num_outputs; ++module) {
      const int64_t* mm = m + kModuleBase + kModuleStride * module;
      const int64_t column = mm[0], rank = mm[1], out_features = mm[3];
      if (rank == 0) continue;
      W* out = out_ptrs[module] + start * out_features;
      float* c = nullptr;
      if constexpr (std::is_same_v<W, float>) {
        c = out;
      } else {
        c = expanded_ptr;
        expanded_ptr += num * out_features;
        to_add.emplace_back(out, num * out_features);
      }
      add(kNoTrans, num, out_features, rank, scale_ptr[s * kMaxModules + module], v_ptr + start * ldv + column, ldv,
          weights[i].b[module], out_features, std::is_same_v<W, float> ? 1.f : 0.f, c, out_features);
    }
  }
  if (!sizes.empty()) run();
  std::vector<const float*> sums(to_add.size());  // where each item's products start in `expanded`
  for (size_t i = 0, at = 0; i < to_add.size(); at += to_add[i].second, ++i) sums[i] = line_start(expanded) + at;
  const int add_threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(to_add.size())));
#pragma omp parallel for schedule(dynamic, 1) num_threads(add_threads)
  for (size_t i = 0; i < to_add.size(); ++i) add_scaled(to_add[i].first, sums[i], 1.f, to_add[i].second);
  trim(copied);
  trim(expanded);
}

}  // namespace loraserve_lora

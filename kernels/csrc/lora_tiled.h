// Segmented LoRA, short segments: register-tiled shrink and expand loops over row pointers into
// an adapter's pages (included by lora_segments.cpp only; everything here is internal to it).
#pragma once

#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace loraserve_lora {

// meta[layer, group, s] = [a_offset, num_rows, (column, rank, b_offset, out_features) x 3]: the
// layout defined in kernels/lora.py (SegmentMeta), checked against these by tests/test_lora_kernel.py.
constexpr int64_t kMaxModules = 3;
constexpr int64_t kModuleBase = 2;    // where module 0's fields start
constexpr int64_t kModuleStride = 4;  // column, rank, b_offset, out_features
constexpr int64_t kMetaWidth = kModuleBase + kModuleStride * kMaxModules;
// Segments of 3 up to this many tokens (decode steps, short prefills) run as the register-tiled
// loops below, which read each weight row of the segment's adapter once, in place in its pages;
// longer ones go to MKL's grouped GEMM. Measured on SmolLM2 shapes (8 adapters, ranks 8-64, all
// four groups, weights cold in cache), tiled time / MKL time: 0.7 at 4 tokens per segment, 0.85
// at 8, about 1 at 24-32; on scattered pages, which MKL needs copied out first, 0.25-0.8.
constexpr int64_t kTiledMax = 32;

// One adapter's flat layer buffer through its page table (`table`, pages of `page_elems`
// elements starting at `layer`); `base` is its first element when the pages are consecutive.
struct AdapterBuffer {
  const float* layer = nullptr;
  const float* base = nullptr;  // nullptr: scattered pages
  const int64_t* table = nullptr;
  int64_t page_elems = 0;

  bool crosses_page(int64_t f, int64_t n) const { return base == nullptr && f % page_elems + n > page_elems; }

  // Elements [f, f + n) of the buffer: in place when they lie in one page, else copied to `buf`.
  const float* span(int64_t f, int64_t n, float* buf) const {
    if (base != nullptr) return base + f;
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

// ---- register-tiled LoRA loops: 8-lane vectors (AVX2 FMA under -march=native), or
// 16-lane ones where the build targets AVX-512 (the build is per CPU signature) ----
#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;
#endif
using vecf = float __attribute__((vector_size(4 * kLanes)));

inline vecf loadv(const float* p) {
  vecf v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
inline void storev(float* p, vecf v) { std::memcpy(p, &v, sizeof(v)); }
template <size_t... I>
inline vecf splat_lanes(float x, std::index_sequence<I...>) {
  return vecf{((void)I, x)...};  // a brace list of kLanes copies: one broadcast, no arithmetic
}
inline vecf splatv(float x) { return splat_lanes(x, std::make_index_sequence<kLanes>{}); }
// Horizontal sum in registers (a shuffle tree): the shrink's dots are short at small hidden sizes,
// where a sum through memory cost more than the dot itself.
inline float sumv(vecf v) {
#if defined(__AVX512F__)
  return _mm512_reduce_add_ps(reinterpret_cast<__m512>(v));
#elif defined(__AVX__)
  const __m256 x = reinterpret_cast<__m256>(v);
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_shuffle_ps(s, s, 1));
  return _mm_cvtss_f32(s);
#else
  float half[kLanes];
  storev(half, v);
  for (int width = kLanes / 2; width > 0; width /= 2)
    for (int i = 0; i < width; ++i) half[i] += half[i + width];
  return half[0];
#endif
}

// out[0..2] = the horizontal sums of a, b and c, reduced together (out[3] is scratch): a quarter
// of the shuffles of three separate sums, which dominated the shrink at small hidden sizes.
inline void sum4(vecf a, vecf b, vecf c, float* out) {
#if defined(__AVX512F__)
  const __m512 va = reinterpret_cast<__m512>(a), vb = reinterpret_cast<__m512>(b), vc = reinterpret_cast<__m512>(c);
  const __m512 zero = _mm512_setzero_ps();
  // Per 128-bit lane: ab = [a0+a2, b0+b2, a1+a3, b1+b3], cz likewise, then [sa, sb, sc, 0].
  const __m512 ab = _mm512_add_ps(_mm512_unpacklo_ps(va, vb), _mm512_unpackhi_ps(va, vb));
  const __m512 cz = _mm512_add_ps(_mm512_unpacklo_ps(vc, zero), _mm512_unpackhi_ps(vc, zero));
  const __m512 lanes = _mm512_add_ps(_mm512_shuffle_ps(ab, cz, 0x44), _mm512_shuffle_ps(ab, cz, 0xEE));
  const __m256 half = _mm256_add_ps(_mm512_castps512_ps256(lanes),
                                    _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(lanes), 1)));
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(half), _mm256_extractf128_ps(half, 1)));
#elif defined(__AVX__)
  const __m256 ab = _mm256_hadd_ps(reinterpret_cast<__m256>(a), reinterpret_cast<__m256>(b));
  const __m256 cz = _mm256_hadd_ps(reinterpret_cast<__m256>(c), _mm256_setzero_ps());
  const __m256 lanes = _mm256_hadd_ps(ab, cz);  // [sa, sb, sc, 0] per 128-bit half
  _mm_storeu_ps(out, _mm_add_ps(_mm256_castps256_ps128(lanes), _mm256_extractf128_ps(lanes, 1)));
#else
  out[0] = sumv(a);
  out[1] = sumv(b);
  out[2] = sumv(c);
  out[3] = 0.f;
#endif
}

constexpr int kShrinkRows = 3;    // A rows per shrink tile: 3 rows x kTokenBlock tokens of accumulators
// Tokens per tile: with AVX-512's 32 registers, 8 (the shrink's 3 x 8 and the expand's 8 x 2
// accumulators fit, and each weight vector loaded feeds twice the FMAs); 4 with AVX2's 16.
#if defined(__AVX512F__)
constexpr int kTokenBlock = 8;
#else
constexpr int kTokenBlock = 4;
#endif
constexpr int64_t kShrinkItemRows = 48;  // A rows per shrink work item (16 tiles: whole cache lines of v per thread)
constexpr int64_t kExpandCols = 2 * kLanes;  // output columns per expand tile (two vectors)
constexpr int64_t kExpandBlock = 512;  // output columns per expand work item (at most)
constexpr int64_t kRankBlock = 8;     // rank rows streamed together

// v[j, i] = dot(x[j], a_i) for TB tokens (rows of x, stride `in`) and `num_rows` <= 3 rows of A.
// `next` (or nullptr): 3 rows to prefetch while streaming these, the next tile's.
template <int TB>
void shrink_tile(const float* x, int64_t in, const float* const* a, int num_rows, float* v, int64_t ldv,
                 const float* const* next) {
  const float* r0 = a[0];
  const float* r1 = num_rows > 1 ? a[1] : a[0];
  const float* r2 = num_rows > 2 ? a[2] : a[0];
  vecf acc[kShrinkRows][TB] = {};
  int64_t k = 0;
  for (; k + kLanes <= in; k += kLanes) {
    if (next != nullptr && k % 16 == 0) {
      __builtin_prefetch(next[0] + k);
      __builtin_prefetch(next[1] + k);
      __builtin_prefetch(next[2] + k);
    }
    const vecf a0 = loadv(r0 + k), a1 = loadv(r1 + k), a2 = loadv(r2 + k);
    for (int j = 0; j < TB; ++j) {
      const vecf xv = loadv(x + j * in + k);
      acc[0][j] += a0 * xv;
      acc[1][j] += a1 * xv;
      acc[2][j] += a2 * xv;
    }
  }
  for (int j = 0; j < TB; ++j) {
    float dots[4];
    sum4(acc[0][j], acc[1][j], acc[2][j], dots);
    for (int i = 0; i < num_rows; ++i) {
      float dot = dots[i];
      for (int64_t kk = k; kk < in; ++kk) dot += a[i][kk] * x[j * in + kk];
      v[j * ldv + i] = dot;
    }
  }
}

// out[j, o0:o1] += scale * sum_r v[j, r] * b_r[o0:o1] for TB tokens; `b` holds `rank` row
// pointers; `tmp` has room for TB * (o1 - o0) floats. The rank is walked in blocks of
// kRankBlock rows so that only that many rows are streamed at once (the hardware prefetchers
// follow a few sequential streams, not one per rank row).
template <int TB>
void expand_tile(const float* v, int64_t ldv, const float* const* b, int64_t rank, int64_t o0, int64_t o1,
                 float scale, float* out, int64_t ld_out, float* tmp) {
  const int64_t n = o1 - o0, vectorized = n / kExpandCols * kExpandCols;
  std::fill(tmp, tmp + TB * n, 0.f);
  for (int64_t r0 = 0; r0 < rank; r0 += kRankBlock) {
    const int64_t r1 = std::min(rank, r0 + kRankBlock);
    for (int64_t o = 0; o < vectorized; o += kExpandCols) {
      vecf acc[TB][2];
      for (int j = 0; j < TB; ++j) {
        acc[j][0] = loadv(tmp + j * n + o);
        acc[j][1] = loadv(tmp + j * n + o + kLanes);
      }
      for (int64_t r = r0; r < r1; ++r) {
        const vecf b0 = loadv(b[r] + o0 + o), b1 = loadv(b[r] + o0 + o + kLanes);
        for (int j = 0; j < TB; ++j) {
          const vecf c = splatv(v[j * ldv + r]);
          acc[j][0] += c * b0;
          acc[j][1] += c * b1;
        }
      }
      for (int j = 0; j < TB; ++j) {
        storev(tmp + j * n + o, acc[j][0]);
        storev(tmp + j * n + o + kLanes, acc[j][1]);
      }
    }
    for (int64_t o = vectorized; o < n; ++o) {
      for (int j = 0; j < TB; ++j) {
        float acc = tmp[j * n + o];
        for (int64_t r = r0; r < r1; ++r) acc += v[j * ldv + r] * b[r][o0 + o];
        tmp[j * n + o] = acc;
      }
    }
  }
  for (int j = 0; j < TB; ++j) {
    float* dst = out + j * ld_out + o0;
    const float* src = tmp + j * n;
    for (int64_t o = 0; o < n; ++o) dst[o] += scale * src[o];
  }
}

// Calls f(std::integral_constant<int, TB>, t) for each block [t, t + TB) of up to kTokenBlock of `num` tokens.
template <typename F>
void for_token_blocks(int64_t num, F&& f) {
  for (int64_t t = 0; t < num; t += kTokenBlock) {
    switch (std::min<int64_t>(kTokenBlock, num - t)) {
#if defined(__AVX512F__)
      case 8: f(std::integral_constant<int, 8>{}, t); break;
      case 7: f(std::integral_constant<int, 7>{}, t); break;
      case 6: f(std::integral_constant<int, 6>{}, t); break;
      case 5: f(std::integral_constant<int, 5>{}, t); break;
#endif
      case 4: f(std::integral_constant<int, 4>{}, t); break;
      case 3: f(std::integral_constant<int, 3>{}, t); break;
      case 2: f(std::integral_constant<int, 2>{}, t); break;
      default: f(std::integral_constant<int, 1>{}, t); break;
    }
  }
}

// A short segment's weight rows, in place (or copied when a row crosses a page boundary).
struct TiledSegment {
  int64_t start = 0, num = 0;
  const int64_t* meta = nullptr;
  const float* scale = nullptr;
  std::vector<const float*> a_rows;
  std::vector<const float*> b_rows[kMaxModules];
};

// Row pointers for `count` rows of `width` elements from element `offset` of `w`; rows that
// cross a page boundary are copied to `scratch` (advanced past them).
void collect_rows(const AdapterBuffer& w, int64_t offset, int64_t count, int64_t width,
                  std::vector<const float*>& rows, float*& scratch) {
  rows.resize(count);
  for (int64_t c = 0; c < count; ++c) {
    const int64_t f = offset + c * width;
    rows[c] = w.span(f, width, scratch);
    if (rows[c] == scratch) scratch += width;
  }
}

int64_t crossing_elements(const AdapterBuffer& w, int64_t offset, int64_t count, int64_t width) {
  int64_t total = 0;
  for (int64_t c = 0; c < count; ++c) total += w.crosses_page(offset + c * width, width) ? width : 0;
  return total;
}

// Output columns per expand work item: at most about kExpandBlock, a multiple of kExpandCols.
int64_t expand_chunk(int64_t width) {
  const int64_t chunks = (width + kExpandBlock - 1) / kExpandBlock;
  return (width / chunks + kExpandCols - 1) / kExpandCols * kExpandCols;
}

// All short segments of one call: shrink work items (segment, 12 rows of A) in parallel, then
// expand work items (segment, module, up to 512 output columns).
void run_tiled(const std::vector<TiledSegment>& segs, const float* x, int64_t in, float* v, int64_t ldv,
               float* const* outs, const int64_t* out_widths, int64_t num_outputs) {
  std::vector<std::pair<int64_t, int64_t>> shrinks;              // (segment, first row)
  std::vector<std::tuple<int64_t, int64_t, int64_t>> expands;    // (segment, module, first column)
  for (size_t i = 0; i < segs.size(); ++i) {
    const int64_t rows = segs[i].meta[1];
    for (int64_t c = 0; c < rows; c += kShrinkItemRows) shrinks.emplace_back(i, c);
    for (int64_t module = 0; module < num_outputs; ++module) {
      if (segs[i].meta[kModuleBase + 1 + kModuleStride * module] == 0) continue;
      const int64_t width = out_widths[module], chunk = expand_chunk(width);
      for (int64_t o = 0; o < width; o += chunk) expands.emplace_back(i, module, o);
    }
  }
  const int64_t num_items = static_cast<int64_t>(std::max(shrinks.size(), expands.size()));
  const int num_threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(num_items)));
  int64_t max_chunk = 0;
  for (int64_t module = 0; module < num_outputs; ++module) {
    max_chunk = std::max(max_chunk, expand_chunk(out_widths[module]));
  }
#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> tmp(kTokenBlock * max_chunk);
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < shrinks.size(); ++i) {
      const TiledSegment& seg = segs[shrinks[i].first];
      const int64_t end = std::min(seg.meta[1], shrinks[i].second + kShrinkItemRows);
      for (int64_t c = shrinks[i].second; c < end; c += kShrinkRows) {
        const int rows = static_cast<int>(std::min<int64_t>(kShrinkRows, end - c));
        const float* const* rows_ptr = seg.a_rows.data() + c;
        const float* const* next = c + 2 * kShrinkRows <= seg.meta[1] ? rows_ptr + kShrinkRows : nullptr;
        for_token_blocks(seg.num, [&](auto tb, int64_t t) {
          const int64_t token = seg.start + t;
          shrink_tile<decltype(tb)::value>(x + token * in, in, rows_ptr, rows, v + token * ldv + c, ldv,
                                           t == 0 ? next : nullptr);
        });
      }
    }
#pragma omp for schedule(dynamic, 1)
    for (size_t i = 0; i < expands.size(); ++i) {
      const auto [s, module, o] = expands[i];
      const TiledSegment& seg = segs[s];
      const int64_t* mm = seg.meta + kModuleBase + kModuleStride * module;
      const int64_t column = mm[0], rank = mm[1], width = out_widths[module];
      const int64_t o_end = std::min(width, o + expand_chunk(width));
      for_token_blocks(seg.num, [&](auto tb, int64_t t) {
        const int64_t token = seg.start + t;
        expand_tile<decltype(tb)::value>(v + token * ldv + column, ldv, seg.b_rows[module].data(), rank, o,
                                         o_end, seg.scale[module], outs[module] + token * width, width, tmp.data());
      });
    }
  }
}

}  // namespace loraserve_lora

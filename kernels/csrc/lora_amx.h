// Segmented LoRA, short segments over a bfloat16 pool: the shrink on AMX tiles (CPUs with
// amx_bf16; built in where -march=native has it, used where the OS grants the tile state), the
// expand on the vector loops of lora_tiles.h. Included by lora_segments.cpp only; internal to it.
//
//   shrink:  vt[c, t] = sum_k A[c, k] x[t, k]   tiles: 16 rows x 32 terms of A in place, x^T as pairs
//
// The tile dot products multiply bfloat16 pairs exactly and sum in float32, as the vector loops
// do. The expand stays on vectors: on the tiles it needs B^T's rank rows interleaved in pairs and
// v split in two bfloat16 parts, and measured no faster than the vector loops.
#pragma once

#include "lora_tiled.h"

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define LORASERVE_LORA_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace loraserve_lora {

inline bool use_amx_tiles = true;  // tests turn it off to run the vector loops on an AMX CPU

// Whether this thread may use the tiles: Linux hands out the tile state on request (once per process).
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}
inline bool amx_available() { return use_amx_tiles && amx_permitted(); }

constexpr int kTileRows = 16;  // rows of every tile
constexpr int kTileTerms = 32;  // bfloat16 terms of a row (64 bytes)
constexpr int64_t kAmxShrinkRows = 64;  // A rows per shrink work item
constexpr int64_t kPrefetchAhead = 2 * kTileTerms;  // terms ahead that A's rows are prefetched

// Palette 1, all 8 tiles 16 rows x 64 bytes; per thread, before its first tile instruction.
inline void configure_tiles() {
  struct alignas(64) {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t bytes_per_row[16] = {};
    uint8_t rows[16] = {};
  } config;
  for (int t = 0; t < 8; ++t) config.bytes_per_row[t] = 64, config.rows[t] = kTileRows;
  _tile_loadconfig(&config);
}

inline int64_t padded(int64_t n, int64_t to) { return (n + to - 1) / to * to; }

// xp[p * 16 + n] = the pair (x[n, 2p], x[n, 2p + 1]) as one 32-bit word (low half first) for the
// `num` <= 16 tokens of x (floats holding bfloat16 values, stride `in`); zero past them and past
// `in`. Per 32 terms: each token's 16 words in one register, then a 16 x 16 transpose of words.
inline void pack_token_pairs(const float* x, int64_t in, int num, uint32_t* xp) {
  for (int64_t k = 0; k < in; k += kTileTerms) {
    const int64_t terms = std::min<int64_t>(kTileTerms, in - k);
    const __mmask16 low_mask = terms >= 16 ? 0xFFFF : (1u << terms) - 1;
    const __mmask16 high_mask = terms >= 32 ? 0xFFFF : terms <= 16 ? 0 : (1u << (terms - 16)) - 1;
    __m512i r[kTileRows];
    for (int n = 0; n < kTileRows; ++n) {
      if (n >= num) {
        r[n] = _mm512_setzero_si512();
        continue;
      }
      const __m512 low = _mm512_maskz_loadu_ps(low_mask, x + n * in + k);
      const __m512 high = _mm512_maskz_loadu_ps(high_mask, x + n * in + k + 16);
      r[n] = (__m512i)_mm512_cvtne2ps_pbh(high, low);  // exact: the floats are bfloat16 values
    }
    __m512i t[kTileRows], u[kTileRows];
    for (int i = 0; i < kTileRows; i += 2) {  // rows' words interleaved in pairs of rows
      t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
      t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
    }
    for (int j = 0; j < kTileRows; j += 4) {  // u[j + c], lane L: column 4L + c of rows j .. j + 3
      u[j] = _mm512_unpacklo_epi64(t[j], t[j + 2]);
      u[j + 1] = _mm512_unpackhi_epi64(t[j], t[j + 2]);
      u[j + 2] = _mm512_unpacklo_epi64(t[j + 1], t[j + 3]);
      u[j + 3] = _mm512_unpackhi_epi64(t[j + 1], t[j + 3]);
    }
    uint32_t* dst = xp + k / 2 * kTileRows;
    for (int c = 0; c < 4; ++c) {  // the four row groups' lanes joined: columns c, c + 4, c + 8, c + 12
      const __m512i even = _mm512_shuffle_i32x4(u[c], u[4 + c], 0x88), odd = _mm512_shuffle_i32x4(u[c], u[4 + c], 0xdd);
      const __m512i even2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0x88);
      const __m512i odd2 = _mm512_shuffle_i32x4(u[8 + c], u[12 + c], 0xdd);
      _mm512_storeu_si512(dst + c * kTileRows, _mm512_shuffle_i32x4(even, even2, 0x88));
      _mm512_storeu_si512(dst + (c + 4) * kTileRows, _mm512_shuffle_i32x4(odd, odd2, 0x88));
      _mm512_storeu_si512(dst + (c + 8) * kTileRows, _mm512_shuffle_i32x4(even, even2, 0xdd));
      _mm512_storeu_si512(dst + (c + 12) * kTileRows, _mm512_shuffle_i32x4(odd, odd2, 0xdd));
    }
  }
}

// Rows [c0, c1) of the segment's vt (vt[row * ld_t + token]) from its token pairs `xp` (one
// [pairs, 16] block per 16 tokens). A's rows are read in place when 16 of them lie evenly spaced,
// else copied (zero-padded) to `block` ([16, padded(in, 32)] bfloat16).
inline void amx_shrink(const TiledSegment<bf16_t>& seg, const uint32_t* xp, int64_t in, int64_t c0, int64_t c1,
                       float* vt, int64_t ld_t, bf16_t* block, float* cbuf) {
  const int64_t kpad = padded(in, kTileTerms), block_words = kpad / 2 * kTileRows;
  const bool two = seg.num > kTileRows;
  for (int64_t c = c0; c < c1; c += kTileRows) {
    const int rows = static_cast<int>(std::min<int64_t>(kTileRows, c1 - c));
    const bf16_t* const* a = seg.a_rows + c;
    bool in_place = rows == kTileRows && in == kpad;
    for (int i = 1; in_place && i < kTileRows; ++i) in_place = a[i] == a[0] + i * in;
    const bf16_t* tile_base = a[0];
    int64_t stride = in;
    if (!in_place) {
      std::memset(block, 0, kTileRows * kpad * sizeof(bf16_t));
      for (int i = 0; i < rows; ++i) std::memcpy(block + i * kpad, a[i], in * sizeof(bf16_t));
      tile_base = block, stride = kpad;
    }
    _tile_zero(0);
    _tile_zero(1);
    for (int64_t k = 0; k < kpad; k += kTileTerms) {
      if (k + kPrefetchAhead < kpad) {  // 16 row streams: more than the hardware prefetchers follow
        for (int i = 0; i < kTileRows; ++i) _mm_prefetch(tile_base + i * stride + k + kPrefetchAhead, _MM_HINT_T0);
      }
      _tile_loadd(2, tile_base + k, stride * sizeof(bf16_t));
      _tile_loadd(3, xp + k / 2 * kTileRows, kTileRows * sizeof(uint32_t));
      _tile_dpbf16ps(0, 2, 3);
      if (two) {
        _tile_loadd(4, xp + block_words + k / 2 * kTileRows, kTileRows * sizeof(uint32_t));
        _tile_dpbf16ps(1, 2, 4);
      }
    }
    for (int b = 0; b < (two ? 2 : 1); ++b) {
      if (b == 0) _tile_stored(0, cbuf, kTileRows * sizeof(float));
      if (b == 1) _tile_stored(1, cbuf, kTileRows * sizeof(float));
      const int64_t t0 = b * kTileRows, tokens = std::min<int64_t>(kTileRows, seg.num - t0);
      for (int i = 0; i < rows; ++i) std::memcpy(vt + (c + i) * ld_t + t0, cbuf + i * kTileRows, tokens * sizeof(float));
    }
  }
}


// All short segments of one call (3-32 tokens each, rows not yet bound): the shrink on the tiles,
// the expand on the vector loops; vt is shared (vt[row * ld_t + token] over the call's tokens).
// With at least kSegmentsPerThread segments per thread, each thread takes whole segments; with
// fewer, the phases are split across threads: tokens per segment, shrink items (segment, 64 rows
// of A), expand items (segment, module, up to 512 output columns).
inline void run_tiled_amx(std::vector<TiledSegment<bf16_t>>& segs, const float* x, int64_t in,
                          bf16_t* const* outs, const int64_t* out_widths, int64_t num_outputs) {
  int64_t total_rows = 0, total_crossing = 0, max_rows = 0, num_tokens = 0, max_chunk = 0;
  for (const TiledSegment<bf16_t>& seg : segs) {
    const auto [num_rows, crossing] = rows_needed(seg, in, num_outputs);
    total_rows += num_rows;
    total_crossing += crossing;
    max_rows = std::max(max_rows, seg.meta[1]);
    num_tokens = std::max(num_tokens, seg.start + seg.num);
  }
  for (int64_t module = 0; module < num_outputs; ++module) {
    max_chunk = std::max(max_chunk, expand_chunk(out_widths[module]));
  }
  thread_local std::vector<const bf16_t*> rows;
  thread_local std::vector<bf16_t> copied;
  const bf16_t** row_ptr = at_least(rows, total_rows);
  bf16_t* copied_ptr = at_least(copied, total_crossing);
  for (TiledSegment<bf16_t>& seg : segs) bind_rows(seg, in, num_outputs, row_ptr, copied_ptr);
  std::vector<std::pair<int64_t, int64_t>> shrinks;            // (segment, first row)
  std::vector<std::tuple<int64_t, int64_t, int64_t>> expands;  // (segment, module, first column)
  for (size_t i = 0; i < segs.size(); ++i) {
    for (int64_t c = 0; c < segs[i].meta[1]; c += kAmxShrinkRows) shrinks.emplace_back(i, c);
    for (int64_t module = 0; module < num_outputs; ++module) {
      if (segs[i].meta[kModuleBase + 1 + kModuleStride * module] == 0) continue;
      const int64_t width = out_widths[module], chunk = expand_chunk(width);
      for (int64_t o = 0; o < width; o += chunk) expands.emplace_back(i, module, o);
    }
  }
  const int64_t kpad = padded(in, kTileTerms), block_words = kpad / 2 * kTileRows;
  thread_local std::vector<uint32_t> pairs;
  thread_local std::vector<float> shared_v;
  uint32_t* xp = at_least(pairs, static_cast<int64_t>(segs.size()) * 2 * block_words);  // two token blocks each
  float* vt = at_least(shared_v, max_rows * num_tokens);
  const int64_t ld_t = num_tokens;
  const int max_threads = at::get_num_threads();
  const bool whole = static_cast<int64_t>(segs.size()) >= kSegmentsPerThread * max_threads;
  const int64_t num_items = whole ? static_cast<int64_t>(segs.size())
                                  : static_cast<int64_t>(std::max(shrinks.size(), expands.size()));
  const int num_threads = std::max(1, std::min<int>(max_threads, static_cast<int>(num_items)));
  // Whole segments largest first, so that the threads' last segments are small ones and they finish together.
  std::vector<std::pair<int64_t, size_t>> by_work(segs.size());  // (-work, segment)
  for (size_t i = 0; i < segs.size(); ++i) {
    int64_t work = segs[i].meta[1] * in;
    for (int64_t module = 0; module < num_outputs; ++module) {
      work += segs[i].meta[kModuleBase + 1 + kModuleStride * module] * out_widths[module];
    }
    by_work[i] = {-work, i};
  }
  std::sort(by_work.begin(), by_work.end());
  const auto pack = [&](size_t i) {
    for (int64_t t = 0, b = 0; t < segs[i].num; t += kTileRows, ++b) {
      pack_token_pairs(x + (segs[i].start + t) * in, in, static_cast<int>(std::min<int64_t>(kTileRows, segs[i].num - t)),
                       xp + (2 * i + b) * block_words);
    }
  };
  // Columns [o, o + chunk) of a module from v (v_at[row * ld + token], the segment's first token at 0).
  const auto expand = [&](size_t i, int64_t module, int64_t o, const float* v_at, int64_t ld, float* tmp) {
    const int64_t width = out_widths[module];
    expand_columns(segs[i], module, o, std::min(width, o + expand_chunk(width)), v_at, ld, outs[module], width, tmp);
  };
#pragma omp parallel num_threads(num_threads)
  {
    thread_local std::vector<bf16_t> a_block;
    thread_local std::vector<float> tile_out, tmp;
    bf16_t* a_ptr = at_least(a_block, kTileRows * kpad);
    float* c_ptr = at_least(tile_out, kTileRows * kTileRows);
    float* tmp_ptr = at_least(tmp, kTokenBlock * max_chunk);
    configure_tiles();
    if (whole) {  // v in the thread's own buffer: rows of a segment's tokens, not lines shared with the other threads'
      thread_local std::vector<float> own_v;
      float* own = at_least(own_v, max_rows * 2 * kTileRows);
#pragma omp for schedule(dynamic, 1)
      for (size_t k = 0; k < segs.size(); ++k) {
        const size_t i = by_work[k].second;
        const int64_t ld = padded(segs[i].num, kTileRows);
        pack(i);
        amx_shrink(segs[i], xp + 2 * i * block_words, in, 0, segs[i].meta[1], own, ld, a_ptr, c_ptr);
        for (int64_t module = 0; module < num_outputs; ++module) {
          if (segs[i].meta[kModuleBase + 1 + kModuleStride * module] == 0) continue;
          for (int64_t o = 0; o < out_widths[module]; o += expand_chunk(out_widths[module])) {
            expand(i, module, o, own, ld, tmp_ptr);
          }
        }
      }
    } else {
#pragma omp for schedule(dynamic, 1)
      for (size_t i = 0; i < segs.size(); ++i) pack(i);
#pragma omp for schedule(dynamic, 1)
      for (size_t i = 0; i < shrinks.size(); ++i) {
        const auto [s, c] = shrinks[i];
        amx_shrink(segs[s], xp + 2 * s * block_words, in, c, std::min(segs[s].meta[1], c + kAmxShrinkRows),
                   vt + segs[s].start, ld_t, a_ptr, c_ptr);
      }
#pragma omp for schedule(dynamic, 1)
      for (size_t i = 0; i < expands.size(); ++i) {
        const auto [s, module, o] = expands[i];
        expand(s, module, o, vt + segs[s].start, ld_t, tmp_ptr);
      }
    }
    _tile_release();
  }
  trim(pairs);
  trim(shared_v);
}

}  // namespace loraserve_lora

#else
namespace loraserve_lora {
inline bool use_amx_tiles = false;
inline bool amx_available() { return false; }
}  // namespace loraserve_lora
#endif

namespace loraserve_lora {

// Short segments with the shrink on the tiles where the pool is bfloat16 and AMX is at hand, else
// all on the vector loops.
template <typename W>
void run_short(std::vector<TiledSegment<W>>& segs, const float* x, int64_t in, W* const* outs,
               const int64_t* out_widths, int64_t num_outputs) {
#if defined(LORASERVE_LORA_AMX)
  if constexpr (std::is_same_v<W, bf16_t>) {
    if (amx_available()) return run_tiled_amx(segs, x, in, outs, out_widths, num_outputs);
  }
#endif
  run_tiled(segs, x, in, outs, out_widths, num_outputs);
}

}  // namespace loraserve_lora

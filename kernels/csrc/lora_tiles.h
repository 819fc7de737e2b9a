// Segmented LoRA, short segments: the register-tiled shrink and expand loops (included through
// lora_tiled.h only; everything here is internal to lora_segments.cpp).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>

#include "bf16_bits.h"
#include "simd8.h"
#include "simd_native.h"

namespace loraserve_lora {

// ---- register-tiled LoRA loops: 8-lane vectors (AVX2 FMA under -march=native), or
// 16-lane ones where the build targets AVX-512 (the build is per CPU signature) ----
constexpr int kLanes = loraserve_simd::kNativeLanes;
using vecf = loraserve_simd::native_f32;

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

// ---- weights stored as float32 or as bfloat16 (its 16 high bits: widened by a shift) ----
using bf16_t = uint16_t;
using vecu16 = uint16_t __attribute__((vector_size(2 * kLanes)));
using vecu32 = uint32_t __attribute__((vector_size(4 * kLanes)));

inline float widen(float w) { return w; }
inline float widen(bf16_t w) { return loraserve_bf16::widened(w); }
// kLanes bfloat16 weights as floats (a zero extension and a shift per vector).
inline vecf loadv(const bf16_t* p) { return loraserve_bf16::load_widened<vecf, vecu16, vecu32>(p); }
// The outputs are of the pool's type: *p += v, rounded once to bfloat16 where p is bfloat16.
inline void add_to(float& out, float v) { out += v; }
inline void add_to(bf16_t& out, float v) { out = loraserve_bf16::rounded_bits(widen(out) + v); }
inline void store_add(float* p, vecf v) { storev(p, loadv(p) + v); }
inline void store_add(bf16_t* p, vecf v) {
  const vecu16 h = __builtin_convertvector(loraserve_bf16::rounded_bits<vecu32>(loadv(p) + v), vecu16);
  std::memcpy(p, &h, sizeof(h));
}
// ---- one expand tile's 2 * kLanes columns as two vectors: in order for float weights; for
// bfloat16 in bf16_bits.h's unpacked order (columns 0-3 of each 8 in `first`, 4-7 in `second`),
// which the tile's sums keep and add_columns, given the same order, writes back in place. ----
using vec2u16 = uint16_t __attribute__((vector_size(4 * kLanes)));  // 2 * kLanes words
inline void load_columns(const bf16_t* p, vecf& first, vecf& second) {
  loraserve_bf16::load_unpacked<vecf, vec2u16>(p, first, second);
}
inline void load_columns(const float* p, vecf& first, vecf& second) {
  first = loadv(p);
  second = loadv(p + kLanes);
}
// p[0:2 * kLanes] += (first, second) in load_columns' order, rounded once where p is bfloat16.
inline void add_columns(float* p, vecf first, vecf second) {
  store_add(p, first);
  store_add(p + kLanes, second);
}
inline void add_columns(bf16_t* p, vecf first, vecf second) {
  vecf old_first, old_second;
  load_columns(p, old_first, old_second);
  loraserve_bf16::store_packed<vecf, vecu32, vec2u16>(p, old_first + first, old_second + second);
}
// out[0:n] += scale * acc[0:n].
template <typename W>
inline void add_scaled(W* out, const float* acc, float scale, int64_t n) {
  const vecf s = splatv(scale);
  int64_t o = 0;
  for (; o + kLanes <= n; o += kLanes) store_add(out + o, s * loadv(acc + o));
  for (; o < n; ++o) add_to(out[o], scale * acc[o]);
}
// dst[0:n] = the n weights from src, as floats.
template <typename W>
inline void widen_n(const W* src, int64_t n, float* dst) {
  if constexpr (std::is_same_v<W, float>) {
    std::memcpy(dst, src, n * sizeof(float));
  } else {
    int64_t k = 0;
    for (; k + kLanes <= n; k += kLanes) storev(dst + k, loadv(src + k));
    for (; k < n; ++k) dst[k] = widen(src[k]);
  }
}
constexpr int kShrinkBlock = 8;  // tokens per shrink tile: the 8 lanes of one AVX vector
// A rows per shrink tile: 8 independent accumulators keep two FMA pipes of latency 4 busy, and
// their 8 row pointers fit the integer registers (measured on AVX-512: 12 and 16 rows were slower).
constexpr int kShrinkRows = 8;
constexpr int64_t kShrinkChunk = 64;  // terms per partial sum of a dot
// Token blocks per shrink tile: AVX-512's 32 registers hold 2 x 8 accumulators, so each A element
// loaded feeds two FMAs (segments of 9-32 tokens); AVX2's 16 hold one block's.
#if defined(__AVX512F__)
constexpr int kShrinkBlocks = 2;
#else
constexpr int kShrinkBlocks = 1;
#endif
// Tokens per expand tile: with AVX-512's 32 registers, 8 (the 8 x 2 accumulators fit, and each
// weight vector loaded feeds twice the FMAs); 4 with AVX2's 16.
#if defined(__AVX512F__)
constexpr int kTokenBlock = 8;
#else
constexpr int kTokenBlock = 4;
#endif
constexpr int64_t kShrinkItemRows = 48;  // A rows per shrink work item
constexpr int64_t kExpandCols = 2 * kLanes;  // output columns per expand tile (two vectors)
constexpr int64_t kExpandBlock = 512;  // output columns per expand work item (at most)
constexpr int64_t kSmallExpand = 8192;  // rank x columns of a B small enough to sum in registers

using loraserve_simd::f32x8;
using loraserve_simd::load8;
using loraserve_simd::store8;

// 8 elements of x as floats: float32 as they are, bfloat16 widened.
inline f32x8 load_x8(const float* p) { return load8(p); }
inline f32x8 load_x8(const bf16_t* p) {
  using u16x8 = uint16_t __attribute__((vector_size(16)));
  using u32x8 = uint32_t __attribute__((vector_size(32)));
  return loraserve_bf16::load_widened<f32x8, u16x8, u32x8>(p);
}

// dst[c * 8 + j] = r[j][c] for c, j < 8: an 8 x 8 transpose of 32-bit lanes in three rounds of
// shuffles (bits moved unchanged).
inline void transpose8_store(const f32x8 (&r)[8], float* dst) {
  using loraserve_simd::i32x8;
  f32x8 t[8], u[8];
  for (int j = 0; j < 8; j += 2) {  // pairs of rows interleaved
    t[j] = LORASERVE_SHUFFLE2(r[j], r[j + 1], 0, 8, 1, 9, 4, 12, 5, 13);
    t[j + 1] = LORASERVE_SHUFFLE2(r[j], r[j + 1], 2, 10, 3, 11, 6, 14, 7, 15);
  }
  for (int h = 0; h < 8; h += 4) {  // quads of rows: u[h + c] holds columns c and c + 4
    u[h] = LORASERVE_SHUFFLE2(t[h], t[h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
    u[h + 1] = LORASERVE_SHUFFLE2(t[h], t[h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
    u[h + 2] = LORASERVE_SHUFFLE2(t[h + 1], t[h + 3], 0, 1, 8, 9, 4, 5, 12, 13);
    u[h + 3] = LORASERVE_SHUFFLE2(t[h + 1], t[h + 3], 2, 3, 10, 11, 6, 7, 14, 15);
  }
  for (int c = 0; c < 4; ++c) {  // the two halves of the rows joined: columns c and c + 4
    store8(dst + c * 8, LORASERVE_SHUFFLE2(u[c], u[4 + c], 0, 1, 2, 3, 8, 9, 10, 11));
    store8(dst + (c + 4) * 8, LORASERVE_SHUFFLE2(u[c], u[4 + c], 4, 5, 6, 7, 12, 13, 14, 15));
  }
}

// xt[k * 8 + j] = x[j, k] as floats for the `tb` <= 8 rows of x (stride `in`; X: float, or
// bf16_t widened here, so a bfloat16 x needs no float copy); lanes past tb are zero. Blocks of 8
// columns go through registers (transpose8_store).
template <typename X>
void transpose_tokens(const X* x, int64_t in, int tb, float* xt) {
  const int64_t blocked = in / 8 * 8;
  for (int64_t k = 0; k < blocked; k += 8) {
    f32x8 r[8];
    for (int j = 0; j < 8; ++j) r[j] = j < tb ? load_x8(x + j * in + k) : f32x8{};
    transpose8_store(r, xt + k * kShrinkBlock);
  }
  if (blocked == in) return;
  if (tb < kShrinkBlock) std::fill(xt + blocked * kShrinkBlock, xt + in * kShrinkBlock, 0.f);
  for (int j = 0; j < tb; ++j) {
    for (int64_t k = blocked; k < in; ++k) xt[k * kShrinkBlock + j] = widen(x[j * in + k]);
  }
}

// dst[0:tb] = v's first tb <= 8 lanes: a partial block's neighbouring lanes belong to other
// segments (other threads).
inline void store_lanes(float* dst, f32x8 v, int tb) {
  if (tb == kShrinkBlock) return store8(dst, v);
  float lanes[kShrinkBlock];
  store8(lanes, v);
  std::memcpy(dst, lanes, tb * sizeof(float));
}

// vt[i * ld_t + j] = dot(x[j], a_i) for R rows of A (W: float, or bf16_t widened a chunk at a time) and NB blocks of <= 8 tokens whose transposes
// are `xt` ([NB, in, 8]; only the last block may be partial): the tokens lie in the lanes, so each A element is one broadcast into one FMA and no
// horizontal sums are needed (they cost as much as the dots at small hidden sizes).
// The dots are summed in chunks of kShrinkChunk terms (a long running sum in float32 drifts from
// the blocked sums of a GEMM by more than rounding). `next` (or nullptr): R row pointers to
// prefetch (into L2: 0.94x the time of L1 for SmolLM2's decode with the expand's) while
// streaming these, the next tile's.
template <int R, int NB, typename W>
void shrink_tile(const float* xt, int64_t in, const W* const* a, float* vt, int64_t ld_t, int tb_last,
                 const W* const* next) {
  constexpr int64_t kLine = 64 / sizeof(W);  // weights per cache line
  f32x8 acc[NB][R] = {};
  for (int64_t k0 = 0; k0 < in; k0 += kShrinkChunk) {
    const int64_t k1 = std::min(in, k0 + kShrinkChunk);
    const float* rows[R];  // the chunk's terms of each row, as floats
    float wide[std::is_same_v<W, float> ? 1 : R][kShrinkChunk];
    for (int i = 0; i < R; ++i) {
      if constexpr (std::is_same_v<W, float>) {
        rows[i] = a[i] + k0;
      } else {
        widen_n(a[i] + k0, k1 - k0, wide[i]);
        rows[i] = wide[i];
      }
    }
    f32x8 part[NB][R] = {};
    for (int64_t k = k0; k < k1; ++k) {
      if (next != nullptr && k % kLine == 0) {
        for (int i = 0; i < R; ++i) __builtin_prefetch(next[i] + k, 0, 2);
      }
      for (int j = 0; j < NB; ++j) {
        const f32x8 xv = load8(xt + (j * in + k) * kShrinkBlock);
        for (int i = 0; i < R; ++i) part[j][i] += xv * rows[i][k - k0];
      }
    }
    for (int j = 0; j < NB; ++j)
      for (int i = 0; i < R; ++i) acc[j][i] += part[j][i];
  }
  for (int j = 0; j < NB; ++j) {
    const int tb = j == NB - 1 ? tb_last : kShrinkBlock;
    for (int i = 0; i < R; ++i) {
      store_lanes(vt + i * ld_t + j * kShrinkBlock, acc[j][i], tb);
    }
  }
}

// Calls f(std::integral_constant<int, N>) for the n (1 <= n <= N) given at run time.
template <int N, typename F>
void with_rows(int n, F&& f) {
  if constexpr (N > 1) {
    if (n < N) return with_rows<N - 1>(n, f);
  }
  f(std::integral_constant<int, N>{});
}

// The float expand's rows (expand_tile's `rows`): B's rank rows b_r (float, or bfloat16 widened as
// loaded) times v, vt[r * ld_t + j] for token j, one rank row a step.
template <typename W>
struct FloatRows {
  static constexpr int64_t kRowsPerStep = 1;
  const float* vt;
  int64_t ld_t;
  const W* const* b;

  // acc[j] += sum over rows [r0, r1) of v[r, j] * b_r[c : c + kExpandCols] (load_columns' order),
  // each row's next tile of columns prefetched into L2 where `prefetch`.
  template <int TB>
  void sum_columns(vecf (&acc)[TB][2], int64_t r0, int64_t r1, int64_t c, bool prefetch) const {
    for (int64_t r = r0; r < r1; ++r) {
      if (prefetch) {
        __builtin_prefetch(b[r] + c + kExpandCols, 0, 2);
        __builtin_prefetch(b[r] + c + kExpandCols + kLanes, 0, 2);
      }
      vecf b0, b1;  // in load_columns' order
      load_columns(b[r] + c, b0, b1);
      for (int j = 0; j < TB; ++j) {
        const vecf v = splatv(vt[r * ld_t + j]);
        acc[j][0] += v * b0;
        acc[j][1] += v * b1;
      }
    }
  }
  // acc + sum over rows [r0, r1) of v[r, j] * b_r[c].
  float sum_column(int j, int64_t r0, int64_t r1, int64_t c, float acc) const {
    for (int64_t r = r0; r < r1; ++r) acc += vt[r * ld_t + j] * widen(b[r][c]);
    return acc;
  }
};

// out[j, o0:o1] += scale * sum_r v[r, j] * b_r[o0:o1] for TB tokens, with `rows` (FloatRows, or
// lora_pair_dots.h's PairRows) holding B's `rank` row pointers (`rows.b`; W: float, or bf16_t, the
// output's type too) and v; `tmp` has room for TB * (o1 - o0) floats. The rank is walked in blocks
// of `rank_block` rows (0: the whole rank; rounded up to whole steps of the rows' kRowsPerStep), so
// that only that many rows are streamed at once; sums between blocks wait in `tmp`, the last block
// adds to the output. Which block size keeps the memory busiest depends on the CPU's prefetchers
// (the engine times it: lora/tile_choice.py); the sums' order, and so the result, is the same for
// every block size. Each column tile prefetches into L2 the next tile's columns of its rows (a
// small B streams as one column strip per tile, which the prefetchers do not follow) and its own
// columns of the next rank block's rows, which are read one pass over the columns later.
template <int TB, typename W, typename Rows>
void expand_tile(const Rows& rows, int64_t rank, int64_t o0, int64_t o1, float scale, W* out, int64_t ld_out,
                 float* tmp, int64_t rank_block, bool read_once) {
  const int64_t n = o1 - o0, vectorized = n / kExpandCols * kExpandCols;
  constexpr int64_t kStep = Rows::kRowsPerStep;
  // A small B read once (the segment's only token block) is summed in registers whatever the block.
  const int64_t asked = rank_block == 0 || (read_once && rank * n <= kSmallExpand) ? rank : rank_block;
  const int64_t block = (asked + kStep - 1) / kStep * kStep;
  const W* const* b = rows.b;
  const vecf s = splatv(scale);
  for (int64_t r0 = 0; r0 < rank; r0 += block) {
    const int64_t r1 = std::min(rank, r0 + block);
    const bool first = r0 == 0, last = r1 == rank;
    for (int64_t o = 0; o < vectorized; o += kExpandCols) {
      vecf acc[TB][2] = {};
      if (!first) {
        for (int j = 0; j < TB; ++j) {
          acc[j][0] = loadv(tmp + j * n + o);
          acc[j][1] = loadv(tmp + j * n + o + kLanes);
        }
      }
      for (int64_t r = r1; r < std::min(rank, r1 + block); ++r) {  // the next rank block's
        __builtin_prefetch(b[r] + o0 + o, 0, 2);
        __builtin_prefetch(b[r] + o0 + o + kLanes, 0, 2);
      }
      rows.template sum_columns<TB>(acc, r0, r1, o0 + o, o + kExpandCols < vectorized);
      for (int j = 0; j < TB; ++j) {
        if (last) {
          W* dst = out + j * ld_out + o0 + o;
          add_columns(dst, s * acc[j][0], s * acc[j][1]);
        } else {
          storev(tmp + j * n + o, acc[j][0]);
          storev(tmp + j * n + o + kLanes, acc[j][1]);
        }
      }
    }
    for (int64_t o = vectorized; o < n; ++o) {
      for (int j = 0; j < TB; ++j) {
        const float acc = rows.sum_column(j, r0, r1, o0 + o, first ? 0.f : tmp[j * n + o]);
        if (last) {
          add_to(out[j * ld_out + o0 + o], scale * acc);
        } else {
          tmp[j * n + o] = acc;
        }
      }
    }
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

}  // namespace loraserve_lora

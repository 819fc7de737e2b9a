// What every AMX tile loop of the compiled CPU kernels shares (CPUs with amx_bf16 and
// avx512_bf16, built where -march=native has them): the OS's permission for the tile state, one
// tile configuration, and bfloat16 pairs of up to 16 rows transposed for a B tile.
#pragma once

#include <cstdint>

#if defined(__AMX_BF16__) && defined(__AMX_TILE__) && defined(__AVX512BW__) && defined(__AVX512BF16__)
#define LORASERVE_AMX 1
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>

namespace loraserve_amx {

constexpr int kTileRows = 16;   // rows of every tile
constexpr int kTileTerms = 32;  // bfloat16 terms of a row (64 bytes)

// Whether the tiles may be used: Linux hands out the tile state on request (once per process).
inline bool amx_permitted() {
  static const bool permitted = [] {
    constexpr int kRequestPermission = 0x1023, kTileData = 18;  // ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
    return syscall(SYS_arch_prctl, kRequestPermission, kTileData) == 0;
  }();
  return permitted;
}

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

// dst[c * 16 + n] = word c of r[n]: 16 rows of 16 words (each word a pair of bfloat16 terms)
// transposed into a B tile's 16 rows of 16 pairs.
inline void store_transposed_words(const __m512i* r, uint32_t* dst) {
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

}  // namespace loraserve_amx

#endif

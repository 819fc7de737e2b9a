// The work of a panel GEMM call (linear_panels.cpp, linear_pair_panels.cpp): which output each
// 16-column panel belongs to, and the (row block x chunk of panels) units each thread runs.
//
// Threads: each owns a contiguous range of panels (its chunks: groups of four, then two and one
// at its end, for the wide tilings; single panels otherwise) and runs the row block x chunk units
// of its own in order; a thread that runs out takes the others' last units (work_lists.h). On 2
// cores the server's event loop or a client often takes one core for a while mid-call; with fixed
// halves the other thread then waited (measured: benchmarks/RESULTS.md, 2026-12-06 14:21, EPYC
// Zen 4). Which thread runs a unit does not change its output bits.
#pragma once

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "work_lists.h"

namespace loraserve_panels {

// A run of `count` panels from `panel` that one tile call covers.
struct Chunk {
  int64_t panel;
  int64_t count;
};

// Which output, and which of its columns, each panel of a call holds (outputs' panels one after
// another, each output's width rounded up to whole panels).
class PanelOwners {
 public:
  struct Where {
    int64_t output;
    int64_t column;  // the panel's first column in its output
    int64_t width;   // the output's width
  };
  PanelOwners(const std::vector<int64_t>& out_sizes, int64_t panel_width, int64_t num_panels, const char* name)
      : sizes_(out_sizes), panel_width_(panel_width) {
    for (size_t i = 0; i < out_sizes.size(); ++i) {
      TORCH_CHECK(out_sizes[i] > 0, name, ": out_sizes must be positive");
      first_.push_back(static_cast<int64_t>(owner_.size()));
      owner_.insert(owner_.end(), (out_sizes[i] + panel_width - 1) / panel_width, static_cast<int64_t>(i));
    }
    TORCH_CHECK(static_cast<int64_t>(owner_.size()) == num_panels, name, ": out_sizes need ", owner_.size(),
                " panels, got ", num_panels);
  }
  Where at(int64_t panel) const {
    const int64_t out = owner_[panel];
    return Where{out, (panel - first_[out]) * panel_width_, sizes_[out]};
  }

 private:
  std::vector<int64_t> sizes_;
  int64_t panel_width_;
  std::vector<int64_t> owner_, first_;  // the output of each panel, the first panel of each output
};

// Runs every (row block of `row_block` rows, chunk of panels) unit of an M-row call once, as
// run(row, rows, chunk, next): `next` is the chunk its thread runs after this one (for it to
// prefetch), null at the thread's end and for units taken over from another thread. `wide`:
// chunks of 4, 2 and 1 panels; otherwise single panels.
template <typename Run>
void run_panel_units(int64_t M, int64_t row_block, int64_t num_panels, bool wide, const Run& run) {
  const int num_threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), num_panels)));
  const int64_t per_thread = (num_panels + num_threads - 1) / num_threads;
  const int64_t num_row_blocks = (M + row_block - 1) / row_block;
  std::vector<std::vector<Chunk>> chunks(num_threads);
  std::vector<int64_t> num_units(num_threads);
  for (int t = 0; t < num_threads; ++t) {
    const int64_t begin = std::min(num_panels, t * per_thread), end = std::min(num_panels, begin + per_thread);
    for (int64_t p = begin; p < end;) {
      const int64_t np = !wide ? 1 : p + 4 <= end ? 4 : p + 2 <= end ? 2 : 1;
      chunks[t].push_back(Chunk{p, np});
      p += np;
    }
    num_units[t] = num_row_blocks * static_cast<int64_t>(chunks[t].size());
    TORCH_CHECK(num_units[t] < (int64_t{1} << 32), "a panel GEMM call of too many rows x panels");
  }
  loraserve_work::run_units(num_threads, num_units, [&](int list, int64_t unit, bool stolen) {
    const auto& mine = chunks[list];
    const int64_t num_chunks = static_cast<int64_t>(mine.size());
    const int64_t row = unit / num_chunks * row_block;
    const int64_t index = unit % num_chunks;
    const Chunk* next = !stolen && index + 1 < num_chunks ? &mine[index + 1] : nullptr;
    run(row, std::min(row_block, M - row), mine[index], next);
  });
}

// Calls f(outs, std::integral_constant<int, NP>) with the outputs out_of(panel, row) of the chunk's
// NP (1, 2 or 4) panels, side by side.
template <typename OutOf, typename F>
void with_chunk_outs(Chunk chunk, int64_t row, const OutOf& out_of, const F& f) {
  using Out = decltype(out_of(chunk.panel, row));
  const int64_t p = chunk.panel;
  if (chunk.count == 4) {
    const Out outs[4] = {out_of(p, row), out_of(p + 1, row), out_of(p + 2, row), out_of(p + 3, row)};
    f(outs, std::integral_constant<int, 4>{});
  } else if (chunk.count == 2) {
    const Out outs[2] = {out_of(p, row), out_of(p + 1, row)};
    f(outs, std::integral_constant<int, 2>{});
  } else {
    const Out outs[1] = {out_of(p, row)};
    f(outs, std::integral_constant<int, 1>{});
  }
}

// One tile's share of the next chunk's lines, prefetched into L2 one line per step() (per k step): of
// `fetch_lines` lines of `line_elems` elements at `fetch`, split evenly over `every` tiles, tile
// `first`'s part.
template <typename E>
struct LinePrefetcher {
  const E* line;
  int64_t left;
  int64_t line_elems;

  LinePrefetcher(const E* fetch, int64_t fetch_lines, int64_t line_elems, int64_t every, int64_t first)
      : line_elems(line_elems) {
    const int64_t share = (fetch_lines + every - 1) / every;
    const int64_t begin = std::min(fetch_lines, first * share);
    line = fetch + begin * line_elems;
    left = std::min(fetch_lines, begin + share) - begin;
  }
  __attribute__((always_inline)) inline void step() {
    if (left > 0) {
      __builtin_prefetch(line, 0, 2);
      line += line_elems;
      --left;
    }
  }
};

// Rows [0, m) of a (stride lda) times the NP panels of outs (their output pointers `c`, stride
// `ldc`, at row 0), in tiles of tile_rows rows: tiles[r] runs a tile of r rows, and tile t of the
// call's tiles prefetches its share of the `fetch_lines` lines at `fetch` (the next chunk's).
template <int NP, typename A, typename Out, typename Tile>
void run_tile_rows(const A* a, int64_t lda, int64_t m, const Out* outs, int64_t K, const A* fetch,
                   int64_t fetch_lines, int64_t tile_rows, const Tile* tiles) {
  const int64_t num_tiles = (m + tile_rows - 1) / tile_rows;
  for (int64_t t = 0; t < num_tiles; ++t) {
    const int64_t row = t * tile_rows, rows = std::min<int64_t>(tile_rows, m - row);
    Out shifted[NP];
    for (int j = 0; j < NP; ++j) {
      shifted[j] = outs[j];
      shifted[j].c += row * outs[j].ldc;
    }
    tiles[rows](a + row * lda, lda, shifted, K, fetch, fetch_lines, num_tiles, t);
  }
}

}  // namespace loraserve_panels

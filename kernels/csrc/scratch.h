// Per-thread scratch kept across kernel calls (a thread_local std::vector each), shared by the
// LoRA kernels and linear_amx: grown here, never per call, and handed out from a cache line on.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace loraserve_scratch {

// v's data from its first cache line on (an AMX tile row that straddles two lines loads at about
// half the speed; a vector's data is only 16-byte aligned).
template <typename T>
inline T* line_start(std::vector<T>& v) {
  return reinterpret_cast<T*>((reinterpret_cast<uintptr_t>(v.data()) + 63) & ~uintptr_t{63});
}

// Room for n elements in v from line_start(v), what it held there kept: grown (never shrunk) here.
template <typename T>
inline T* at_least(std::vector<T>& v, int64_t n) {
  constexpr int64_t kSlack = (64 + sizeof(T) - 1) / sizeof(T);
  if (static_cast<int64_t>(v.size()) < n + kSlack) {
    std::vector<T> grown(n + kSlack);
    const int64_t held = std::max<int64_t>(0, static_cast<int64_t>(v.size()) - kSlack);
    if (held > 0) std::copy_n(line_start(v), held, line_start(grown));
    v.swap(grown);
  }
  return line_start(v);
}

// Frees a scratch vector once it holds more than kKeepBytes (a long prefill's buffers), so that
// a thread does not keep its largest call's memory for good.
constexpr size_t kKeepBytes = size_t{16} << 20;
template <typename T>
inline void trim(std::vector<T>& v) {
  if (v.capacity() * sizeof(T) > kKeepBytes) std::vector<T>().swap(v);
}

}  // namespace loraserve_scratch

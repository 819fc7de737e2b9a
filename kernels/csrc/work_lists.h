// Work of a parallel kernel call split into one list of units per thread, with the units of a
// thread that falls behind taken over by the others (used by the panel GEMM).
#pragma once

#include <omp.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

namespace loraserve_work {

// A parallel call's work as one list of units per thread: thread t runs list t from its front;
// a thread whose list is empty takes units from the back of the list with the most left, one at
// a time. So a thread that loses its core mid-call (to the HTTP server or a client on the same
// cores) holds the call up by at most the unit it is in, not by the rest of its share.
class UnitLists {
 public:
  explicit UnitLists(const std::vector<int64_t>& counts) : size_(counts.size()), lists_(new List[counts.size()]) {
    for (size_t t = 0; t < size_; ++t) lists_[t].ends.store(static_cast<uint64_t>(counts[t]), std::memory_order_relaxed);
  }
  // The front unit of list t (-1 when it is empty).
  int64_t take_front(size_t t) {
    std::atomic<uint64_t>& ends = lists_[t].ends;
    uint64_t seen = ends.load(std::memory_order_relaxed);
    while ((seen >> 32) < (seen & kBackMask)) {
      if (ends.compare_exchange_weak(seen, seen + (uint64_t{1} << 32), std::memory_order_relaxed)) {
        return static_cast<int64_t>(seen >> 32);
      }
    }
    return -1;
  }
  // The back unit of the list with the most units left, its list in *list (-1 when all are empty).
  int64_t take_back(int* list) {
    for (;;) {
      size_t longest = size_;
      uint64_t seen = 0, most = 0;
      for (size_t t = 0; t < size_; ++t) {
        const uint64_t ends = lists_[t].ends.load(std::memory_order_relaxed);
        const uint64_t left = (ends & kBackMask) - std::min(ends & kBackMask, ends >> 32);
        if (left > most) {
          most = left;
          longest = t;
          seen = ends;
        }
      }
      if (longest == size_) return -1;
      if (lists_[longest].ends.compare_exchange_weak(seen, seen - 1, std::memory_order_relaxed)) {
        *list = static_cast<int>(longest);
        return static_cast<int64_t>((seen & kBackMask) - 1);
      }
    }
  }

 private:
  static constexpr uint64_t kBackMask = 0xffffffffu;
  struct alignas(64) List {
    std::atomic<uint64_t> ends{0};  // front << 32 | back: the units [front, back) are left
  };
  size_t size_;
  std::unique_ptr<List[]> lists_;
};

// Runs every unit of every list once, run(list, unit, taken_from_back), on num_threads threads.
template <typename Run>
void run_units(int num_threads, const std::vector<int64_t>& counts, const Run& run) {
  UnitLists lists(counts);
#pragma omp parallel num_threads(num_threads)
  {
    const size_t t = static_cast<size_t>(omp_get_thread_num());
    for (int64_t unit; (unit = lists.take_front(t)) >= 0;) run(static_cast<int>(t), unit, false);
    int list = 0;
    for (int64_t unit; (unit = lists.take_back(&list)) >= 0;) run(list, unit, true);
  }
}

// For tests: runs lists of counts[i] units on num_threads threads through run_units, thread
// `stalled` sleeping stall_ms in the first unit it takes, and returns, for each unit in list order,
// the thread that ran it, then the number of runs (the units' number when none ran twice).
inline std::vector<int64_t> trace_units(const std::vector<int64_t>& counts, int num_threads, int stalled,
                                        int64_t stall_ms) {
  std::vector<int64_t> offsets(counts.size() + 1, 0);
  for (size_t i = 0; i < counts.size(); ++i) offsets[i + 1] = offsets[i] + counts[i];
  std::vector<std::atomic<int64_t>> ran_by(static_cast<size_t>(offsets.back()));
  for (auto& r : ran_by) r.store(-1);
  std::atomic<int64_t> runs{0};
  std::atomic<bool> slept{false};
  run_units(num_threads, counts, [&](int list, int64_t unit, bool) {
    const int t = omp_get_thread_num();
    if (t == stalled && !slept.exchange(true)) std::this_thread::sleep_for(std::chrono::milliseconds(stall_ms));
    ran_by[static_cast<size_t>(offsets[list] + unit)].store(t);
    runs.fetch_add(1);
  });
  std::vector<int64_t> result;
  for (auto& r : ran_by) result.push_back(r.load());
  result.push_back(runs.load());
  return result;
}

}  // namespace loraserve_work

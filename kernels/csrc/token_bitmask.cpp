// Structured outputs' token mask on the logits, in place (semantics and shapes in kernels/cpu.py:
// mask_by_bitmask_; the torch reference it is tested against is structured_outputs.apply_bitmasks):
//   logits[rows[i], t] = -inf  wherever bit t % 32 of bitmask[i, t / 32] is 0.
// Each word is read once; a word of all-allowed tokens writes nothing, one of all-banned tokens
// writes its 32 logits in one fill, a mixed one only its banned logits.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>
#include <limits>

void mask_by_bitmask_(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bitmask) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == at::kFloat && logits.stride(1) == 1,
              "mask_by_bitmask_: logits must be [num_rows, vocab] float32 with contiguous rows");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == at::kLong && rows.is_contiguous(),
              "mask_by_bitmask_: rows must be a contiguous [g] int64 tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == at::kLong && bitmask.is_contiguous(),
              "mask_by_bitmask_: bitmask must be a contiguous [g, words] int64 tensor");
  const int64_t num_rows = logits.size(0);
  const int64_t vocab = logits.size(1);
  const int64_t groups = rows.size(0);
  const int64_t words = bitmask.size(1);
  TORCH_CHECK(bitmask.size(0) == groups, "mask_by_bitmask_: bitmask has ", bitmask.size(0), " rows for ", groups,
              " row indices");
  TORCH_CHECK(words * 32 >= vocab, "mask_by_bitmask_: ", words, " words cannot cover a vocabulary of ", vocab);
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < groups; ++i) {
    TORCH_CHECK(row_ids[i] >= 0 && row_ids[i] < num_rows, "mask_by_bitmask_: row ", row_ids[i], " is outside [0, ",
                num_rows, ")");
  }
  float* base = logits.data_ptr<float>();
  const int64_t row_stride = logits.stride(0);
  const int64_t* all_words = bitmask.data_ptr<int64_t>();
  constexpr float kBanned = -std::numeric_limits<float>::infinity();
  // One task per constrained row: rows are independent (a row listed twice is masked twice, the same).
  at::parallel_for(0, groups, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = base + row_ids[i] * row_stride;
      const int64_t* row_words = all_words + i * words;
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        uint32_t banned = ~static_cast<uint32_t>(row_words[w]);  // the word's int32 value, bits inverted
        if (banned == 0) continue;
        const int64_t first = w * 32;
        if (banned == 0xFFFFFFFFu && first + 32 <= vocab) {
          std::fill(row + first, row + first + 32, kBanned);
          continue;
        }
        while (banned != 0) {
          const int64_t token = first + __builtin_ctz(banned);
          if (token >= vocab) break;  // bits past the vocabulary in the last word
          row[token] = kBanned;
          banned &= banned - 1;
        }
      }
    }
  });
}

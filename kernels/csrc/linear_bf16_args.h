// The arguments of the bfloat16 linear kernels on the weights as stored (linear_dot.cpp,
// linear_amx.cpp), checked, and the outputs and work items they share:
//   x [M, K] bfloat16, contiguous; each W_i [N_i, K] bfloat16, contiguous; each b_i [N_i] bfloat16
//   or absent; each out_i [M, N_i] bfloat16 (allocated here, written by the kernel).
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace loraserve_linear {

struct LinearItems {
  std::vector<at::Tensor> outs;  // out_i [M, N_i], not yet written
  std::vector<int64_t> first;    // first[i]: layer i's first work item of `rows_per_item` rows of W; first.back(): all
};

// The checked outputs and work items of one call of the kernel `name` (errors name the argument).
inline LinearItems checked_items(const char* name, const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                 const std::vector<c10::optional<at::Tensor>>& biases, int64_t rows_per_item) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16 && x.is_contiguous(), name,
              ": x must be a contiguous 2-D bfloat16 tensor");
  TORCH_CHECK(biases.size() == weights.size(), name, ": one bias (or None) per weight");
  const int64_t M = x.size(0), K = x.size(1);
  LinearItems items{{}, std::vector<int64_t>(weights.size() + 1, 0)};
  for (size_t i = 0; i < weights.size(); ++i) {
    const at::Tensor& w = weights[i];
    TORCH_CHECK(w.dim() == 2 && w.size(1) == K && w.scalar_type() == at::kBFloat16 && w.is_contiguous(), name,
                ": each weight must be a contiguous bfloat16 [out, ", K, "] tensor");
    if (biases[i].has_value()) {
      const at::Tensor& b = *biases[i];
      TORCH_CHECK(b.dim() == 1 && b.size(0) == w.size(0) && b.scalar_type() == at::kBFloat16 && b.is_contiguous(),
                  name, ": each bias must be a contiguous bfloat16 [out] tensor");
    }
    items.outs.push_back(at::empty({M, w.size(0)}, x.options()));
    items.first[i + 1] = items.first[i] + (w.size(0) + rows_per_item - 1) / rows_per_item;
  }
  return items;
}

// Layer i's bias as bfloat16 bits, or nullptr.
inline const uint16_t* bias_bits(const std::vector<c10::optional<at::Tensor>>& biases, size_t i) {
  return biases[i].has_value() ? reinterpret_cast<const uint16_t*>(biases[i]->data_ptr()) : nullptr;
}

}  // namespace loraserve_linear

// Compiled CPU kernels of loraserve: paged decode attention, the KV write, and the module
// definition (segmented LoRA is in lora_segments.cpp, linear layers in linear_panels.cpp,
// linear_pair_panels.cpp, linear_dot.cpp and linear_amx.cpp, the fused elementwise ops in
// elementwise.cpp, prefill attention in prefill_attention.cpp, structured outputs' token mask in
// token_bitmask.cpp). Semantics and argument shapes are documented in kernels/cpu.py and
// kernels/cpu_linear.py; the torch references they are tested against are
// kernels/paged_attention.py, models/llama.py, structured_outputs.py and F.linear.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "attention_common.h"
#include "decode_attention_tiled.h"
#include "decode_attention_wide.h"
#include "decode_attention_pairs.h"
#include "work_lists.h"

namespace {

using loraserve_attention::exp_shifted_in_place;
using loraserve_attention::prefetch_row;

inline float to_float(float x) { return x; }
inline float to_float(at::BFloat16 x) { return static_cast<float>(x); }
inline float to_float(at::Half x) { return static_cast<float>(x); }

// One sequence per work item (dynamic schedule: contexts differ in length): every query
// head reads the cached rows of its KV head (GQA: h / group), each page's rows are read
// front to back for all heads at once. Scores and accumulation are float32.
template <typename scalar_t>
void decode_attention_impl(const at::Tensor& query, const at::Tensor& kv, const at::Tensor& block_tables,
                           const at::Tensor& context_lens, double scale, at::Tensor& out) {
  const int64_t num_seqs = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  const int64_t block_size = kv.size(2), num_kv_heads = kv.size(3);
  const int64_t group = num_heads / num_kv_heads;
  const int64_t max_blocks = block_tables.size(1);
  const int64_t page_stride = kv.stride(0), kv_stride = kv.stride(1), row_stride = kv.stride(2);
  const scalar_t* q_ptr = query.data_ptr<scalar_t>();
  const scalar_t* kv_ptr = kv.data_ptr<scalar_t>();
  const int64_t* table_ptr = block_tables.data_ptr<int64_t>();
  const int64_t* len_ptr = context_lens.data_ptr<int64_t>();
  scalar_t* out_ptr = out.data_ptr<scalar_t>();
  const float fscale = static_cast<float>(scale);
  const int64_t row_bytes = num_kv_heads * head_dim * static_cast<int64_t>(sizeof(scalar_t));
  const int num_threads = std::max(1, std::min<int>(at::get_num_threads(), static_cast<int>(num_seqs)));

#pragma omp parallel num_threads(num_threads)
  {
    std::vector<float> scores, acc(num_heads * head_dim), q(num_heads * head_dim), sums(num_heads);
#pragma omp for schedule(dynamic, 1)
    for (int64_t seq = 0; seq < num_seqs; ++seq) {
      const int64_t n = len_ptr[seq];
      const int64_t* table = table_ptr + seq * max_blocks;
      const int64_t num_blocks = (n + block_size - 1) / block_size;
      scores.resize(num_heads * n);
      const scalar_t* src = q_ptr + seq * num_heads * head_dim;
      for (int64_t i = 0; i < num_heads * head_dim; ++i) q[i] = to_float(src[i]) * fscale;
      for (int64_t b = 0; b < num_blocks; ++b) {
        const scalar_t* page = kv_ptr + table[b] * page_stride;
        const scalar_t* next = b + 1 < num_blocks ? kv_ptr + table[b + 1] * page_stride : nullptr;
        const int64_t rows = std::min(block_size, n - b * block_size);
        for (int64_t r = 0; r < rows; ++r) {
          const scalar_t* row = page + r * row_stride;
          if (next != nullptr) prefetch_row(next + r * row_stride, row_bytes);
          for (int64_t h = 0; h < num_heads; ++h) {
            const scalar_t* key = row + (h / group) * head_dim;
            const float* qh = q.data() + h * head_dim;
            float dot = 0.f;
#pragma omp simd reduction(+ : dot)
            for (int64_t d = 0; d < head_dim; ++d) dot += qh[d] * to_float(key[d]);
            scores[h * n + b * block_size + r] = dot;
          }
        }
      }
      for (int64_t h = 0; h < num_heads; ++h) {
        float* s = scores.data() + h * n;
        sums[h] = exp_shifted_in_place(s, n);
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t b = 0; b < num_blocks; ++b) {
        const scalar_t* page = kv_ptr + table[b] * page_stride + kv_stride;
        const scalar_t* next = b + 1 < num_blocks ? kv_ptr + table[b + 1] * page_stride + kv_stride : nullptr;
        const int64_t rows = std::min(block_size, n - b * block_size);
        for (int64_t r = 0; r < rows; ++r) {
          const scalar_t* row = page + r * row_stride;
          if (next != nullptr) prefetch_row(next + r * row_stride, row_bytes);
          for (int64_t h = 0; h < num_heads; ++h) {
            const scalar_t* value = row + (h / group) * head_dim;
            const float p = scores[h * n + b * block_size + r];
            float* a = acc.data() + h * head_dim;
#pragma omp simd
            for (int64_t d = 0; d < head_dim; ++d) a[d] += p * to_float(value[d]);
          }
        }
      }
      scalar_t* dst = out_ptr + seq * num_heads * head_dim;
      for (int64_t h = 0; h < num_heads; ++h) {
        const float inv = 1.f / sums[h];
        for (int64_t d = 0; d < head_dim; ++d) dst[h * head_dim + d] = static_cast<scalar_t>(acc[h * head_dim + d] * inv);
      }
    }
  }
}

}  // namespace

// The register-tiled decode attentions compiled into this build, widest first.
std::vector<std::string> decode_attention_variants() {
#if defined(LORASERVE_DECODE_ATTENTION_PAIRS)
  return {"pairs", "avx512", "vec8"};
#elif defined(LORASERVE_DECODE_ATTENTION_WIDE)
  return {"avx512", "vec8"};
#else
  return {"vec8"};
#endif
}

// variant: one of decode_attention_variants(), or "" for the widest; shapes a variant cannot tile
// run on the next one that can (the generic loops last).
at::Tensor paged_decode_attention(const at::Tensor& query, const at::Tensor& kv, const at::Tensor& block_tables,
                                  const at::Tensor& context_lens, double scale, const std::string& variant) {
  const auto variants = decode_attention_variants();
  TORCH_CHECK(variant.empty() || std::find(variants.begin(), variants.end(), variant) != variants.end(),
              "paged_decode_attention variant '", variant, "' is not compiled into this build");
  TORCH_CHECK(query.dim() == 3 && query.is_contiguous(), "query must be a contiguous [num_seqs, heads, head_dim]");
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2, "kv must be [num_pages, 2, block_size, kv_heads, head_dim]");
  TORCH_CHECK(kv.stride(4) == 1 && kv.stride(3) == kv.size(4), "kv rows must be contiguous");
  TORCH_CHECK(query.size(1) % kv.size(3) == 0 && query.size(2) == kv.size(4), "query and kv heads do not match");
  TORCH_CHECK(query.scalar_type() == kv.scalar_type(), "query and kv dtypes differ");
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && block_tables.is_contiguous(), "block_tables: int64");
  TORCH_CHECK(context_lens.scalar_type() == at::kLong && context_lens.is_contiguous(), "context_lens: int64");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == query.size(0) && context_lens.numel() == query.size(0),
              "block_tables and context_lens need one row per query");
  const int64_t max_blocks = block_tables.size(1);
  const int64_t* tables = block_tables.data_ptr<int64_t>();
  const int64_t* lens = context_lens.data_ptr<int64_t>();
  for (int64_t s = 0; s < query.size(0); ++s)
    loraserve_attention::check_block_table(s, lens[s], tables + s * max_blocks, max_blocks, kv.size(2), kv.size(0));
  at::Tensor out = at::empty_like(query);
  const int64_t head_dim = query.size(2);
  const at::ScalarType dtype = query.scalar_type();
#if defined(LORASERVE_DECODE_ATTENTION_PAIRS)
  if ((variant.empty() || variant == "pairs") && dtype == at::kBFloat16 &&
      loraserve_attention::can_run_pairs(head_dim, kv.size(2))) {
    using loraserve_attention::decode_attention_pairs;
    switch (head_dim) {  // the head dims can_run_pairs accepts, head_dim / 32 pair vectors each
      case 32: decode_attention_pairs<1>(query, kv, block_tables, context_lens, scale, out); break;
      case 64: decode_attention_pairs<2>(query, kv, block_tables, context_lens, scale, out); break;
      case 96: decode_attention_pairs<3>(query, kv, block_tables, context_lens, scale, out); break;
      default: decode_attention_pairs<4>(query, kv, block_tables, context_lens, scale, out); break;
    }
    return out;
  }
#endif
#if defined(LORASERVE_DECODE_ATTENTION_WIDE)
  const bool wide = variant.empty() || variant == "avx512" || variant == "pairs";
  if (wide && (dtype == at::kFloat || dtype == at::kBFloat16) &&
      loraserve_attention::can_run_wide(head_dim, kv.size(2), dtype == at::kBFloat16)) {
    const auto run = [&](auto type) {
      using T = decltype(type);
      using loraserve_attention::decode_attention_wide;
      switch (head_dim) {  // the head dims can_run_wide accepts, head_dim / 16 vectors each
        case 16: if constexpr (std::is_same_v<T, float>) decode_attention_wide<1, T>(query, kv, block_tables, context_lens, scale, out); break;
        case 32: decode_attention_wide<2, T>(query, kv, block_tables, context_lens, scale, out); break;
        case 48: if constexpr (std::is_same_v<T, float>) decode_attention_wide<3, T>(query, kv, block_tables, context_lens, scale, out); break;
        case 64: decode_attention_wide<4, T>(query, kv, block_tables, context_lens, scale, out); break;
        case 80: if constexpr (std::is_same_v<T, float>) decode_attention_wide<5, T>(query, kv, block_tables, context_lens, scale, out); break;
        case 96: decode_attention_wide<6, T>(query, kv, block_tables, context_lens, scale, out); break;
        case 112: if constexpr (std::is_same_v<T, float>) decode_attention_wide<7, T>(query, kv, block_tables, context_lens, scale, out); break;
        default: decode_attention_wide<8, T>(query, kv, block_tables, context_lens, scale, out); break;
      }
    };
    if (dtype == at::kFloat) {
      run(float{});
    } else {
      run(uint16_t{});  // bfloat16 as its bits
    }
    return out;
  }
#endif
  if ((dtype == at::kFloat || dtype == at::kBFloat16) && loraserve_attention::can_tile(head_dim, kv.size(2))) {
    const auto run = [&](auto type) {
      using T = decltype(type);
      using loraserve_attention::decode_attention_tiled;
      switch (head_dim) {  // the head dims can_tile accepts, head_dim / 8 vectors each
        case 16: decode_attention_tiled<2, T>(query, kv, block_tables, context_lens, scale, out); break;
        case 32: decode_attention_tiled<4, T>(query, kv, block_tables, context_lens, scale, out); break;
        case 48: decode_attention_tiled<6, T>(query, kv, block_tables, context_lens, scale, out); break;
        case 64: decode_attention_tiled<8, T>(query, kv, block_tables, context_lens, scale, out); break;
        case 96: decode_attention_tiled<12, T>(query, kv, block_tables, context_lens, scale, out); break;
        default: decode_attention_tiled<16, T>(query, kv, block_tables, context_lens, scale, out); break;
      }
    };
    if (dtype == at::kFloat) {
      run(float{});
    } else {
      run(uint16_t{});  // bfloat16 as its bits
    }
    return out;
  }
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, query.scalar_type(), "paged_decode_attention", [&] {
    decode_attention_impl<scalar_t>(query, kv, block_tables, context_lens, scale, out);
  });
  return out;
}


// kv[slot / B, 0, slot % B] = key[t] and kv[slot / B, 1, slot % B] = value[t] for each token t,
// as kernels/paged_attention.write_kv: whole rows copied, any dtype.
void write_kv_(at::Tensor& kv, const at::Tensor& key, const at::Tensor& value, const at::Tensor& slot_mapping) {
  TORCH_CHECK(kv.dim() == 5 && kv.size(1) == 2, "kv must be [num_pages, 2, block_size, kv_heads, head_dim]");
  TORCH_CHECK(kv.stride(4) == 1 && kv.stride(3) == kv.size(4), "kv rows must be contiguous");
  TORCH_CHECK(key.dim() == 3 && key.is_contiguous() && value.is_contiguous() && value.sizes() == key.sizes() &&
                  key.size(1) == kv.size(3) && key.size(2) == kv.size(4),
              "key and value must be contiguous [num_tokens, kv_heads, head_dim] matching kv");
  TORCH_CHECK(key.scalar_type() == kv.scalar_type() && value.scalar_type() == kv.scalar_type(), "dtypes differ");
  TORCH_CHECK(slot_mapping.scalar_type() == at::kLong && slot_mapping.is_contiguous() &&
                  slot_mapping.numel() == key.size(0),
              "slot_mapping: [num_tokens] int64");
  const int64_t num_tokens = key.size(0), block_size = kv.size(2), num_slots = kv.size(0) * block_size;
  const int64_t elem = kv.element_size(), row = key.size(1) * key.size(2) * elem;
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < num_tokens; ++t) {
    TORCH_CHECK(slots[t] >= 0 && slots[t] < num_slots, "slot ", slots[t], " is outside the pages");
  }
  char* pages = static_cast<char*>(kv.data_ptr());
  const char* k = static_cast<const char*>(key.data_ptr());
  const char* v = static_cast<const char*>(value.data_ptr());
  for (int64_t t = 0; t < num_tokens; ++t) {
    char* dst = pages + ((slots[t] / block_size) * kv.stride(0) + (slots[t] % block_size) * kv.stride(2)) * elem;
    std::memcpy(dst, k + t * row, row);
    std::memcpy(dst + kv.stride(1) * elem, v + t * row, row);
  }
}

// elementwise.cpp
at::Tensor rms_norm(const at::Tensor& x, const at::Tensor& weight, double eps, const c10::optional<at::Tensor>& residual);
void rope_(at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin);
void silu_and_mul_(at::Tensor& gate, const at::Tensor& up);
// lora_segments.cpp
void lora_segments(const at::Tensor& x, const std::vector<at::Tensor>& outputs, const at::Tensor& storage,
                   int64_t layer, int64_t group, const at::Tensor& bounds, const at::Tensor& page_tables,
                   const at::Tensor& meta, const at::Tensor& scales, int64_t tile_lengths, int64_t loop_lengths,
                   int64_t expand_rank_block, bool expand_pairs);
std::vector<int64_t> lora_meta_layout();
bool lora_grouped_gemm(bool enable);
bool lora_amx();
bool lora_pair_dots();
std::vector<int64_t> lora_tile_length_bounds();
// linear_panels.cpp
std::vector<at::Tensor> linear_panels(const at::Tensor& x, const at::Tensor& panels,
                                      const c10::optional<at::Tensor>& bias, const std::vector<int64_t>& out_sizes,
                                      const std::string& variant);
std::vector<std::string> linear_panels_variants();
// linear_pair_panels.cpp
std::vector<at::Tensor> linear_pair_panels(const at::Tensor& x, const at::Tensor& panels,
                                           const c10::optional<at::Tensor>& bias, const std::vector<int64_t>& out_sizes);
bool linear_pair_panels_available();
at::Tensor linear_pair_panels_silu(const at::Tensor& x, const at::Tensor& panels, const c10::optional<at::Tensor>& bias,
                                  int64_t width);
// linear_dot.cpp
std::vector<at::Tensor> linear_dot(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                   const std::vector<c10::optional<at::Tensor>>& biases);
bool linear_dot_available();
// linear_amx.cpp
std::vector<at::Tensor> linear_amx(const at::Tensor& x, const std::vector<at::Tensor>& weights,
                                   const std::vector<c10::optional<at::Tensor>>& biases);
bool linear_amx_available();
// token_bitmask.cpp
void mask_by_bitmask_(at::Tensor& logits, const at::Tensor& rows, const at::Tensor& bitmask);
// prefill_attention.cpp
at::Tensor paged_prefill_attention(const at::Tensor& query, const at::Tensor& kv, const at::Tensor& query_starts,
                                   const at::Tensor& cached_lens, const at::Tensor& block_tables, double scale,
                                   bool tiles);
// The variants of decode_attention_variants() whose own tiling runs queries of `like`'s dtype with these
// head and block sizes, widest first; an empty list: such queries run on the generic loops whatever the variant.
std::vector<std::string> decode_attention_tilings(const at::Tensor& like, int64_t head_dim, int64_t block_size) {
  const at::ScalarType dtype = like.scalar_type();
  std::vector<std::string> tilings;
  if (dtype != at::kFloat && dtype != at::kBFloat16) return tilings;
#if defined(LORASERVE_DECODE_ATTENTION_PAIRS)
  if (dtype == at::kBFloat16 && loraserve_attention::can_run_pairs(head_dim, block_size)) tilings.push_back("pairs");
#endif
#if defined(LORASERVE_DECODE_ATTENTION_WIDE)
  if (loraserve_attention::can_run_wide(head_dim, block_size, dtype == at::kBFloat16)) tilings.push_back("avx512");
#endif
  if (loraserve_attention::can_tile(head_dim, block_size)) tilings.push_back("vec8");
  return tilings;
}

bool prefill_attention_amx();

// Every kernel runs without the GIL (as torch's own ops do), so a server's event-loop thread
// keeps serving while the engine thread is inside one.
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using no_gil = py::call_guard<py::gil_scoped_release>;
  m.def("paged_decode_attention", &paged_decode_attention, "paged decode attention (see kernels/cpu.py)", no_gil());
  m.def("decode_attention_variants", &decode_attention_variants,
        "the register-tiled decode attentions compiled in, widest first");
  m.def("decode_attention_tilings", &decode_attention_tilings,
        "the decode attention variants whose tiling runs a dtype and head and block sizes");
  m.def("paged_prefill_attention", &paged_prefill_attention,
        "causal paged attention of all the prefill chunks of a step (see kernels/cpu.py)", no_gil());
  m.def("prefill_attention_amx", &prefill_attention_amx,
        "whether bfloat16 prefill attention can run on AMX tiles (built in, and the OS grants the tile state)");
  m.def("lora_segments", &lora_segments, "segmented LoRA shrink + expand (see kernels/cpu.py)", no_gil());
  m.def("lora_grouped_gemm", &lora_grouped_gemm,
        "whether long LoRA segments run as MKL grouped GEMMs (enable=False forces the ATen fallback)");
  m.def("lora_amx", &lora_amx, "whether LoRA segments over a bfloat16 pool can run on AMX tiles");
  m.def("lora_pair_dots", &lora_pair_dots,
        "whether the tiled loops shrink a bfloat16 x over a bfloat16 pool by pair dots (avx512_bf16)");
  m.def("lora_tile_length_bounds", &lora_tile_length_bounds,
        "the upper bounds of the segment-length classes of lora_segments' tile_lengths and loop_lengths (the last: "
        "longer)");
  m.def("lora_meta_layout", &lora_meta_layout, "the segment metadata layout: width, max modules, module base, stride");
  m.def("rms_norm", &rms_norm, "RMSNorm, optionally adding a residual in place first (see kernels/cpu.py)",
        no_gil());
  m.def("rope_", &rope_, "rotary embedding in place (see kernels/cpu.py)", no_gil());
  m.def("silu_and_mul_", &silu_and_mul_, "gate <- silu(gate) * up in place (see kernels/cpu.py)", no_gil());
  m.def("mask_by_bitmask_", &mask_by_bitmask_, "structured outputs' token mask on the logits, in place (see kernels/cpu.py)",
        no_gil());
  m.def("write_kv_", &write_kv_, "store K and V rows in their slots (see kernels/cpu.py)", no_gil());
  m.def("linear_panels", &linear_panels, "linear layers on 16-column weight panels (see kernels/cpu.py)", no_gil());
  m.def("linear_panels_variants", &linear_panels_variants, "the panel tilings compiled in, widest first");
  m.def("linear_pair_panels", &linear_pair_panels,
        "bfloat16 linear layers on 16-column panels of k pairs (see kernels/cpu_linear.py)", no_gil());
  m.def("linear_pair_panels_silu", &linear_pair_panels_silu,
        "silu(gate) * up of a gated pair on bfloat16 panels of k pairs (see kernels/cpu_linear.py)", no_gil());
  m.def("linear_pair_panels_available", &linear_pair_panels_available,
        "whether linear_pair_panels is built in (avx512_bf16)");
  m.def("linear_dot", &linear_dot, "bfloat16 linear layers of few rows by dot products (see kernels/cpu_linear.py)",
        no_gil());
  m.def("linear_dot_available", &linear_dot_available, "whether linear_dot is built in (avx512_bf16)");
  m.def("linear_amx", &linear_amx, "bfloat16 linear layers on AMX tiles (see kernels/cpu_linear.py)", no_gil());
  m.def("linear_amx_available", &linear_amx_available,
        "whether linear_amx is built in (amx_bf16, avx512_bf16) and the OS granted the tile state");
  m.def("trace_work_lists", &loraserve_work::trace_units,
        "for tests: which thread ran each unit of the panel GEMM's work lists, one thread stalled");
}

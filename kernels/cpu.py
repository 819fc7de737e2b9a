"""Compiled CPU kernels (C++ in ``csrc/``, built once per machine).

``paged_decode_attention`` has the semantics of ``paged_attention.paged_decode_attention``
but reads K and V straight from the pages named by each block table (no gathered copy
of the context, each next page prefetched): one sequence per work item, float32 scores
and accumulation. float32 and bfloat16 (widened as read, the output rounded once) with head_dim
16/32/48/64/96/128 and a block size that is a multiple of 8 run a register-tiled version with one
online-softmax pass over the pages (``csrc/decode_attention_tiled.h``), everything else the
generic two-pass loops.

    query:        [num_seqs, num_heads, head_dim]                     float32 | bfloat16 | float16, contiguous
    kv:           [num_pages, 2, block_size, num_kv_heads, head_dim]  same dtype, rows contiguous
    block_tables: [num_seqs, max_blocks] int64;  context_lens: [num_seqs] int64
    returns       [num_seqs, num_heads, head_dim]
    Every page id a sequence reads is checked against the pool first (an error names it).

``paged_prefill_attention`` is the causal attention of every prefill chunk of a step in one call,
with the semantics of ``paged_attention.paged_prefill_attention_varlen``: chunk ``s`` is query
rows ``query_starts[s]:query_starts[s + 1]`` at positions ``cached_lens[s] ..``; it reads K and V
(its own tokens' too, written before the call) from the pages of ``block_tables[s]``. Float32
scores and accumulation; any block size; every page id a chunk uses is checked against the pool.
In bfloat16 on a CPU with AMX (``prefill_attention_amx()``; ``tiles=False`` keeps the vector
loops) the products run on AMX tiles (``csrc/prefill_attention_amx.h``): query-key products
exact and summed in float32, softmax in float32, the probabilities rounded once to bfloat16 for
their product with the values (as FlashAttention does), each output's weights summing to one.

    query:        [num_tokens, num_heads, head_dim]  float32 | bfloat16 | float16, contiguous
    kv:           [num_pages, 2, block_size, num_kv_heads, head_dim]  same dtype, rows contiguous
    query_starts: [num_seqs + 1] int64 (0 .. num_tokens);  cached_lens: [num_seqs] int64
    block_tables: [num_seqs, max_blocks] int64 (zero padded);  returns [num_tokens, num_heads, head_dim]

``lora_segments`` has the semantics of ``lora.apply_lora_segments`` (SGMV: for each
segment ``s`` of tokens ``start:end`` using one adapter, ``v = x[seg] @ A_s^T`` and
``out_m[seg] += scale_m * v[:, col_m:col_m + r_m] @ B_m^T``) with the weights read in
place from the pool's storage: no Python loop over adapters. Segments of 1-2 tokens run
as row loops through the adapter's page table, segments of 3-32 tokens as register-tiled
shrink and expand loops over row pointers into its pages (work items in parallel), longer
ones as two grouped MKL GEMM calls (all shrinks, then all expands), or, where their length class
is set in ``loop_lengths`` (classes as below), on the tiled loops in pieces of at most 32 tokens
(the engine times both per class: ``lora/tile_choice.py``). float32 or bfloat16: a
bfloat16 pool's weights are widened to float32 as they are read (long segments: as they are
copied out for MKL), the segments' rows of x are widened once, the sums are float32 and each
output is rounded once (to nearest even; a NaN to torch's quiet NaN). Over a bfloat16 pool on a
CPU with AMX (``lora_amx()``), segments of 3 or more tokens whose length class is set in
``tile_lengths`` (bit ``c``: lengths up to ``lora_tile_length_bounds()[c]``, above the class
before; the last bit: every longer length; -1: every class), long ones too, run on AMX tiles
instead: bfloat16 products (exact; denormals count as zero) summed in float32, v split in two
bfloat16 parts (hi + lo, ~16 of its 24 bits) for the expand beyond 8 tokens. The engine sets the
classes by timing both ways on the CPU (``lora/tile_choice.py``). Off the tiles, on a CPU with
avx512_bf16 (``lora_pair_dots()``), the shrink of segments of 3-32 tokens multiplies a bfloat16 x's
and A's pairs the same way (no widening).

    x:        [num_tokens, in_features] float32 | bfloat16, contiguous
    outputs:  per module of the group, [num_tokens, out_m] x's dtype, contiguous, updated in place
    storage:  [num_layers, num_pages, page_elems] x's dtype, the pool
    bounds:   [num_segments, 4] int64: start, end, paged, offset. An adapter's layer buffer is
              the concatenation of its pages ``page_tables[s]``; paged 0 says they are
              consecutive, starting at element ``offset`` of the layer's pages
    page_tables: [num_segments, max_pages] int64, each adapter's page ids (zero padded)
    Short segments read weight rows through the page table (copying only a row that crosses
    a page boundary); long ones run as MKL GEMMs on the matrices in place (paged 0) or
    copied out page by page (paged 1), or on AMX tiles through row pointers as short ones.
    meta:     [num_layers, num_groups, num_segments, 14] int64: a_offset, num_rows, then
              (column, rank, b_offset, out_features) for up to 3 modules (rank 0: absent)
    scales:   [num_layers, num_groups, num_segments, 3] float32
    expand_rank_block: the tiled loops' expand streams B's rows this many at a time (0: all of
              the rank at once); the result is the same for every value, the speed is the CPU's
              (the engine times it: ``lora/tile_choice.py``)
    expand_pairs: the tiled loops' expand (segments of 3-32 tokens, longer ones in pieces, and on AMX
              the expand of 3-8 tokens) by bfloat16 pair dots: v rounded to bfloat16 first (to
              nearest even, as PEFT's and vLLM's bfloat16 LoRA round their intermediate), two rank
              rows per ``vdpbf16ps``
              (products exact, sums float32, each output rounded once): exact against a reference
              that rounds v the same way. Only over a bfloat16 pool on a build with avx512_bf16
              (``lora_pair_dots()``), refused by name otherwise; the engine times it against the
              float expand (``lora/tile_choice.py``)

``write_kv_`` stores each token's K and V rows in its slot, as ``paged_attention.write_kv``
(any dtype; slots are checked to lie inside the pages).

``linear_panels`` computes linear layers that share an input, ``out_i = x @ W_i^T + b_i``, on
weights packed once by ``pack_panels``: each ``W_i`` (``[out_i, in_features]``) padded with zero
rows to a multiple of 16 and cut into panels ``panel[p][k][j] = W_i[16 * p + j, k]``, the
panels of all the ``W_i`` one after another (bias likewise padded and concatenated). Register
tiles of 6 rows x 16 columns run over all of ``in_features`` (with AVX-512: 6 rows x 4 panels);
threads split the panels. ``variant`` picks a tiling of ``linear_panels_variants()`` ("" = the
widest). float32 only; results differ from ``F.linear`` only by the order of float additions.

    x:         [num_rows, in_features] float32, contiguous
    panels:    [num_panels, in_features, 16] float32, num_panels = sum(ceil(out_i / 16))
    bias:      [num_panels * 16] float32 or None
    out_sizes: [out_1, ..., out_n];  returns n contiguous tensors [num_rows, out_i]

``rms_norm`` (optionally adding ``residual += x`` in place first), ``rope_`` and
``silu_and_mul_`` (both in place) are the elementwise parts of a Llama layer fused into one pass
each, float32 or bfloat16; their semantics are those of ``RMSNorm``, ``apply_rope`` and
``F.silu(gate, inplace=True).mul_(up)`` in ``models/llama.py``, rounding where those torch ops
round (RoPE bit for bit; SiLU's exp within a few ulp of torch's).

``mask_by_bitmask_`` is structured outputs' grammar mask on float32 logits, in place (bit for bit
as ``structured_outputs.apply_bitmasks``).

The extension is built and loaded by ``cpu_build.py``.
"""

from __future__ import annotations

import torch
from loraserve.kernels.cpu_build import load_extension as load_extension  # the compiled module, or None

EVERY_TILE_LENGTH = -1  # lora_segments: every segment-length class on AMX tiles (where the CPU has them)
EVERY_LOOP_LENGTH = -1  # lora_segments: every long segment off the tiles on the tiled loops, in pieces
EXPAND_RANK_BLOCK = 8  # lora_segments: B's rows streamed together by the tiled loops' expand (0: the whole rank)


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv: torch.Tensor,  # [num_pages, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    context_lens: torch.Tensor,  # [num_seqs] int64
    scale: float,
    *,
    variant: str = "",  # one of decode_attention_variants(); "": the widest
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    module = load_extension()
    assert module is not None, "paged_decode_attention needs the compiled CPU kernels"
    query = query.contiguous()
    out: torch.Tensor = module.paged_decode_attention(query, kv, block_tables, context_lens, scale, variant)
    return out


def decode_attention_variants() -> list[str]:
    """The register-tiled decode attentions compiled into this build, widest first: "pairs"
    (bfloat16 scores by AVX512-BF16 pair dots, where the build targets it; float32 runs the next),
    "avx512" (16 lanes, where the build targets AVX-512) and "vec8" (8 lanes). A shape a variant
    cannot tile runs on the next one that can, the generic loops last."""
    module = load_extension()
    return list(module.decode_attention_variants()) if module is not None else []


def decode_attention_tilings(dtype: torch.dtype, head_dim: int, block_size: int) -> list[str]:
    """The variants of ``decode_attention_variants()`` whose own tiling runs ``dtype`` queries of
    ``head_dim`` over pages of ``block_size``, widest first. Empty: every variant passes such
    queries to the generic loops (float16, or sizes no tiling takes)."""
    module = load_extension()
    if module is None:
        return []
    return list(module.decode_attention_tilings(torch.empty(0, dtype=dtype), head_dim, block_size))


def paged_prefill_attention(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv: torch.Tensor,  # [num_pages, 2, block_size, num_kv_heads, head_dim]
    query_starts: torch.Tensor,  # [num_seqs + 1] int64
    cached_lens: torch.Tensor,  # [num_seqs] int64
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    scale: float,
    new_key: torch.Tensor | None = None,  # unused: the kernel reads the pages after the write
    new_value: torch.Tensor | None = None,
    *,
    tiles: bool = True,  # bfloat16 on AMX tiles where prefill_attention_amx()
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    module = load_extension()
    assert module is not None, "paged_prefill_attention needs the compiled CPU kernels"
    out: torch.Tensor = module.paged_prefill_attention(
        query.contiguous(), kv, query_starts, cached_lens, block_tables, scale, tiles
    )
    return out


def prefill_attention_amx() -> bool:
    """Whether bfloat16 ``paged_prefill_attention`` runs on AMX tiles: built in where the CPU has
    amx_bf16 and avx512_bf16, and the OS grants the tile state."""
    module = load_extension()
    assert module is not None, "prefill_attention_amx needs the compiled CPU kernels"
    return bool(module.prefill_attention_amx())


def lora_segments(
    x: torch.Tensor,  # [num_tokens, in_features]
    outputs: tuple[torch.Tensor, ...],  # each [num_tokens, out_m]
    storage: torch.Tensor,  # [num_layers, num_pages, page_elems]
    layer: int,
    group: int,
    bounds: torch.Tensor,  # [num_segments, 4] int64
    page_tables: torch.Tensor,  # [num_segments, max_pages] int64
    meta: torch.Tensor,  # [num_layers, num_groups, num_segments, 14] int64
    scales: torch.Tensor,  # [num_layers, num_groups, num_segments, 3] float32
    tile_lengths: int = EVERY_TILE_LENGTH,  # bit per segment-length class: on AMX tiles (bfloat16)
    loop_lengths: int = 0,  # bit per class of 33+ tokens: off the tiles, on the tiled loops (else MKL)
    expand_rank_block: int = EXPAND_RANK_BLOCK,  # B rows the tiled loops' expand streams at once (0: all)
    expand_pairs: bool = False,  # the tiled loops' expand by pair dots, v rounded to bfloat16 (lora_pair_dots())
) -> None:
    module = load_extension()
    assert module is not None, "lora_segments needs the compiled CPU kernels"
    module.lora_segments(
        x.contiguous(), list(outputs), storage, layer, group, bounds, page_tables, meta, scales, tile_lengths,
        loop_lengths, expand_rank_block, expand_pairs,
    )  # fmt: skip


def lora_grouped_gemm(enable: bool = True) -> bool:
    """Whether long LoRA segments run as MKL grouped GEMMs (torch built with MKL); False: one ATen
    GEMM pair per segment (same results). ``enable=False`` forces that fallback (tests)."""
    module = load_extension()
    assert module is not None, "lora_grouped_gemm needs the compiled CPU kernels"
    return bool(module.lora_grouped_gemm(enable))


def lora_amx() -> bool:
    """Whether LoRA segments over a bfloat16 pool can run on AMX tiles: built in where the CPU has
    amx_bf16 and avx512_bf16, and the OS grants the tile state. Which lengths do is each call's
    ``tile_lengths``."""
    module = load_extension()
    assert module is not None, "lora_amx needs the compiled CPU kernels"
    return bool(module.lora_amx())


def lora_pair_dots() -> bool:
    """Whether segments of 3-32 tokens over a bfloat16 pool, with a bfloat16 x and an even number of
    inputs, are shrunk by bfloat16 pair dots (``vdpbf16ps``: products exact, denormals as zero,
    sums float32) instead of widened float32 FMAs: built in where the CPU has avx512_bf16."""
    module = load_extension()
    assert module is not None, "lora_pair_dots needs the compiled CPU kernels"
    return bool(module.lora_pair_dots())


def lora_tile_length_bounds() -> tuple[int, ...]:
    """The upper bounds of ``lora_segments``' segment-length classes (one more class: longer)."""
    module = load_extension()
    assert module is not None, "lora_tile_length_bounds needs the compiled CPU kernels"
    return tuple(module.lora_tile_length_bounds())


def fallbacks() -> tuple[str, ...]:
    """Compiled kernels running a slower fallback because a library symbol is missing (none, or
    ``lora_grouped_gemm``); empty when the extension is not built."""
    module = load_extension()
    if module is None:
        return ()
    return () if module.lora_grouped_gemm(True) else ("lora_grouped_gemm",)


def rms_norm(
    x: torch.Tensor,  # [num_tokens, hidden] float32 or bfloat16
    weight: torch.Tensor,  # [hidden], x's dtype
    eps: float,
    residual: torch.Tensor | None = None,  # [num_tokens, hidden]: residual += x first, norm of the sum
) -> torch.Tensor:  # [num_tokens, hidden]
    module = load_extension()
    assert module is not None, "rms_norm needs the compiled CPU kernels"
    out: torch.Tensor = module.rms_norm(x.contiguous(), weight, eps, residual)
    return out


def write_kv_(
    kv: torch.Tensor,  # [num_pages, 2, block_size, num_kv_heads, head_dim], rows contiguous
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, page_id * block_size + offset
) -> None:
    module = load_extension()
    assert module is not None, "write_kv_ needs the compiled CPU kernels"
    module.write_kv_(kv, key.contiguous(), value.contiguous(), slot_mapping)


def rope_(
    x: torch.Tensor,  # [num_tokens, heads, head_dim] float32 or bfloat16, heads contiguous; rotated in place
    cos: torch.Tensor,  # [num_tokens, head_dim], x's dtype
    sin: torch.Tensor,  # [num_tokens, head_dim]
) -> None:
    module = load_extension()
    assert module is not None, "rope_ needs the compiled CPU kernels"
    module.rope_(x, cos, sin)


def silu_and_mul_(
    gate: torch.Tensor,  # [num_tokens, width] float32 or bfloat16, columns contiguous; <- silu(gate) * up
    up: torch.Tensor,  # [num_tokens, width], gate's dtype, columns contiguous
) -> None:
    module = load_extension()
    assert module is not None, "silu_and_mul_ needs the compiled CPU kernels"
    module.silu_and_mul_(gate, up)


def mask_by_bitmask_(
    logits: torch.Tensor,  # [num_rows, vocab] float32, rows contiguous; masked in place
    rows: torch.Tensor,  # [g] int64: the constrained rows of logits
    bitmask: torch.Tensor,  # [g, ceil(vocab / 32)] int64 holding int32 words
) -> None:
    """``logits[rows[i], t] = -inf`` wherever bit ``t % 32`` of ``bitmask[i, t // 32]`` is 0:
    structured outputs' grammar mask (``structured_outputs.apply_bitmasks`` is the reference),
    reading each word once and writing only the banned logits."""
    module = load_extension()
    assert module is not None, "mask_by_bitmask_ needs the compiled CPU kernels"
    module.mask_by_bitmask_(logits, rows.contiguous(), bitmask.contiguous())


PANEL_WIDTH = 16  # output columns per panel (kernels/csrc/linear_panels.cpp)


def pack_panels(
    weights: list[torch.Tensor],  # each [out_i, in_features] float32
    biases: list[torch.Tensor | None] | None = None,  # each [out_i] or None
) -> tuple[torch.Tensor, torch.Tensor | None]:  # [num_panels, in_features, 16], [num_panels * 16] or None
    """The panels (and padded bias, None when no layer has one) of ``linear_panels``."""
    panels: list[torch.Tensor] = []
    padded_biases: list[torch.Tensor] = []
    given = biases if biases is not None else [None] * len(weights)
    for weight, given_bias in zip(weights, given, strict=True):
        out_features, in_features = weight.shape
        num_panels = -(-out_features // PANEL_WIDTH)
        padded = weight.new_zeros(num_panels * PANEL_WIDTH, in_features)  # [num_panels * 16, in_features]
        padded[:out_features] = weight
        panels.append(padded.view(num_panels, PANEL_WIDTH, in_features).transpose(1, 2))
        bias = padded.new_zeros(num_panels * PANEL_WIDTH)  # [num_panels * 16]
        if given_bias is not None:
            bias[:out_features] = given_bias
        padded_biases.append(bias)
    has_bias = any(b is not None for b in given)
    return torch.cat(panels).contiguous(), torch.cat(padded_biases) if has_bias else None


def linear_panels(
    x: torch.Tensor,  # [num_rows, in_features] float32
    panels: torch.Tensor,  # [num_panels, in_features, 16] from pack_panels
    bias: torch.Tensor | None,  # [num_panels * 16] from pack_panels
    out_sizes: list[int],
    variant: str = "",
) -> list[torch.Tensor]:  # each [num_rows, out_i], contiguous
    module = load_extension()
    assert module is not None, "linear_panels needs the compiled CPU kernels"
    outputs: list[torch.Tensor] = module.linear_panels(x.contiguous(), panels, bias, out_sizes, variant)
    return outputs


def linear_panels_variants() -> list[str]:
    """The panel tilings in this build, widest first: ``avx512`` (4 panels x 6 rows of 16-lane
    registers; built where the CPU has AVX-512F) and ``vec8`` (6 rows x 1 panel of 8-lane pairs)."""
    module = load_extension()
    assert module is not None, "linear_panels needs the compiled CPU kernels"
    variants: list[str] = module.linear_panels_variants()
    return variants

"""``benchmarks.gpu``'s ``kernels`` part: the step's Triton kernels against their yardsticks."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from benchmarks._gpu_report import log, record


def part_kernels(args: argparse.Namespace) -> None:
    """The step's kernels against their yardsticks (bf16, ``do_bench`` medians): one-launch paged
    attention for decode against SDPA on a contiguous cache of the same shape, its split-KV path
    for few long sequences, a mixed prefill + decode step; the per-token-slot LoRA kernel
    (ranks 8-64 mixed) against one dense matmul pair of the same total rank."""
    import torch.nn.functional as F
    import triton.testing
    from loraserve.kernels import triton_lora, triton_lora_slots, triton_unified_attention
    from loraserve.kernels.lora import sort_by_slot

    dev, bf16 = args.device, torch.bfloat16
    heads, kv_heads, head_dim, block = 32, 8, 64, 16
    rows: dict[str, Any] = {}

    def bench(fn: Callable[[], Any]) -> float:
        if args.smoke:  # runs the code path once, times nothing
            fn()
            return 0.0
        return float(triton.testing.do_bench(fn))

    def sweep_bench(fn: Callable[[], Any]) -> float | str:
        """One setting of a tile sweep: its error instead of its time, so that a setting no GPU has
        compiled yet (e.g. out of shared memory) costs only its own figure."""
        try:
            return bench(fn)
        except Exception as error:  # a setting may fail in any way Triton can
            return f"{type(error).__name__}: {error}"[:200]

    cases = (
        [(4, 40, 1)]
        if args.smoke
        else [(256, 512, 1), (64, 1024, 1), (256, 2048, 1), (4, 8192, 1)]
        + [(4, 8192, splits) for splits in (4, 8, 16, 32)]
    )
    for num_seqs, context, splits in cases:
        blocks = -(-context // block)
        num_pages = num_seqs * blocks + 1
        kv = torch.randn(num_pages, 2, block, kv_heads, head_dim, device=dev, dtype=bf16)
        tables = torch.randperm(num_pages - 1, device=dev)[: num_seqs * blocks].view(num_seqs, blocks) + 1
        query = torch.randn(num_seqs, heads, head_dim, device=dev, dtype=bf16)
        lens = torch.full((num_seqs,), context, device=dev)
        starts = torch.arange(num_seqs + 1, device=dev)
        paged = (query, kv, starts, lens, tables, 0.125)
        keys = torch.randn(num_seqs, kv_heads, context, head_dim, device=dev, dtype=bf16)
        values = torch.randn_like(keys)
        q4 = query.unsqueeze(2)  # [num_seqs, heads, 1, head_dim]
        t_paged = bench(partial(triton_unified_attention.unified_attention, *paged, num_splits=splits))
        t_sdpa = bench(partial(F.scaled_dot_product_attention, q4, keys, values, enable_gqa=True))
        key = f"decode seqs={num_seqs} ctx={context} splits={splits}"
        rows[key] = {"paged_ms": t_paged, "sdpa_contiguous_ms": t_sdpa, "ratio": t_paged / t_sdpa if t_sdpa else None}
        log(f"attention {key}: unified paged {t_paged:.3f} ms, SDPA contiguous {t_sdpa:.3f} ms")
    # A mixed step: 192 decode tokens (ctx 512) and 4 prefill chunks of 512 over 256 cached tokens.
    num_decode, chunks, chunk, cached = (2, 1, 8, 8) if args.smoke else (192, 4, 512, 256)
    mixed_lens = [512] * num_decode + [cached + chunk] * chunks
    q_rows = [1] * num_decode + [chunk] * chunks
    blocks = -(-max(mixed_lens) // block)
    num_pages = len(mixed_lens) * blocks + 1
    kv = torch.randn(num_pages, 2, block, kv_heads, head_dim, device=dev, dtype=bf16)
    tables = torch.randperm(num_pages - 1, device=dev)[: len(mixed_lens) * blocks].view(len(mixed_lens), blocks) + 1
    query = torch.randn(sum(q_rows), heads, head_dim, device=dev, dtype=bf16)
    starts = torch.tensor([0, *torch.tensor(q_rows).cumsum(0).tolist()], device=dev)
    mixed = (query, kv, starts, torch.tensor(mixed_lens, device=dev), tables, 0.125)
    rows["mixed step"] = {"unified_ms": bench(partial(triton_unified_attention.unified_attention, *mixed))}
    log(f"attention mixed step ({num_decode} decode + {chunks} x {chunk} prefill): {rows['mixed step']}")
    record("kernels", rows)  # kept if a LoRA part below fails

    # LoRA by slot: 256 tokens, 32 adapters of ranks 8-64 (q/k/v-like group of 2048 -> 2048/512/512).
    tokens, hidden, outs, page_elems = (
        (8, 64, (64, 16, 16), 256) if args.smoke else (256, 2048, (2048, 512, 512), 2 * block * kv_heads * head_dim)
    )
    ranks = [[8, 16, 32, 64][i % 4] for i in range(32)]
    flat_sizes = [r * 3 * hidden + sum(r * o for o in outs) for r in ranks]
    pages_each = [-(-size // page_elems) for size in flat_sizes]
    weights = torch.randn(sum(pages_each) + 1, page_elems, device=dev, dtype=bf16) * 0.01
    table_width = max(pages_each)
    page_tables = torch.zeros(32, table_width, dtype=torch.long)
    meta = torch.zeros(32, 14, dtype=torch.long)
    first = 1
    for a, (rank, count) in enumerate(zip(ranks, pages_each, strict=True)):
        page_tables[a, :count] = torch.arange(first, first + count)
        first += count
        meta[a, :2] = torch.tensor([0, 3 * rank])
        offset = 3 * rank * hidden
        for m, out in enumerate(outs):
            meta[a, 2 + 4 * m : 6 + 4 * m] = torch.tensor([m * rank, rank, offset, out])
            offset += rank * out
    token_slots = torch.arange(tokens, device=dev) % 32
    x = torch.randn(tokens, hidden, device=dev, dtype=bf16)
    outputs = tuple(torch.zeros(tokens, out, device=dev, dtype=bf16) for out in outs)
    scales = torch.ones(32, 3, device=dev)
    grouping = sort_by_slot(token_slots, 32)  # once per step in the engine, for all its layers
    row_bound = triton.next_power_of_2(3 * max(ranks))  # as lora/slots.py keeps it
    slot_args = (x, outputs, weights, token_slots, page_tables.to(dev), meta.to(dev), scales, grouping, row_bound)
    t_slots = bench(partial(triton_lora_slots.lora_slots, *slot_args))
    t_slots_gathered = bench(partial(triton_lora_slots.lora_slots, *slot_args, gather_elements=True))
    # Tile shapes of both LoRA paths, for the next choice of their constants (slot kernels: input
    # columns per step of the shrink, stacked rows per shrink program, input columns per shrink
    # program; segment shrink: input columns and rank rows per step); each compiles once, here.
    tile_sweep: dict[str, float | str] = {}
    saved = triton_lora_slots.SHRINK_WIDTHS, triton_lora_slots.SHRINK_BLOCK_R
    wides = [triton_lora.WIDE_SHRINK_WIDTHS, (128, 64), (64,)]
    k_chunks = (256, 512, 1024)
    tiles: list[tuple[tuple[int, ...], int, int]] = (
        [((64,), 32, 64)] if args.smoke else [(w, r, c) for w in wides for r in (32, 64) for c in k_chunks]
    )
    try:
        for widths, block_r, k_chunk in tiles:
            triton_lora_slots.SHRINK_WIDTHS, triton_lora_slots.SHRINK_BLOCK_R = widths, block_r
            tile_sweep[f"BLOCK_K={widths[0]} BLOCK_R={block_r} K_CHUNK={k_chunk}"] = sweep_bench(
                partial(triton_lora_slots.lora_slots, *slot_args, k_chunk=k_chunk)
            )
    finally:
        triton_lora_slots.SHRINK_WIDTHS, triton_lora_slots.SHRINK_BLOCK_R = saved
    log(f"slot LoRA tile sweep (ms; main: BLOCK_K={saved[0][0]} BLOCK_R={saved[1]} "
        f"K_CHUNK={triton_lora_slots.K_CHUNK}): {tile_sweep}")  # fmt: skip
    t_grouping = bench(partial(sort_by_slot, token_slots, 32))
    mean_rank = sum(ranks) // len(ranks)
    dense_a = torch.randn(3 * mean_rank, hidden, device=dev, dtype=bf16)
    dense_b = torch.randn(sum(outs), mean_rank, device=dev, dtype=bf16)
    t_dense = bench(lambda: (x @ dense_a.T)[:, :mean_rank] @ dense_b.T)
    # The same tokens for the eager steps' segment kernels (triton_lora.py): each adapter's tokens contiguous.
    per = max(1, tokens // 32)
    used = min(32, tokens // per)
    bounds = torch.tensor([[a * per, (a + 1) * per, 0, 0] for a in range(used)], device=dev)
    segment_args = (x, outputs, weights, bounds, page_tables[:used].to(dev), meta[:used].to(dev), scales[:used])
    t_segments = bench(partial(triton_lora.lora_segments, *segment_args, per, 3 * max(ranks[:used])))
    segment_sweep: dict[str, float | str] = {}
    saved_segments = triton_lora.SHRINK_WIDTHS, triton_lora.SHRINK_BLOCK_R
    try:
        for widths in [(64,)] if args.smoke else wides:
            for block_r in (32,) if args.smoke else (16, 32, 64):
                triton_lora.SHRINK_WIDTHS, triton_lora.SHRINK_BLOCK_R = widths, block_r
                segment_sweep[f"SHRINK BLOCK_K={widths[0]} BLOCK_R={block_r}"] = sweep_bench(
                    partial(triton_lora.lora_segments, *segment_args, per, 3 * max(ranks[:used]))
                )
    finally:
        triton_lora.SHRINK_WIDTHS, triton_lora.SHRINK_BLOCK_R = saved_segments
    log(f"segment LoRA tile sweep (ms; main: BLOCK_K={saved_segments[0][0]} BLOCK_R={saved_segments[1]}): "
        f"{segment_sweep}")  # fmt: skip
    # The yardstick read the other way: one dense matmul pair of all 32 adapters' ranks summed.
    total_rank = sum(ranks)
    total_a = torch.randn(3 * total_rank, hidden, device=dev, dtype=bf16)
    total_b = torch.randn(sum(outs), total_rank, device=dev, dtype=bf16)
    t_dense_total = bench(lambda: (x @ total_a.T)[:, :total_rank] @ total_b.T)
    t_segments_gathered = bench(
        partial(triton_lora.lora_segments, *segment_args, per, 3 * max(ranks[:used]), gather_elements=True)
    )
    rows["lora slots"] = {"tokens": tokens, "adapters": 32, "slots_ms": t_slots, "dense_same_rank_ms": t_dense,
                          "ratio": t_slots / t_dense if t_dense else None, "grouping_ms": t_grouping,
                          "segments_ms": t_segments, "slots_gathered_ms": t_slots_gathered,
                          "segments_gathered_ms": t_segments_gathered, "slots_tile_sweep_ms": tile_sweep,
                          "segments_tile_sweep_ms": segment_sweep, "dense_total_rank_ms": t_dense_total}  # fmt: skip
    log(f"LoRA by slot, {tokens} tokens x 32 adapters (ranks 8-64, interleaved): {t_slots:.3f} ms; one dense "
        f"shrink+expand of rank {mean_rank}: {t_dense:.3f} ms; grouping the tokens by slot (once per step) "
        f"{t_grouping:.3f} ms; the segment kernels (eager steps, tokens grouped) {t_segments:.3f} ms; "
        f"element by element (before aligned tiles): slots {t_slots_gathered:.3f} ms, segments "
        f"{t_segments_gathered:.3f} ms; one dense shrink+expand of all ranks summed ({total_rank}): "
        f"{t_dense_total:.3f} ms")  # fmt: skip
    record("kernels", rows)

"""Paged attention over one layer's KV pages: torch reference implementation.

Semantics, for sequence ``s`` with ``c_s`` tokens already cached and ``q_s`` new
query tokens (so its context holds ``n_s = c_s + q_s`` tokens after the write):

    out[t, h] = softmax_j( q[t, h] . K_s[j, g(h)] * scale  masked to j <= c_s + i(t) ) @ V_s[:, g(h)]

where ``i(t)`` is the query's index within its sequence, ``g(h) = h // (H / H_kv)``
maps a query head to its KV head (GQA), and ``K_s[j] = kv[block_table_s[j // B], 0, j % B]``
with block size ``B`` (``V`` likewise with index 1).

Layout of one layer's pages: ``kv: [num_pages, 2, block_size, num_kv_heads, head_dim]``.
These functions run on the CPU serving path and are the reference for GPU kernels.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def write_kv(
    kv: torch.Tensor,  # [num_pages, 2, block_size, num_kv_heads, head_dim]
    key: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    value: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    slot_mapping: torch.Tensor,  # [num_tokens] int64, page_id * block_size + offset
) -> None:
    """Store each token's K and V in its slot."""
    block_size = kv.shape[2]
    page_ids = slot_mapping // block_size  # [num_tokens]
    offsets = slot_mapping % block_size  # [num_tokens]
    kv[page_ids, 0, offsets] = key
    kv[page_ids, 1, offsets] = value


def gather_kv(
    kv: torch.Tensor,  # [num_pages, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values of whole block tables: two ``[num_seqs, num_kv_heads, max_blocks*B, head_dim]``."""
    num_seqs, max_blocks = block_tables.shape
    _, _, block_size, num_kv_heads, head_dim = kv.shape
    flat_ids = block_tables.reshape(-1)  # [num_seqs * max_blocks]
    keys = kv[:, 0].index_select(0, flat_ids)  # [num_seqs*max_blocks, B, num_kv_heads, head_dim]
    values = kv[:, 1].index_select(0, flat_ids)
    shape = (num_seqs, max_blocks * block_size, num_kv_heads, head_dim)
    return keys.view(shape).transpose(1, 2), values.view(shape).transpose(1, 2)


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim], one new token per sequence
    kv: torch.Tensor,  # [num_pages, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64 (padding entries are ignored)
    context_lens: torch.Tensor,  # [num_seqs] int64, tokens in each context incl. the new one
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of one query token per sequence over its whole paged context."""
    keys, values = gather_kv(kv, block_tables)  # [num_seqs, num_kv_heads, L, head_dim]
    max_len = keys.shape[2]
    positions = torch.arange(max_len, device=query.device)  # [L]
    mask = positions[None, :] < context_lens[:, None]  # [num_seqs, L]
    out = F.scaled_dot_product_attention(
        query.unsqueeze(2),  # [num_seqs, num_heads, 1, head_dim]
        keys,
        values,
        attn_mask=mask[:, None, None, :],
        scale=scale,
        enable_gqa=True,
    )  # [num_seqs, num_heads, 1, head_dim]
    return out.squeeze(2)


@dataclass(frozen=True)
class StepIndex:
    """One step's index tensors for ``write_kv_indexed`` and ``paged_decode_attention_indexed``,
    built once (``build``) and used by every layer: the torch path's per-layer work is then the
    KV write, one gather and one SDPA, with no index arithmetic repeated per layer."""

    write: tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # page [T, 1], K or V [1, 2], offset [T, 1] (int64)
    decode_rows: torch.Tensor | None  # [2 * num_seqs * max_blocks] int64: K pages of all, then V pages
    decode_mask: torch.Tensor | None  # [num_seqs, 1, 1, max_blocks * block_size] bool: in the context

    @staticmethod
    def build(
        slot_mapping: torch.Tensor,  # [num_tokens] int64
        block_size: int,
        decode_block_tables: torch.Tensor | None = None,  # [num_seqs, max_blocks] int64 (decode-only steps)
        decode_context_lens: torch.Tensor | None = None,  # [num_seqs] int64
    ) -> StepIndex:
        device = slot_mapping.device
        kinds = torch.arange(2, device=device)[None, :]  # [1, 2]
        write = ((slot_mapping // block_size)[:, None], kinds, (slot_mapping % block_size)[:, None])
        if decode_block_tables is None or decode_context_lens is None:
            return StepIndex(write, None, None)
        # Row r of kv viewed as [num_pages * 2, B, ...] is page r // 2's K (r even) or V (r odd).
        rows = (2 * decode_block_tables.reshape(1, -1) + kinds.T).reshape(-1)  # [2 * num_seqs * max_blocks]
        positions = torch.arange(decode_block_tables.shape[1] * block_size, device=device)  # [L]
        mask = (positions[None, :] < decode_context_lens[:, None])[:, None, None, :]  # [num_seqs, 1, 1, L]
        return StepIndex(write, rows, mask)


def write_kv_indexed(
    kv: torch.Tensor,  # [num_pages, 2, block_size, num_kv_heads, head_dim]
    new_kv: torch.Tensor,  # [num_tokens, 2, num_kv_heads, head_dim]: each token's K and V
    index: StepIndex,
) -> None:
    """``write_kv`` in one op, K and V together, with the step's precomputed slots."""
    kv.index_put_(index.write, new_kv)


def paged_decode_attention_indexed(
    query: torch.Tensor,  # [num_seqs, num_heads, 1, head_dim]
    kv: torch.Tensor,  # [num_pages, 2, block_size, num_kv_heads, head_dim]
    index: StepIndex,  # built with the step's decode block tables and context lengths
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, 1, head_dim]
    """``paged_decode_attention`` with the step's precomputed gather rows and mask: one gather of
    K and V pages together, one SDPA."""
    assert index.decode_rows is not None and index.decode_mask is not None, "no decode tables in this index"
    num_seqs = query.shape[0]
    _, _, block_size, num_kv_heads, head_dim = kv.shape
    pages = kv.reshape(-1, block_size, num_kv_heads, head_dim).index_select(0, index.decode_rows)
    shape = (2, num_seqs, -1, num_kv_heads, head_dim)  # K and V of each sequence's blocks, in order
    keys, values = pages.view(shape).transpose(2, 3).unbind(0)  # each [num_seqs, num_kv_heads, L, head_dim]
    return F.scaled_dot_product_attention(
        query, keys, values, attn_mask=index.decode_mask, scale=scale, enable_gqa=True
    )


def paged_prefill_attention(
    query: torch.Tensor,  # [num_new, num_heads, head_dim]
    kv: torch.Tensor,  # [num_pages, 2, block_size, num_kv_heads, head_dim]
    block_table: torch.Tensor,  # [num_blocks] int64
    num_cached: int,
    scale: float,
    new_key: torch.Tensor | None = None,  # [num_new, num_kv_heads, head_dim]
    new_value: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_new, num_heads, head_dim]
    """Causal attention of one sequence's new tokens over cached prefix plus themselves.

    With nothing cached, ``new_key``/``new_value`` (the tokens just written) are used
    directly instead of reading them back from the pages.
    """
    num_new = query.shape[0]
    q = query.transpose(0, 1).unsqueeze(0)  # [1, num_heads, num_new, head_dim]
    if num_cached == 0 and new_key is not None and new_value is not None:
        keys = new_key.transpose(0, 1).unsqueeze(0)  # [1, num_kv_heads, num_new, head_dim]
        values = new_value.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
        return out.squeeze(0).transpose(0, 1)
    keys, values = gather_kv(kv, block_table.unsqueeze(0))  # [1, num_kv_heads, blocks*B, head_dim]
    context_len = num_cached + num_new
    keys, values = keys[:, :, :context_len], values[:, :, :context_len]
    kv_positions = torch.arange(context_len, device=query.device)  # [context_len]
    q_positions = torch.arange(num_cached, context_len, device=query.device)  # [num_new]
    mask = kv_positions[None, :] <= q_positions[:, None]  # [num_new, context_len]
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.squeeze(0).transpose(0, 1)


def paged_prefill_attention_varlen(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv: torch.Tensor,  # [num_pages, 2, block_size, num_kv_heads, head_dim]
    query_starts: torch.Tensor,  # [num_seqs + 1] int64, rows of each chunk (0 .. num_tokens)
    cached_lens: torch.Tensor,  # [num_seqs] int64, tokens cached before each chunk
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64, zero padded
    scale: float,
    new_key: torch.Tensor | None = None,  # [num_tokens, num_kv_heads, head_dim], the chunks' own K
    new_value: torch.Tensor | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """``paged_prefill_attention`` for every prefill chunk of a step: chunk ``s`` is query rows
    ``query_starts[s]:query_starts[s + 1]`` at positions ``cached_lens[s]`` on (one call per chunk)."""
    out = torch.empty_like(query)
    starts, cached = query_starts.tolist(), cached_lens.tolist()
    for s, (start, end) in enumerate(itertools.pairwise(starts)):
        rows = slice(start, end)
        key = new_key[rows] if new_key is not None else None
        value = new_value[rows] if new_value is not None else None
        num_blocks = -(-(cached[s] + end - start) // kv.shape[2])
        out[rows] = paged_prefill_attention(query[rows], kv, block_tables[s, :num_blocks], cached[s], scale, key, value)
    return out


def paged_attention_reference(
    query: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    kv: torch.Tensor,  # [num_pages, 2, block_size, num_kv_heads, head_dim]
    query_starts: torch.Tensor,  # [num_seqs + 1] int64
    seq_lens: torch.Tensor,  # [num_seqs] int64, context of each sequence after this step's write
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    """The reference twin of ``triton_unified_attention.unified_attention``: every sequence of a
    step (decode tokens and prefill chunks alike; its queries are the last ``q_s`` positions of
    its ``seq_lens[s]``-token context) as one gather + SDPA each, reading K/V from the pages."""
    out = torch.zeros_like(query)
    starts, lens = query_starts.tolist(), seq_lens.tolist()
    block_size = kv.shape[2]
    for s, (start, end) in enumerate(itertools.pairwise(starts)):
        if end == start:
            continue
        num_blocks = -(-lens[s] // block_size)
        rows = slice(start, end)
        out[rows] = paged_prefill_attention(
            query[rows], kv, block_tables[s, :num_blocks], lens[s] - (end - start), scale
        )
    return out

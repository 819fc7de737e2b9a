"""Paged decode attention on the GPU: the one-launch attention of ``triton_unified_attention.py``
with one query row per sequence (the ``DecodeAttention`` of the model's kernels, and what the
kernel tests and ``benchmarks.gpu`` measure against the torch reference).

Semantics, identical to ``paged_attention.paged_decode_attention`` (the reference): for
sequence ``s`` with ``n_s = context_lens[s]`` tokens cached (the new one included) and
query head ``h`` of KV head ``g = h // G`` (``G = num_heads / num_kv_heads``),

    out[s, h] = softmax_j( q[s, h] . K_s[j, g] * scale ) @ V_s[:, g],   j < n_s,
    K_s[j] = kv[block_tables[s, j // B], 0, j % B]   (V likewise with index 1)

Arguments (any float dtype; accumulation in float32):

* ``query``        ``[num_seqs, num_heads, head_dim]``
* ``kv``           ``[num_pages, 2, block_size, num_kv_heads, head_dim]``, one layer's pages
* ``block_tables`` ``[num_seqs, max_blocks]`` int64, entries past ``ceil(n_s / B)`` ignored
* ``context_lens`` ``[num_seqs]`` int64, each >= 1
* returns          ``[num_seqs, num_heads, head_dim]`` in ``query.dtype``
"""

from __future__ import annotations

import torch
from loraserve.kernels.triton_unified_attention import runs_interpreted, unified_attention

__all__ = ["paged_decode_attention", "runs_interpreted"]


def paged_decode_attention(
    query: torch.Tensor,  # [num_seqs, num_heads, head_dim]
    kv: torch.Tensor,  # [num_pages, 2, block_size, num_kv_heads, head_dim]
    block_tables: torch.Tensor,  # [num_seqs, max_blocks] int64
    context_lens: torch.Tensor,  # [num_seqs] int64
    scale: float,
) -> torch.Tensor:  # [num_seqs, num_heads, head_dim]
    """Attention of one query token per sequence over its paged context (see the module docstring)."""
    query_starts = torch.arange(query.shape[0] + 1, device=query.device)  # [num_seqs + 1]: one row each
    return unified_attention(query, kv, query_starts, context_lens, block_tables, scale)

"""The kernels a Llama model runs: one callable type per fused operation, and ``ModelKernels``,
the set a kernel backend builds once and hands to the model at construction."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from loraserve.kernels.paged_attention import paged_decode_attention, paged_prefill_attention_varlen, write_kv

# (query, kv, block_tables, context_lens, scale) -> out: see kernels/paged_attention.py.
DecodeAttention = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float], torch.Tensor]
# (query, kv, query_starts, cached_lens, block_tables, scale, new_key, new_value) -> out: every
# prefill chunk of a step (see kernels/paged_attention.py: paged_prefill_attention_varlen).
PrefillAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor, torch.Tensor],
    torch.Tensor,
]
# (x, weight, eps, residual or None) -> out; with a residual, residual += x in place first.
FusedRMSNorm = Callable[[torch.Tensor, torch.Tensor, float, torch.Tensor | None], torch.Tensor]
# (kv, key, value, slot_mapping) -> None: stores each token's K and V in its slot.
WriteKV = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]
# (x [num_tokens, heads, head_dim], cos, sin) -> None: rotates x in place.
FusedRope = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
# (query, kv, query_starts, seq_lens, block_tables, scale, out or None, num_splits) -> out: every
# sequence of a step, decode and prefill, in one call (see kernels/triton_unified_attention.py).
UnifiedAttention = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, float, torch.Tensor | None, int],
    torch.Tensor,
]
# (query, key, value, cos, sin, kv, slot_mapping) -> None: RoPE on query and key in place, then
# key and value stored in their slots (slot -1: not stored).
RopeWriteKV = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None
]
# (gate, up) -> None: gate <- silu(gate) * up in place.
SiluAndMul = Callable[[torch.Tensor, torch.Tensor], None]


@dataclass(frozen=True)
class ModelKernels:
    """The kernels a model runs, given at construction (a backend's, see loraserve/kernel_backend.py);
    a fused kernel left None: the model's torch ops. The defaults are the torch references.
    ``attention`` set: it takes every sequence of a step in one call, instead of
    ``decode_attention`` and ``prefill_attention``; ``rope_write_kv`` set: it replaces ``rope``
    and ``write_kv``."""

    decode_attention: DecodeAttention = paged_decode_attention
    prefill_attention: PrefillAttention = paged_prefill_attention_varlen
    write_kv: WriteKV = write_kv
    rms_norm: FusedRMSNorm | None = None
    rope: FusedRope | None = None
    attention: UnifiedAttention | None = None
    rope_write_kv: RopeWriteKV | None = None
    silu_and_mul: SiluAndMul | None = None

    @property
    def is_reference(self) -> bool:
        """Whether these are the torch references throughout (the ``torch`` backend): the model then
        rotates q/k/v in place in their GEMM output and indexes the KV pages once per step."""
        return self == ModelKernels()

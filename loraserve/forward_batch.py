"""Tensors one model forward needs, built by the runner from a ScheduledBatch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PrefillSpan:
    """One sequence's chunk of new tokens inside the flattened batch."""

    start: int
    num_new: int
    num_cached: int
    block_table: torch.Tensor  # [num_blocks] int64


@dataclass
class ForwardBatch:
    """Flattened tokens of a step: decode tokens first, then each prefill chunk.

    ``lora`` carries the per-token adapter mapping when adapters are in the batch.
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decode_tokens, max_blocks] int64
    decode_context_lens: torch.Tensor  # [num_decode_tokens] int64
    prefills: list[PrefillSpan]
    logits_indices: torch.Tensor  # [num_sampled] int64, rows whose logits are sampled
    lora: Any = None

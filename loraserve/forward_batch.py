"""Tensors one model forward needs, built by the runner from a ScheduledBatch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class PrefillBatch:
    """The step's prefill chunks, which follow the decode tokens: chunk ``s`` is rows
    ``query_starts[s]:query_starts[s + 1]`` of the prefill part, at positions ``cached_lens[s]``
    on, its context in the pages of ``block_tables[s]`` (what one attention call for all takes)."""

    query_starts: torch.Tensor  # [num_prefills + 1] int64, from 0 to the prefill tokens
    cached_lens: torch.Tensor  # [num_prefills] int64
    block_tables: torch.Tensor  # [num_prefills, max_blocks] int64, zero padded


@dataclass
class ForwardBatch:
    """Flattened tokens of a step: decode tokens first, then each prefill chunk.

    Every sequence of the step, decode or prefill, is described by ``query_starts``, ``seq_lens``
    and ``block_tables`` (what a one-launch attention takes); the decode part's tables are views
    of their first rows. ``lora`` carries the per-token adapter mapping when adapters are in the batch.
    """

    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    slot_mapping: torch.Tensor  # [num_tokens] int64
    query_starts: torch.Tensor  # [num_seqs + 1] int64: rows of sequence s are query_starts[s]:query_starts[s + 1]
    seq_lens: torch.Tensor  # [num_seqs] int64: context of each sequence after this step's KV write
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int64, decode sequences first
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decode_tokens, max_blocks] int64 (block_tables' first rows)
    decode_context_lens: torch.Tensor  # [num_decode_tokens] int64 (seq_lens' first entries)
    prefill: PrefillBatch | None  # None: a decode-only step
    logits_indices: torch.Tensor  # [num_sampled] int64, rows whose logits are sampled
    lora: Any = None
    attention_splits: int = 1  # split-KV shares of each sequence's context (one-launch attention)


MIN_SPLIT_CONTEXT = 512  # context tokens a split-KV share should have at least


def attention_splits(num_programs: int, max_context: int, num_sms: int) -> int:
    """How many shares to split each context into (flash-decoding) so that ``num_programs``
    attention programs (query blocks x KV heads) fill ``num_sms`` multiprocessors: a power of two,
    1 when they already do, when the contexts are short, or off a GPU (``num_sms`` 0)."""
    if num_programs <= 0 or num_programs >= num_sms:
        return 1
    splits = 1
    while splits < 16 and num_programs * splits < num_sms and max_context // (2 * splits) >= MIN_SPLIT_CONTEXT:
        splits *= 2
    return splits

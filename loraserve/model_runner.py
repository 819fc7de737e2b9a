"""Runs one scheduled step: builds the flattened batch, runs the model, samples.

Owns the pool's storage: one tensor ``[num_layers, num_pages, page_elems]`` whose
page ``p`` in layer ``l`` holds, for a KV block, ``[2, block_size, num_kv_heads,
head_dim]`` (K then V), and for an adapter, a slice of its flattened weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from loraserve.forward_batch import ForwardBatch, PrefillBatch
from loraserve.lora.batch import LoRABatch
from loraserve.lora.weights import write_adapter_load
from loraserve.models.llama import LlamaForCausalLM, LoRAHook
from loraserve.sampler import Sampler
from loraserve.scheduled_batch import ScheduledBatch
from loraserve.sequence import Sequence

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PageLayout:
    """Shape of a page; a page id addresses the same slot in every layer."""

    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int

    @property
    def page_elems(self) -> int:
        """Elements of one page in one layer (one KV block: K and V)."""
        return 2 * self.block_size * self.num_kv_heads * self.head_dim

    def page_bytes(self, dtype: torch.dtype) -> int:
        """Bytes of one page id across all layers."""
        return self.num_layers * self.page_elems * torch.tensor([], dtype=dtype).element_size()

    @classmethod
    def for_model(cls, config: Any, block_size: int) -> PageLayout:
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        return cls(config.num_hidden_layers, block_size, config.num_key_value_heads, head_dim)


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        layout: PageLayout,
        num_pages: int,
        num_swap_pages: int,
        dtype: torch.dtype,
        device: torch.device,
        make_lora_hook: Callable[[torch.Tensor], LoRAHook],
        seed: int = 0,
    ) -> None:
        self.model = model
        self.layout = layout
        self.device = device
        self.storage = torch.zeros(layout.num_layers, num_pages, layout.page_elems, dtype=dtype, device=device)
        self.swap_storage = torch.zeros(
            layout.num_layers,
            num_swap_pages,
            layout.page_elems,
            dtype=dtype,
            pin_memory=device.type == "cuda",
        )
        kv_shape = (num_pages, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.kv_caches = [self.storage[layer].view(kv_shape) for layer in range(layout.num_layers)]
        self.sampler = Sampler(seed)
        self.lora_hook = make_lora_hook(self.storage)

    def copy_pages(self, batch: ScheduledBatch) -> None:
        """Swap-out, swap-in, copy-on-write copies and adapter loads, in that order, before the forward."""
        if batch.swap_out:
            src, dst = _pairs(batch.swap_out)
            self.swap_storage[:, dst] = self.storage[:, src].to("cpu")
        if batch.swap_in:
            src, dst = _pairs(batch.swap_in)
            self.storage[:, dst] = self.swap_storage[:, src].to(self.device)
        if batch.copy_pages:
            src, dst = _pairs(batch.copy_pages)
            self.storage[:, dst] = self.storage[:, src]
        for load in batch.adapter_loads:
            write_adapter_load(self.storage, load)

    def prepare(self, batch: ScheduledBatch) -> tuple[ForwardBatch, list[int]]:
        """Flatten the batch: decode tokens first, and within each part grouped by adapter.

        Also returns the order of ``batch.seqs`` used.
        """
        order = sorted(
            range(len(batch.seqs)),
            key=lambda i: (batch.num_new_tokens[i] != 1, batch.seqs[i].adapter_id or ""),
        )
        lora_ranges: list[tuple[int, int, str | None]] = []
        block_size = self.layout.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logits_rows: list[int] = []
        num_decode = 0
        decode_tables: list[list[int]] = []
        decode_lens: list[int] = []
        prefill_tables: list[list[int]] = []
        prefill_starts: list[int] = [0]
        prefill_cached: list[int] = []
        for i in order:
            seq, num_new = batch.seqs[i], batch.num_new_tokens[i]
            start = seq.num_computed_tokens
            end = start + num_new
            lora_ranges.append((len(input_ids), len(input_ids) + num_new, seq.adapter_id))
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(seq.block_ids[p // block_size] * block_size + p % block_size for p in range(start, end))
            if num_new == 1:
                num_decode += 1
                decode_tables.append(seq.block_ids)
                decode_lens.append(end)
            else:
                prefill_tables.append(seq.block_ids)
                prefill_starts.append(prefill_starts[-1] + num_new)
                prefill_cached.append(start)
            if batch.samples(i):
                logits_rows.append(len(input_ids) - 1)
        dev = self.device
        prefill = None
        if prefill_tables:
            prefill = PrefillBatch(
                query_starts=torch.tensor(prefill_starts, dtype=torch.long, device=dev),
                cached_lens=torch.tensor(prefill_cached, dtype=torch.long, device=dev),
                block_tables=_padded(prefill_tables, dev),
            )
        forward_batch = ForwardBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=dev),
            positions=torch.tensor(positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            num_decode_tokens=num_decode,
            decode_block_tables=_padded(decode_tables, dev),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.long, device=dev),
            prefill=prefill,
            logits_indices=torch.tensor(logits_rows, dtype=torch.long, device=dev),
            lora=LoRABatch.from_ranges(lora_ranges, batch.adapters),
        )
        return forward_batch, order

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        """Run the step; return the sampled token of each sequence (None mid-prefill)."""
        self.copy_pages(batch)
        sampled: list[int | None] = [None] * len(batch.seqs)
        if not batch.seqs:
            return sampled
        forward_batch, order = self.prepare(batch)
        hook = self.lora_hook if forward_batch.lora is not None else None
        logits = self.model(forward_batch, self.kv_caches, hook)  # [num_sampled, vocab]
        sampling_index = [i for i in order if batch.samples(i)]
        if sampling_index:
            seqs: list[Sequence] = [batch.seqs[i] for i in sampling_index]
            for i, token in zip(sampling_index, self.sampler(logits, seqs), strict=True):
                sampled[i] = token
        return sampled


def _padded(tables: list[list[int]], device: torch.device) -> torch.Tensor:  # [len(tables), max_blocks] int64
    max_blocks = max((len(t) for t in tables), default=0)
    padded = [t + [0] * (max_blocks - len(t)) for t in tables]
    return torch.tensor(padded, dtype=torch.long, device=device).view(len(tables), max_blocks)


def _pairs(mapping: list[tuple[int, int]]) -> tuple[torch.Tensor, torch.Tensor]:
    src = torch.tensor([s for s, _ in mapping], dtype=torch.long)
    dst = torch.tensor([d for _, d in mapping], dtype=torch.long)
    return src, dst

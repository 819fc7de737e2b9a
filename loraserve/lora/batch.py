"""The adapter part of a step's messages: where adapters sit, what to load, which tokens use which.

The scheduler pins adapters and puts into its ``ScheduledBatch`` the pages of every adapter its
sequences use (``AdapterPages``) and the weights to write into newly allocated pages
(``AdapterLoad``); the runner writes the loads before the forward and hands ``LoRABatch`` to the
model inside its ``ForwardBatch``, exactly as KV block tables travel. Nothing in the forward asks
the adapter manager anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from loraserve.adapters import LoRAAdapter
from loraserve.lora.layout import AdapterLayout

if TYPE_CHECKING:
    from loraserve.kernels.lora import SlotGrouping
    from loraserve.lora.slots import SlotTables


@dataclass(frozen=True)
class AdapterPages:
    """A resident adapter: its page ids in order (its flat per-layer buffer) and its layout."""

    adapter_id: str
    page_ids: tuple[int, ...]
    layout: AdapterLayout

    @property
    def is_contiguous(self) -> bool:
        first = self.page_ids[0]
        return self.page_ids == tuple(range(first, first + len(self.page_ids)))


@dataclass(frozen=True)
class AdapterLoad:
    """Weights to write into an adapter's freshly allocated pages before this step's forward."""

    pages: AdapterPages
    weights: LoRAAdapter


@dataclass(frozen=True)
class LoRABatch:
    """Contiguous token ranges of the flattened batch, each using one adapter, and where each
    of those adapters sits in the pool. A decode step for the slot kernel (graph-capturable) also
    carries each token's adapter slot and the slot tables (``lora/slots.py``)."""

    segments: tuple[tuple[int, int, str], ...]  # (start, end, adapter_id)
    adapters: Mapping[str, AdapterPages]  # every adapter of ``segments``
    token_slots: torch.Tensor | None = None  # [num_tokens] int64, -1: base model
    slots: SlotTables | None = None
    slot_grouping: SlotGrouping | None = None  # the tokens grouped by slot, once per step (on the device)
    # The LoRA hook's data for this step, built by the runner from the step's one upload (a hook
    # with ``upload_parts``, the Triton one); None: the hook prepares it in the forward.
    prepared: Any = None

    @classmethod
    def from_runs(
        cls, adapter_ids: list[str | None], token_ends: np.ndarray, adapters: Mapping[str, AdapterPages]
    ) -> LoRABatch | None:
        """Segments of sequences back to back (sequence ``i``'s tokens end at ``token_ends[i]``, the
        next one's start there), each taking at least one token: every run of consecutive sequences
        of one adapter is one segment; base-model sequences (None) make none. None if no adapter."""
        if not adapter_ids:
            return None
        breaks = [i for i in range(1, len(adapter_ids)) if adapter_ids[i] != adapter_ids[i - 1]]
        firsts, lasts = [0, *breaks], [*breaks, len(adapter_ids)]
        ends = token_ends.tolist()
        segments = tuple(
            (ends[first - 1] if first else 0, ends[last - 1], adapter_id)
            for first, last in zip(firsts, lasts, strict=True)
            if (adapter_id := adapter_ids[first]) is not None
        )
        if not segments:
            return None
        return cls(segments, {adapter_id: adapters[adapter_id] for _, _, adapter_id in segments})

    @property
    def adapter_ids(self) -> set[str]:
        return {adapter_id for _, _, adapter_id in self.segments}

    def touches(self, layer: int, group: str) -> bool:
        """Whether an adapter of this step adds LoRA to input group ``group`` of ``layer``."""
        return any(group in pages.layout.layers[layer] for pages in self.adapters.values())

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
from typing import TYPE_CHECKING

import torch

from loraserve.adapters import LoRAAdapter
from loraserve.lora.layout import AdapterLayout

if TYPE_CHECKING:
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

    @classmethod
    def from_ranges(
        cls, ranges: list[tuple[int, int, str | None]], adapters: Mapping[str, AdapterPages]
    ) -> LoRABatch | None:
        """Merge touching ranges of one adapter; drop base-model ranges. None if no adapter."""
        merged: list[tuple[int, int, str]] = []
        for start, end, adapter_id in ranges:
            if adapter_id is None or start == end:
                continue
            if merged and merged[-1][2] == adapter_id and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], end, adapter_id)
            else:
                merged.append((start, end, adapter_id))
        if not merged:
            return None
        return cls(tuple(merged), {adapter_id: adapters[adapter_id] for _, _, adapter_id in merged})

    @property
    def adapter_ids(self) -> set[str]:
        return {adapter_id for _, _, adapter_id in self.segments}

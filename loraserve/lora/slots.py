"""Adapter slots for graph-captured decode steps (SGLang's CUDA-graph LoRA batch info, our own code).

A decode step captured as a CUDA graph replays fixed kernel launches on fixed buffers, so it
cannot take a step's segments. Instead each adapter the step uses sits in a *slot*: one row of
device tables (its page table, and per layer and input group its ``SegmentMeta`` and scales),
and every token carries its slot (``-1``: the base model) in the step's one upload. Rows are
written only when an adapter takes a slot (it was not in one, or its pages moved), never in the
forward, so a captured graph reads them in place; a slot is reused least recently used first,
never while its adapter is in the step. Any rank fits: a slot holds pages, not weights.

The runner owns this object (it is derived state of the batches it sees, like ``InputBatch``);
the tables travel to the LoRA hook inside the batch (``LoRABatch.slots``). When an adapter needs
more pages than a page-table row holds, the table is reallocated wider, and when it has more
stacked A rows in some layer group than ``row_bound`` (what the slot kernels' shrink grid and
intermediate span), the bound doubles until it fits; either way ``generation`` changes: graphs
captured over the old tables or bound must be captured again.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, replace

import torch

from loraserve.host_copies import upload
from loraserve.kernels.lora import SegmentMeta
from loraserve.lora.apply_cpu import layout_meta
from loraserve.lora.batch import AdapterPages
from loraserve.lora.layout import LORA_GROUPS


@dataclass(frozen=True)
class SlotTables:
    """The device tables, read by the slot kernel (``kernels/triton_lora_slots.py``)."""

    page_tables: torch.Tensor  # [num_slots, max_pages] int64
    meta: torch.Tensor  # [num_layers, num_groups, num_slots, 14] int64
    scales: torch.Tensor  # [num_layers, num_groups, num_slots, 3] float32
    row_bound: int  # >= the stacked A rows of every slot in every layer group (a power of two)


INITIAL_ROW_BOUND = 64


class AdapterSlots:
    def __init__(self, num_slots: int, num_layers: int, device: torch.device, max_pages: int = 8) -> None:
        self.num_slots = num_slots
        self.num_layers = num_layers
        self.device = device
        self.tables = self._allocate(max_pages, INITIAL_ROW_BOUND)
        self.generation = 0  # bumped when the tables are reallocated or the row bound grows
        self.num_writes = 0  # slot rows written (host-to-device copies), once per adapter taking a slot
        # adapter id -> (slot, its pages when written), least recently used first
        self._slots: OrderedDict[str, tuple[int, tuple[int, ...]]] = OrderedDict()
        self._free = list(reversed(range(num_slots)))

    def _allocate(self, max_pages: int, row_bound: int) -> SlotTables:
        shape = (self.num_layers, len(LORA_GROUPS), self.num_slots)
        return SlotTables(
            torch.zeros(self.num_slots, max_pages, dtype=torch.long, device=self.device),
            torch.zeros(*shape, SegmentMeta.WIDTH, dtype=torch.long, device=self.device),
            torch.zeros(*shape, SegmentMeta.MAX_MODULES, dtype=torch.float32, device=self.device),
            row_bound,
        )

    def assign(self, adapters: Mapping[str, AdapterPages]) -> dict[str, int]:
        """The slot of every adapter of a step, writing the rows of those that had none (or moved)."""
        if len(adapters) > self.num_slots:
            raise RuntimeError(f"{len(adapters)} adapters in one step; there are {self.num_slots} slots")
        slots: dict[str, int] = {}
        for adapter_id, pages in adapters.items():
            held = self._slots.get(adapter_id)
            if held is not None and held[1] == pages.page_ids:
                self._slots.move_to_end(adapter_id)
                slots[adapter_id] = held[0]
                continue
            slot = held[0] if held is not None else self._take(adapters)
            self._write(slot, pages)
            self._slots[adapter_id] = (slot, pages.page_ids)
            self._slots.move_to_end(adapter_id)
            slots[adapter_id] = slot
        return slots

    def _take(self, in_step: Mapping[str, AdapterPages]) -> int:
        if self._free:
            return self._free.pop()
        for adapter_id in self._slots:  # least recently used first
            if adapter_id not in in_step:
                return self._slots.pop(adapter_id)[0]
        raise RuntimeError("no adapter slot free")  # unreachable: len(in_step) <= num_slots

    def _write(self, slot: int, pages: AdapterPages) -> None:
        width = self.tables.page_tables.shape[1]
        if len(pages.page_ids) > width:  # a wider row than any before: reallocate, keep the rows
            old = self.tables
            self.tables = self._allocate(max(len(pages.page_ids), 2 * width), old.row_bound)
            self.tables.page_tables[:, :width] = old.page_tables
            self.tables.meta.copy_(old.meta)
            self.tables.scales.copy_(old.scales)
            self.generation += 1
        meta, scales = layout_meta(pages.layout)  # [num_layers, num_groups, 14], [.., 3]
        rows = int(meta[:, :, SegmentMeta.NUM_ROWS].max())
        if rows > self.tables.row_bound:
            bound = self.tables.row_bound
            while bound < rows:
                bound *= 2
            self.tables = replace(self.tables, row_bound=bound)
            self.generation += 1
        row = torch.zeros(self.tables.page_tables.shape[1], dtype=torch.long)
        row[: len(pages.page_ids)] = torch.tensor(pages.page_ids, dtype=torch.long)
        # Copies queued on the stream: the step in flight (async scheduling) is not waited for.
        self.tables.page_tables[slot] = upload(row, self.device)
        self.tables.meta[:, :, slot] = upload(meta, self.device)
        self.tables.scales[:, :, slot] = upload(scales, self.device)
        self.num_writes += 1

"""The LoRA hook over the compiled CPU kernel: one call per input group and layer.

Per step (once per ``LoRABatch``) it packs, for every segment, where its adapter's
weights sit (``bounds``: whether its pages are consecutive and the first one's offset;
``page_tables``: its page ids) and the offsets of every group's A and B matrices in every
layer (``meta``, ``scales``: each resident adapter's part is built once and cached).
The model's hook then hands those tensors to ``kernels.cpu.lora_segments``, which runs
all segments' GEMMs in two grouped MKL calls: no Python loop over adapters or layers'
segments inside the forward.
"""

from __future__ import annotations

import torch

from loraserve.kernels import cpu
from loraserve.kernels.lora import SegmentMeta
from loraserve.lora.apply_torch import PerBatchLoRAHook
from loraserve.lora.batch import AdapterPages, LoRABatch
from loraserve.lora.layout import LORA_GROUPS, AdapterLayout

GROUP_INDEX = {group: index for index, group in enumerate(LORA_GROUPS)}
META_WIDTH = SegmentMeta.WIDTH  # a_offset, num_rows, then (column, rank, b_offset, out_features) x 3
MAX_MODULES = SegmentMeta.MAX_MODULES


def layout_meta(layout: AdapterLayout) -> tuple[torch.Tensor, torch.Tensor]:
    """``meta [num_layers, num_groups, 14]`` int64 and ``scales [num_layers, num_groups, 3]`` float32."""
    num_layers, num_groups = len(layout.layers), len(LORA_GROUPS)
    meta = torch.zeros(num_layers, num_groups, META_WIDTH, dtype=torch.long)
    scales = torch.zeros(num_layers, num_groups, MAX_MODULES, dtype=torch.float32)
    for layer, groups in enumerate(layout.layers):
        for group, slot in groups.items():
            g = GROUP_INDEX[group]
            meta[layer, g, SegmentMeta.A_OFFSET] = slot.a_offset
            meta[layer, g, SegmentMeta.NUM_ROWS] = slot.num_rows
            for index, module in enumerate(slot.modules):
                if module is None:
                    continue
                base = SegmentMeta.MODULE_BASE + SegmentMeta.MODULE_STRIDE * index
                fields = {
                    SegmentMeta.COLUMN: module.column,
                    SegmentMeta.RANK: module.rank,
                    SegmentMeta.B_OFFSET: module.b_offset,
                    SegmentMeta.OUT_FEATURES: module.out_features,
                }
                for field, value in fields.items():
                    meta[layer, g, base + field] = value
                scales[layer, g, index] = module.scale
    return meta, scales


# bounds [S, 4], page_tables [S, max_pages], meta [L, G, S, 14], scales [L, G, S, 3]
Packed = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


class SegmentPacker:
    """Packs a step's segments for the kernels that read adapters in place from the pool.

    Each adapter's ``layout_meta`` is built at its first step and kept (an adapter id is a digest
    of its weights, so its layout never changes); the memo forgets adapters absent from a step
    when it grows past a bound.
    """

    def __init__(self, page_elems: int) -> None:
        self.page_elems = page_elems
        self._layout_meta: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}

    def _meta(self, pages: AdapterPages, lora: LoRABatch) -> tuple[torch.Tensor, torch.Tensor]:
        cached = self._layout_meta.get(pages.adapter_id)
        if cached is None:
            if len(self._layout_meta) > 2 * len(lora.adapters) + 64:
                self._layout_meta = {k: v for k, v in self._layout_meta.items() if k in lora.adapters}
            cached = self._layout_meta[pages.adapter_id] = layout_meta(pages.layout)
        return cached

    def pack(self, lora: LoRABatch) -> Packed:
        """Where every segment's adapter sits, and its matrices' offsets in every layer and group."""
        bounds: list[tuple[int, int, int, int]] = []
        tables: list[list[int]] = []
        metas: list[torch.Tensor] = []
        scales: list[torch.Tensor] = []
        for start, end, adapter_id in lora.segments:
            pages = lora.adapters[adapter_id]
            meta, scale = self._meta(pages, lora)
            metas.append(meta)
            scales.append(scale)
            tables.append(list(pages.page_ids))
            if pages.is_contiguous:
                bounds.append((start, end, 0, pages.page_ids[0] * self.page_elems))
            else:  # scattered pages: long segments copy their matrices out through the page table
                bounds.append((start, end, 1, 0))
        max_pages = max(len(table) for table in tables)
        padded = [table + [0] * (max_pages - len(table)) for table in tables]
        return (
            torch.tensor(bounds, dtype=torch.long),
            torch.tensor(padded, dtype=torch.long).view(len(tables), max_pages),
            torch.stack(metas, dim=2),
            torch.stack(scales, dim=2),
        )


class CompiledLoRAApplier(PerBatchLoRAHook[Packed]):
    """``LoRAHook`` reading adapter weights in place from the pool's storage (float32)."""

    def __init__(self, storage: torch.Tensor) -> None:
        super().__init__(storage)
        self.packer = SegmentPacker(storage.shape[2])

    def prepare(self, lora: LoRABatch) -> Packed:
        return self.packer.pack(lora)

    def apply(
        self,
        x: torch.Tensor,  # [num_tokens, in_features]
        layer: int,
        group: str,
        outputs: tuple[torch.Tensor, ...],  # each [num_tokens, out_features_m], updated in place
        prepared: Packed,
    ) -> None:
        bounds, page_tables, meta, scales = prepared
        cpu.lora_segments(x, outputs, self.storage, layer, GROUP_INDEX[group], bounds, page_tables, meta, scales)

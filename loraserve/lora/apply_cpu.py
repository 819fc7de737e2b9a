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

import numpy as np
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

    It keeps one row per adapter seen (its ``layout_meta``, page table, and where its pages
    start), written when the adapter first appears or its pages move (an adapter id is a digest
    of its weights, so its layout never changes); a step's tensors are then gathers of those
    rows by segment. When more adapters than a bound have been seen, the rows start over.
    """

    def __init__(self, num_layers: int, page_elems: int) -> None:
        self.page_elems = page_elems
        self._rows: dict[str, tuple[int, tuple[int, ...]]] = {}  # adapter id -> (row, its pages)
        shape = (num_layers, len(LORA_GROUPS), 0)
        self._meta = np.zeros((*shape, META_WIDTH), dtype=np.int64)  # [L, G, rows, 14]
        self._scales = np.zeros((*shape, MAX_MODULES), dtype=np.float32)  # [L, G, rows, 3]
        self._pages = np.zeros((0, 1), dtype=np.int64)  # [rows, max_pages], zero padded
        self._bounds = np.zeros((0, 2), dtype=np.int64)  # [rows, 2]: paged (0: consecutive), offset

    def _row(self, pages: AdapterPages) -> int:
        held = self._rows.get(pages.adapter_id)
        if held is not None and held[1] == pages.page_ids:
            return held[0]
        row = held[0] if held is not None else len(self._rows)
        self._write(row, pages)
        self._rows[pages.adapter_id] = (row, pages.page_ids)
        return row

    def _write(self, row: int, pages: AdapterPages) -> None:
        meta, scales = layout_meta(pages.layout)  # [L, G, 14], [L, G, 3]
        num_pages = len(pages.page_ids)
        capacity, width = self._pages.shape
        if row >= capacity:
            rows = max(row + 1, 2 * capacity)
            self._meta, self._scales = _grown(self._meta, 2, rows), _grown(self._scales, 2, rows)
            self._pages, self._bounds = _grown(self._pages, 0, rows), _grown(self._bounds, 0, rows)
        if num_pages > width:
            self._pages = _grown(self._pages, 1, num_pages)
        self._meta[:, :, row] = meta.numpy()
        self._scales[:, :, row] = scales.numpy()
        self._pages[row] = 0
        self._pages[row, :num_pages] = pages.page_ids
        if pages.is_contiguous:
            self._bounds[row] = (0, pages.page_ids[0] * self.page_elems)
        else:  # scattered pages: long segments copy their matrices out through the page table
            self._bounds[row] = (1, 0)

    def pack(self, lora: LoRABatch) -> Packed:
        """Where every segment's adapter sits, and its matrices' offsets in every layer and group."""
        if len(self._rows) > len(lora.adapters) + 64:
            self._rows = {}  # start over (before any row of this step is taken): rows are written again
        segments = lora.segments
        rows = np.array([self._row(lora.adapters[adapter_id]) for _, _, adapter_id in segments], np.int64)
        bounds = np.empty((len(segments), 4), dtype=np.int64)  # start, end, paged, offset
        bounds[:, :2] = [(start, end) for start, end, _ in segments]
        bounds[:, 2:] = self._bounds[rows]
        num_pages = max(len(lora.adapters[adapter_id].page_ids) for adapter_id in lora.adapters)
        return (
            torch.from_numpy(bounds),
            torch.from_numpy(self._pages[rows, :num_pages]),  # [S, max_pages]
            torch.from_numpy(np.take(self._meta, rows, axis=2)),  # [L, G, S, 14]
            torch.from_numpy(np.take(self._scales, rows, axis=2)),  # [L, G, S, 3]
        )


def _grown(array: np.ndarray, axis: int, size: int) -> np.ndarray:
    """``array`` zero padded along ``axis`` to ``size``."""
    padding = [(0, 0)] * array.ndim
    padding[axis] = (0, size - array.shape[axis])
    return np.pad(array, padding)


class CompiledLoRAApplier(PerBatchLoRAHook[Packed]):
    """``LoRAHook`` reading adapter weights in place from the pool's storage (float32 or bfloat16);
    ``tile_lengths``: the segment-length classes that run on AMX tiles; ``loop_lengths``: the classes
    of more than 32 tokens that run on the tiled loops rather than MKL; ``expand_rank_block``: B's rows
    the loops' expand streams at once; ``expand_pairs``: that expand by bfloat16 pair dots
    (``cpu.lora_segments``)."""

    def __init__(
        self,
        storage: torch.Tensor,
        tile_lengths: int = cpu.EVERY_TILE_LENGTH,
        loop_lengths: int = 0,
        expand_rank_block: int = cpu.EXPAND_RANK_BLOCK,
        expand_pairs: bool = False,
    ) -> None:
        super().__init__(storage)
        self.packer = SegmentPacker(storage.shape[0], storage.shape[2])
        self.tile_lengths = tile_lengths
        self.loop_lengths = loop_lengths
        self.expand_rank_block = expand_rank_block
        self.expand_pairs = expand_pairs

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
        cpu.lora_segments(
            x, outputs, self.storage, layer, GROUP_INDEX[group], bounds, page_tables, meta, scales, self.tile_lengths,
            self.loop_lengths, self.expand_rank_block, self.expand_pairs,
        )  # fmt: skip

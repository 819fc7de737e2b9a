"""The LoRA hook over the Triton kernels (``kernels/triton_lora.py``): the GPU path.

Per step it packs the segments once (``SegmentPacker``, shared with the CPU kernel's hook),
hands that metadata to the runner for the step's one upload (``upload_parts``) and notes the
two host-side grid bounds of every layer
and group (longest segment, most stacked A rows); per layer and group the forward then
launches one shrink and one expand kernel that read the adapters' weights in place from
the pool pages, whatever their ranks and wherever their pages are.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from loraserve.forward_batch import ForwardBatch
from loraserve.kernels import triton_lora, triton_lora_slots
from loraserve.lora.apply_cpu import GROUP_INDEX, SegmentPacker
from loraserve.lora.apply_torch import PerBatchLoRAHook, UploadParts
from loraserve.lora.batch import LoRABatch


@dataclass(frozen=True)
class TritonSegments:
    bounds: torch.Tensor  # [num_segments, 4] int64, on the device
    page_tables: torch.Tensor  # [num_segments, max_pages] int64
    meta: torch.Tensor  # [num_layers, num_groups, num_segments, 14] int64
    scales: torch.Tensor  # [num_layers, num_groups, num_segments, 3] float32
    max_segment_len: int
    max_rows: list[list[int]]  # [num_layers][num_groups]: most stacked A rows of any segment


class TritonLoRAApplier(PerBatchLoRAHook[TritonSegments]):
    """``LoRAHook`` that runs every segment of a layer's input group in two kernel launches;
    a batch that carries token slots (a decode step, maybe graph-captured) runs the slot kernels
    instead: two launches per layer and group whose grids depend only on the batch's size and the
    slots' row bound, nothing prepared on the host."""

    def __call__(
        self,
        x: torch.Tensor,  # [num_tokens, in_features]
        layer: int,
        group: str,
        outputs: tuple[torch.Tensor, ...],  # each [num_tokens, out_features_m], updated in place
        batch: ForwardBatch,
    ) -> None:
        lora: LoRABatch | None = batch.lora
        if lora is None or lora.token_slots is None or lora.slots is None:
            super().__call__(x, layer, group, outputs, batch)
            return
        g = GROUP_INDEX[group]
        tables = lora.slots
        triton_lora_slots.lora_slots(
            x,
            outputs,
            self.storage[layer],
            lora.token_slots,
            tables.page_tables,
            tables.meta[layer, g],
            tables.scales[layer, g],
            lora.slot_grouping,
            tables.row_bound,
        )

    def __init__(self, storage: torch.Tensor) -> None:
        super().__init__(storage)
        self.packer = SegmentPacker(storage.shape[0], storage.shape[2])

    def prepare(self, lora: LoRABatch) -> TritonSegments:
        """The segments' tables copied to the device here (four copies); the runner's steps take
        ``upload_parts`` instead, so these travel in the step's one upload."""
        parts = self.upload_parts(lora)
        device = self.storage.device
        return parts.build([torch.from_numpy(array).to(device) for array in parts.arrays])

    def upload_parts(self, lora: LoRABatch) -> UploadParts[TritonSegments]:
        bounds, page_tables, meta, scales = (tensor.numpy() for tensor in self.packer.pack(lora))
        max_segment_len = max(end - start for start, end, _ in lora.segments)
        max_rows = meta[:, :, :, 1].max(axis=2).tolist()  # [num_layers][num_groups], on the host

        def build(views: list[torch.Tensor]) -> TritonSegments:
            bounds_view, tables_view, meta_view, scales_view = views
            return TritonSegments(bounds_view, tables_view, meta_view, scales_view.float(), max_segment_len, max_rows)

        return UploadParts([bounds, page_tables, meta, scales.astype(np.float64)], build)

    def apply(
        self,
        x: torch.Tensor,  # [num_tokens, in_features]
        layer: int,
        group: str,
        outputs: tuple[torch.Tensor, ...],  # each [num_tokens, out_features_m], updated in place
        prepared: TritonSegments,
    ) -> None:
        g = GROUP_INDEX[group]
        triton_lora.lora_segments(
            x,
            outputs,
            self.storage[layer],
            prepared.bounds,
            prepared.page_tables,
            prepared.meta[layer, g],
            prepared.scales[layer, g],
            prepared.max_segment_len,
            prepared.max_rows[layer][g],
        )

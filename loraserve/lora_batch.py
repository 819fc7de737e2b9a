"""Per-step LoRA metadata and the model hook that applies adapters from pool pages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.adapter_manager import AdapterManager, GroupWeights
from loraserve.forward_batch import ForwardBatch
from loraserve.kernels.lora import LoRASegment, apply_lora_segments


@dataclass(frozen=True)
class LoRABatch:
    """Contiguous token ranges of the flattened batch, each using one adapter."""

    segments: tuple[tuple[int, int, str], ...]  # (start, end, adapter_id)

    @classmethod
    def from_ranges(cls, ranges: list[tuple[int, int, str | None]]) -> LoRABatch | None:
        """Merge touching ranges of one adapter; drop base-model ranges. None if no adapter."""
        merged: list[tuple[int, int, str]] = []
        for start, end, adapter_id in ranges:
            if adapter_id is None or start == end:
                continue
            if merged and merged[-1][2] == adapter_id and merged[-1][1] == start:
                merged[-1] = (merged[-1][0], end, adapter_id)
            else:
                merged.append((start, end, adapter_id))
        return cls(tuple(merged)) if merged else None

    @property
    def adapter_ids(self) -> set[str]:
        return {adapter_id for _, _, adapter_id in self.segments}


class LoRAApplier:
    """The model's LoRA hook: adds each segment's delta, reading weights from its pages.

    Per forward it resolves each segment's resident adapter once; per layer and group
    it only picks that adapter's views and runs the segment GEMMs.
    """

    def __init__(self, manager: AdapterManager) -> None:
        self.manager = manager
        self._batch: LoRABatch | None = None
        self._segments: list[tuple[int, int, str, list[dict[str, GroupWeights]] | None]] = []

    def __call__(
        self,
        x: torch.Tensor,  # [num_tokens, in_features]
        layer: int,
        group: str,
        outputs: tuple[torch.Tensor, ...],  # each [num_tokens, out_features_m], updated in place
        batch: ForwardBatch,
    ) -> None:
        lora: LoRABatch | None = batch.lora
        if lora is None:
            return
        if lora is not self._batch:
            self._batch = lora
            self._segments = [
                (start, end, adapter_id, self.manager.resident[adapter_id].views)
                for start, end, adapter_id in lora.segments
            ]
        segments: list[LoRASegment] = []
        for start, end, adapter_id, views in self._segments:
            layer_views = views[layer] if views is not None else self.manager.layer_weights(adapter_id, layer)
            weights = layer_views.get(group)
            if weights is not None:
                segments.append(LoRASegment(start, end, weights[0], weights[1]))
        apply_lora_segments(x, outputs, segments)

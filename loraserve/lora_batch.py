"""Per-step LoRA metadata and the model hook that applies adapters from pool pages."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.adapter_manager import AdapterManager
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
    """The model's LoRA hook: adds each segment's delta, reading weights from its pages."""

    def __init__(self, manager: AdapterManager) -> None:
        self.manager = manager

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
        segments: list[LoRASegment] = []
        for start, end, adapter_id in lora.segments:
            weights = self.manager.layer_weights(adapter_id, layer).get(group)
            if weights is not None:
                segments.append(LoRASegment(start, end, weights[0], weights[1]))
        apply_lora_segments(x, outputs, segments)

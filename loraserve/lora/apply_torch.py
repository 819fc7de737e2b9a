"""Per-step LoRA metadata and the model hook that applies adapters from pool pages."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch

from loraserve.forward_batch import ForwardBatch
from loraserve.kernels.lora import LoRASegment, apply_lora_segments
from loraserve.lora.residency import AdapterManager, GroupWeights

Prepared = TypeVar("Prepared")


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


class PerBatchLoRAHook(ABC, Generic[Prepared]):
    """Base of the model's LoRA hooks (``LoRAHook``).

    ``prepare`` builds whatever a step needs from its ``LoRABatch`` once, at the first call of
    the forward; ``apply`` adds the deltas of one layer's input group using it.
    """

    def __init__(self, manager: AdapterManager) -> None:
        self.manager = manager
        self._batch: LoRABatch | None = None
        self._prepared: Prepared | None = None

    @abstractmethod
    def prepare(self, lora: LoRABatch) -> Prepared:
        """What ``apply`` needs for every layer of this step's batch."""

    @abstractmethod
    def apply(
        self,
        x: torch.Tensor,  # [num_tokens, in_features]
        layer: int,
        group: str,
        outputs: tuple[torch.Tensor, ...],  # each [num_tokens, out_features_m], updated in place
        prepared: Prepared,
    ) -> None:
        """Add the LoRA deltas of ``group`` in ``layer`` to ``outputs``."""

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
        if lora is not self._batch or self._prepared is None:
            self._batch, self._prepared = lora, self.prepare(lora)
        self.apply(x, layer, group, outputs, self._prepared)


# Per segment: (start, end, adapter_id, the adapter's per-layer views or None if not contiguous).
TorchSegments = list[tuple[int, int, str, list[dict[str, GroupWeights]] | None]]


class LoRAApplier(PerBatchLoRAHook[TorchSegments]):
    """The torch LoRA hook: adds each segment's delta, reading weights from its pages.

    Per forward it resolves each segment's resident adapter once; per layer and group
    it only picks that adapter's views and runs the segment GEMMs.
    """

    def prepare(self, lora: LoRABatch) -> TorchSegments:
        return [
            (start, end, adapter_id, self.manager.resident[adapter_id].views)
            for start, end, adapter_id in lora.segments
        ]

    def apply(
        self,
        x: torch.Tensor,  # [num_tokens, in_features]
        layer: int,
        group: str,
        outputs: tuple[torch.Tensor, ...],  # each [num_tokens, out_features_m], updated in place
        prepared: TorchSegments,
    ) -> None:
        segments: list[LoRASegment] = []
        for start, end, adapter_id, views in prepared:
            layer_views = views[layer] if views is not None else self.manager.layer_weights(adapter_id, layer)
            weights = layer_views.get(group)
            if weights is not None:
                segments.append(LoRASegment(start, end, weights[0], weights[1]))
        apply_lora_segments(x, outputs, segments)

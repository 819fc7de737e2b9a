"""The model's LoRA hooks: the base class, and the torch one that applies adapters from pool pages.

A hook is built once by the runner over the pool's storage; everything it needs about a step
(segments, each adapter's pages and layout) comes in the step's ``ForwardBatch.lora``. What it
keeps between steps is only derived from that (views of an adapter's pages, keyed by the pages).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

import numpy as np
import torch

from loraserve.forward_batch import ForwardBatch
from loraserve.kernels.lora import LoRASegment, apply_lora_segments
from loraserve.lora.batch import AdapterPages, LoRABatch
from loraserve.lora.weights import GroupWeights, group_weights

Prepared = TypeVar("Prepared")


@dataclass(frozen=True)
class UploadParts(Generic[Prepared]):
    """What a hook needs on the device for one step, to travel in the step's one upload: host
    ``arrays`` (int64, or float64 sent as its bits) and ``build``, which makes the hook's prepared
    data from their device copies (views of the upload, in the arrays' shapes and dtypes)."""

    arrays: list[np.ndarray]
    build: Callable[[list[torch.Tensor]], Prepared]


class PerBatchLoRAHook(ABC, Generic[Prepared]):
    """Base of the model's LoRA hooks (``LoRAHook``).

    ``prepare`` builds whatever a step needs from its ``LoRABatch`` once, at the first call of
    the forward; ``apply`` adds the deltas of one layer's input group using it.
    """

    def __init__(self, storage: torch.Tensor) -> None:
        self.storage = storage  # [num_layers, num_pages, page_elems], the pool's
        self._batch: LoRABatch | None = None
        self._prepared: Prepared | None = None

    @abstractmethod
    def prepare(self, lora: LoRABatch) -> Prepared:
        """What ``apply`` needs for every layer of this step's batch."""

    def upload_parts(self, lora: LoRABatch) -> UploadParts[Prepared] | None:
        """The step's device data as host arrays for the runner's one upload (then the runner puts
        the built data in ``LoRABatch.prepared``); None (the default): ``prepare`` runs in the
        forward, for hooks whose data needs no copy to the device."""
        return None

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
        if lora.prepared is not None:  # built from the step's upload (``upload_parts``)
            self.apply(x, layer, group, outputs, lora.prepared)
            return
        if lora is not self._batch or self._prepared is None:
            self._batch, self._prepared = lora, self.prepare(lora)
        self.apply(x, layer, group, outputs, self._prepared)


# Per segment: (start, end, the adapter's pages, its per-layer views or None if not contiguous).
TorchSegments = list[tuple[int, int, AdapterPages, list[dict[str, GroupWeights]] | None]]
ViewKey = tuple[str, tuple[int, ...]]


class LoRAApplier(PerBatchLoRAHook[TorchSegments]):
    """The torch LoRA hook: adds each segment's delta, reading weights from its pages.

    Per forward it finds each segment's views once (views of an adapter on consecutive pages are
    built at its first step and kept, keyed by adapter and pages); per layer and group it only
    picks that adapter's views and runs the segment GEMMs.
    """

    def __init__(self, storage: torch.Tensor) -> None:
        super().__init__(storage)
        self._views: dict[ViewKey, list[dict[str, GroupWeights]]] = {}

    def _views_of(self, pages: AdapterPages) -> list[dict[str, GroupWeights]] | None:
        if not pages.is_contiguous:
            return None  # gathered per layer at each step (the pages are scattered)
        key = (pages.adapter_id, pages.page_ids)
        views = self._views.get(key)
        if views is None:
            views = [group_weights(self.storage, pages, layer) for layer in range(self.storage.shape[0])]
            self._views[key] = views
        return views

    def prepare(self, lora: LoRABatch) -> TorchSegments:
        if len(self._views) > 2 * len(lora.adapters) + 64:  # forget adapters gone from the pool
            live = {(a.adapter_id, a.page_ids) for a in lora.adapters.values()}
            self._views = {k: v for k, v in self._views.items() if k in live}
        return [
            (start, end, lora.adapters[adapter_id], self._views_of(lora.adapters[adapter_id]))
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
        for start, end, pages, views in prepared:
            layer_views = views[layer] if views is not None else group_weights(self.storage, pages, layer)
            weights = layer_views.get(group)
            if weights is not None:
                segments.append(LoRASegment(start, end, weights[0], weights[1]))
        apply_lora_segments(x, outputs, segments)

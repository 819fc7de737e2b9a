"""Adapter weights in pool pages: writing a load into its pages, and views of them by group.

``storage`` is the pool's tensor ``[num_layers, num_pages, page_elems]`` (owned by the runner);
an adapter's pages, concatenated, hold in every layer the flat buffer that ``lora/layout.py``
describes.
"""

from __future__ import annotations

import torch

from loraserve.kernels.lora import OutputSlice
from loraserve.lora.batch import AdapterLoad, AdapterPages

# Per group of one layer: (stacked A view [rows, in], one OutputSlice or None per module of the group).
GroupWeights = tuple[torch.Tensor, tuple[OutputSlice | None, ...]]


def write_adapter_load(storage: torch.Tensor, load: AdapterLoad) -> None:
    """Write ``load``'s weights into its pages of every layer (what the runner does before a forward)."""
    pages = load.pages
    num_layers, _, page_elems = storage.shape
    page_ids = torch.tensor(pages.page_ids)
    for layer in range(num_layers):
        staging = torch.zeros(len(pages.page_ids) * page_elems, dtype=torch.float32)
        pages.layout.write(load.weights, layer, staging)
        rows = staging.view(len(pages.page_ids), page_elems)
        storage[layer, page_ids] = rows.to(storage.dtype).to(storage.device)


def _layer_buffer(storage: torch.Tensor, pages: AdapterPages, layer: int) -> torch.Tensor:  # [pages * elems]
    if pages.is_contiguous:
        first = pages.page_ids[0]
        return storage[layer, first : first + len(pages.page_ids)].view(-1)
    return storage[layer, torch.tensor(pages.page_ids)].view(-1)  # a gathered copy


def group_weights(storage: torch.Tensor, pages: AdapterPages, layer: int) -> dict[str, GroupWeights]:
    """Per group, the adapter's shrink and expand weights in ``layer``: views into the pool when
    its pages are consecutive, else a gathered copy."""
    buffer = _layer_buffer(storage, pages, layer)
    views: dict[str, GroupWeights] = {}
    for group, slot in pages.layout.layers[layer].items():
        a = buffer[slot.a_offset : slot.a_offset + slot.num_rows * slot.in_features]
        outputs = tuple(
            None
            if m is None
            else OutputSlice(
                m.column,
                m.rank,
                buffer[m.b_offset : m.b_offset + m.rank * m.out_features].view(m.rank, m.out_features),
                m.scale,
            )
            for m in slot.modules
        )
        views[group] = (a.view(slot.num_rows, slot.in_features), outputs)
    return views

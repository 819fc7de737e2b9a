"""Adapter weights in pool pages: writing a load into its pages, and views of them by group.

``storage`` is the pool's tensor ``[num_layers, num_pages, page_elems]`` (owned by the runner);
an adapter's pages, concatenated, hold in every layer the flat buffer that ``lora/layout.py``
describes.
"""

from __future__ import annotations

import torch

from loraserve.host_copies import host_buffer, upload
from loraserve.kernels.lora import OutputSlice
from loraserve.lora.batch import AdapterLoad, AdapterPages

# Per group of one layer: (stacked A view [rows, in], one OutputSlice or None per module of the group).
GroupWeights = tuple[torch.Tensor, tuple[OutputSlice | None, ...]]


def write_adapter_load(storage: torch.Tensor, load: AdapterLoad) -> None:
    """Write ``load``'s weights into its pages of every layer (what the runner does before a forward),
    cast once to the pool's dtype. In host memory consecutive pages are written in place; otherwise
    each layer is built in a host buffer and copied into its pages, on CUDA without waiting for the
    device (``host_copies.py``)."""
    pages = load.pages
    num_layers, _, page_elems = storage.shape
    count = len(pages.page_ids)
    first = pages.page_ids[0]
    in_place = pages.is_contiguous and storage.device.type == "cpu"
    ids = None if pages.is_contiguous else upload(torch.tensor(pages.page_ids), storage.device)  # [count]
    for layer in range(num_layers):
        if in_place:
            buffer = storage[layer, first : first + count].view(-1)  # [count * page_elems]
            buffer.zero_()
        else:
            buffer = host_buffer((count * page_elems,), storage.dtype, storage.device)
        pages.layout.write(load.weights, layer, buffer)
        if in_place:
            continue
        rows = upload(buffer.view(count, page_elems), storage.device)  # [count, page_elems]
        if ids is None:
            storage[layer, first : first + count].copy_(rows)
        else:
            storage[layer].index_copy_(0, ids, rows)


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

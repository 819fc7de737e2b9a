"""The pool's memory: one device tensor of pages, its host swap space, and the copies between
pages that a step makes before its forward.

``storage`` is ``[num_layers, num_pages, page_elems]``: page ``p`` of layer ``l`` holds, for a KV
block, ``[2, block_size, num_kv_heads, head_dim]`` (K then V), and for an adapter, a slice of its
flattened weights (``lora/layout.py``). ``swap`` is the same on the host, for KV blocks swapped
out. The runner owns this object; the scheduler's batch says which pages to copy or fill.
"""

from __future__ import annotations

import torch

from loraserve.host_copies import upload
from loraserve.lora.weights import write_adapter_load
from loraserve.page_layout import PageLayout
from loraserve.scheduled_batch import ScheduledBatch


class PoolStorage:
    def __init__(
        self, layout: PageLayout, num_pages: int, num_swap_pages: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        self.device = device
        self.storage = torch.zeros(layout.num_layers, num_pages, layout.page_elems, dtype=dtype, device=device)
        self.swap = torch.zeros(
            layout.num_layers, num_swap_pages, layout.page_elems, dtype=dtype, pin_memory=device.type == "cuda"
        )
        kv_shape = (num_pages, 2, layout.block_size, layout.num_kv_heads, layout.head_dim)
        # Per layer, the pool's pages seen as KV blocks: [num_pages, 2, block_size, kv_heads, head_dim].
        self.kv_caches = [self.storage[layer].view(kv_shape) for layer in range(layout.num_layers)]

    def copy_pages(self, batch: ScheduledBatch) -> None:
        """Swap-out, swap-in, copy-on-write copies and adapter loads, in that order. Each is one copy
        over every layer; only the swap-out makes the host wait for the device (it reads the pages)."""
        if batch.swap_out:
            src, dst = _ids(batch.swap_out, 0), _ids(batch.swap_out, 1)
            self.swap[:, dst] = self.storage[:, upload(src, self.device)].to("cpu")
        if batch.swap_in:
            src, dst = _ids(batch.swap_in, 0), _ids(batch.swap_in, 1)
            self.storage.index_copy_(1, upload(dst, self.device), upload(self.swap[:, src], self.device))
        if batch.copy_pages:
            src, dst = (upload(_ids(batch.copy_pages, i), self.device) for i in (0, 1))
            self.storage.index_copy_(1, dst, self.storage[:, src])
        for load in batch.adapter_loads:
            write_adapter_load(self.storage, load)


def _ids(pairs: list[tuple[int, int]], side: int) -> torch.Tensor:  # [len(pairs)] int64, on the host
    return torch.tensor([pair[side] for pair in pairs], dtype=torch.long)

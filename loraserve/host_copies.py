"""Host-to-device copies that do not make the host wait for the device's queued work.

A copy from pageable host memory to a CUDA device is synchronous: PyTorch waits for its stream,
and so for every kernel queued before the copy. With async scheduling one step is in flight
while the next is launched, so such a copy would make the host wait for that step (an adapter
load, a slot-table row, a swap-in). ``upload`` copies from page-locked memory without blocking;
PyTorch's page-locked allocator keeps the host block until the copy has run, so the caller may
drop it at once. On other devices these are plain copies.
"""

from __future__ import annotations

import torch


def host_buffer(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zeroed host tensor to build data in for ``device`` (page-locked when that is CUDA)."""
    return torch.zeros(shape, dtype=dtype, pin_memory=device.type == "cuda")


def upload(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``host`` on ``device``; on CUDA queued on the current stream without the host waiting."""
    if device.type != "cuda":
        return host.to(device)
    if not host.is_pinned():
        host = host.pin_memory()
    return host.to(device, non_blocking=True)

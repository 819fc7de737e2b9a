"""KV-cache manager: per-sequence block tables over the page pool.

A sequence's block ``j`` holds the KV of its tokens ``j*block_size ..
(j+1)*block_size-1`` in page ``seq.block_ids[j]``. Blocks are allocated one at a
time, only when the tokens scheduled for a step need them.
"""

from __future__ import annotations

from loraserve.page_pool import PageKind, PagePool
from loraserve.sequence import Sequence


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Grows and frees block tables; swaps them to a host pool and back."""

    def __init__(
        self,
        pool: PagePool,
        block_size: int,
        num_watermark_pages: int = 0,
        host_pool: PagePool | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.num_watermark_pages = num_watermark_pages
        self.host_pool = host_pool

    def num_pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Blocks to add so the cache can hold ``num_computed + num_new_tokens`` tokens."""
        num_blocks = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, num_blocks - len(seq.block_ids))

    def can_admit(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Admission of a waiting sequence keeps the watermark of pages free."""
        needed = self.num_pages_needed(seq, num_new_tokens)
        return self.pool.can_allocate(needed, reserve=self.num_watermark_pages)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> bool:
        """Append the blocks the next ``num_new_tokens`` need; False if the pool is short."""
        needed = self.num_pages_needed(seq, num_new_tokens)
        if not self.pool.can_allocate(needed):
            return False
        if needed:
            seq.block_ids.extend(self.pool.allocate(needed, PageKind.KV))
        return True

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks (shared blocks stay for their other owners)."""
        self.pool.release(reversed(seq.block_ids))
        seq.block_ids = []

    # ---- swapping -------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return self.host_pool is not None and self.host_pool.can_allocate(len(seq.block_ids))

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the block table to host pages; return ``(device_page, host_page)`` copies."""
        assert self.host_pool is not None
        host_page_ids = self.host_pool.allocate(len(seq.block_ids))
        mapping = list(zip(seq.block_ids, host_page_ids, strict=True))
        self.pool.release(seq.block_ids)
        seq.block_ids = host_page_ids
        return mapping

    def can_swap_in(self, seq: Sequence) -> bool:
        return self.pool.can_allocate(len(seq.block_ids), reserve=self.num_watermark_pages)

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move a swapped block table back; return ``(host_page, device_page)`` copies."""
        assert self.host_pool is not None
        device_page_ids = self.pool.allocate(len(seq.block_ids), PageKind.KV)
        mapping = list(zip(seq.block_ids, device_page_ids, strict=True))
        self.host_pool.release(seq.block_ids)
        seq.block_ids = device_page_ids
        return mapping

    def free_swapped(self, seq: Sequence) -> None:
        assert self.host_pool is not None
        self.host_pool.release(seq.block_ids)
        seq.block_ids = []

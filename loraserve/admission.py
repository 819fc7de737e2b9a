"""What a sequence needs from the pool to run: its KV pages and its adapter's pages.

In the unified pool (the design's default) an adapter's pages come out of the pages KV blocks
use, so admission counts both together against the same free pages and watermark. With a fixed
adapter region (``adapter_region="fixed"``, an ablation) the adapter needs a free slot of that
region instead, and its pages never take KV's. The scheduler decides who runs; this object
answers whether a sequence fits and pins or unpins its adapter. The KV cache manager and the
adapter manager keep their own state.
"""

from __future__ import annotations

import dataclasses

from loraserve.kv_cache_manager import KVCacheManager
from loraserve.lora.residency import AdapterManager
from loraserve.sampling_params import SamplingParams
from loraserve.sequence import Sequence


class PoolAdmission:
    def __init__(self, kv_manager: KVCacheManager, adapters: AdapterManager | None) -> None:
        self.kv_manager = kv_manager
        self.adapters = adapters
        self.unified = adapters is None or adapters.pool is kv_manager.pool  # adapters take KV's pages
        pool = kv_manager.pool
        # The most tokens one sequence's KV can take, alone, above the watermark.
        self.max_seq_tokens = (pool.num_pages - kv_manager.num_watermark_pages) * kv_manager.block_size

    def fit_error(self, num_prompt_tokens: int, max_tokens: int, adapter_id: str | None) -> str | None:
        """Why a request of this size cannot run even alone (None if it can)."""
        adapter_pages = self._adapter_pages(adapter_id)
        if num_prompt_tokens + max_tokens + adapter_pages * self.kv_manager.block_size <= self.max_seq_tokens:
            return None
        return (
            f"prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) plus the adapter's "
            f"{adapter_pages} pages needs more pages than the pool holds ({self.max_seq_tokens} tokens); "
            "raise num_pages"
        )

    def fitted(
        self, params: SamplingParams, num_prompt_tokens: int, adapter_id: str | None
    ) -> tuple[SamplingParams, str | None]:
        """The parameters a request runs with, or why it cannot run even alone: ``max_tokens``
        lowered to what the pool holds with the prompt and the adapter's pages where the request
        allows it (``lower_max_tokens_to_pool``), else unchanged."""
        if params.lower_max_tokens_to_pool:
            room = self.max_seq_tokens - self._adapter_pages(adapter_id) * self.kv_manager.block_size
            room -= num_prompt_tokens
            if 1 <= room < params.max_tokens:
                if params.min_tokens > room:
                    return params, (
                        f"min_tokens ({params.min_tokens}) is more than the pool holds after the prompt "
                        f"({num_prompt_tokens} tokens) and the adapter's pages: {room} tokens; raise num_pages"
                    )
                return dataclasses.replace(params, max_tokens=room), None
        return params, self.fit_error(num_prompt_tokens, params.max_tokens, adapter_id)

    def _adapter_pages(self, adapter_id: str | None) -> int:
        if self.adapters is not None and adapter_id is not None and self.unified:
            return self.adapters.num_pages(adapter_id)  # a fixed region's slots take no KV pages
        return 0

    def can_admit(self, seq: Sequence, num_new: int) -> bool:
        """Whether a waiting sequence's next ``num_new`` tokens and its adapter fit above the watermark."""
        if self.adapters is None or seq.adapter_id is None:
            return self.kv_manager.can_admit(seq, num_new)
        if self.unified:
            return self.kv_manager.can_admit(seq, num_new, self.adapters.num_pages_to_pin(seq.adapter_id))
        return self.kv_manager.can_admit(seq, num_new) and self.adapters.can_pin(seq.adapter_id)

    def can_swap_in(self, seq: Sequence, num_new: int) -> bool:
        """Whether a swapped sequence's blocks, its next ``num_new`` tokens and its adapter fit."""
        pages = self.kv_manager.num_pages_to_swap_in(seq, num_new)
        if self.adapters is not None and seq.adapter_id is not None:
            if self.unified:
                pages += self.adapters.num_pages_to_pin(seq.adapter_id)
            elif not self.adapters.can_pin(seq.adapter_id):
                return False
        return self.kv_manager.pool.can_allocate(pages, reserve=self.kv_manager.num_watermark_pages)

    def acquire(self, seq: Sequence) -> bool:
        """Pin the sequence's adapter in the pool (loading it); False if it does not fit."""
        return self.adapters is None or seq.adapter_id is None or self.adapters.acquire(seq.adapter_id)

    def release(self, seq: Sequence) -> None:
        """Unpin the sequence's adapter (it stays resident, as a cache, until its pages are needed)."""
        if self.adapters is not None and seq.adapter_id is not None:
            self.adapters.release(seq.adapter_id)

    def count_live(self, seq: Sequence, samples: int = 1) -> None:
        """Count ``samples`` unfinished sequences on the sequence's adapter (kept in host memory meanwhile)."""
        if self.adapters is not None and seq.adapter_id is not None:
            for _ in range(samples):
                self.adapters.add_live_seq(seq.adapter_id)

    def drop_live(self, seq: Sequence) -> None:
        if self.adapters is not None and seq.adapter_id is not None:
            self.adapters.drop_live_seq(seq.adapter_id)

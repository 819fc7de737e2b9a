"""KV-cache manager: per-sequence block tables over the page pool, prefix caching, copy-on-write.

A sequence's block ``j`` holds the KV of its tokens ``j*block_size ..
(j+1)*block_size-1`` in page ``seq.block_ids[j]``. Blocks are allocated one at a
time, only when the tokens scheduled for a step need them.

Prefix caching: every block that fills up is registered under its content hash
(prefix_cache.py). A new sequence starts from the longest run of its leading full
blocks already in the pool, sharing those pages (refcount + 1). When the last
reference to a registered page goes, the page stays in the pool's LRU of idle
contents (kind ``prefix_cache``), the same LRU as idle adapters, and is reused on a
hit or reclaimed oldest-first. Registered pages are never written again.

Copy-on-write: a sequence about to write into a page that is shared (forked
samples of one prompt) or registered gets a private copy of that one page first;
the copy is returned to the scheduler, which hands it to the runner.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable

from loraserve.page_pool import PageKind, PagePool
from loraserve.prefix_cache import PrefixCacheIndex, extend_block_hashes
from loraserve.sequence import Sequence, SequenceStatus


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Grows, shares and frees block tables; swaps them to a host pool and back."""

    def __init__(
        self,
        pool: PagePool,
        block_size: int,
        num_watermark_pages: int = 0,
        host_pool: PagePool | None = None,
        enable_prefix_caching: bool = False,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.num_watermark_pages = num_watermark_pages
        self.host_pool = host_pool
        self.prefix_cache = PrefixCacheIndex() if enable_prefix_caching else None

    def num_pages_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Pages to add so the cache can hold ``num_computed + num_new_tokens`` tokens."""
        num_blocks = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(0, num_blocks - len(seq.block_ids)) + int(self._needs_copy(seq))

    def num_pages_to_swap_in(self, seq: Sequence, num_new_tokens: int) -> int:
        """Device pages a swapped sequence takes back with room for ``num_new_tokens``: its blocks
        come back on fresh private pages (so no copy-on-write), and its ``block_ids`` are host
        page ids, never looked up in this pool."""
        num_blocks = cdiv(seq.num_computed_tokens + num_new_tokens, self.block_size)
        return max(num_blocks, len(seq.block_ids))

    def can_admit(self, seq: Sequence, num_new_tokens: int, num_other_pages: int = 0) -> bool:
        """Admission of a waiting sequence keeps the watermark of pages free.

        ``num_other_pages``: pages the admission also takes (its adapter's).
        """
        needed = self.num_pages_needed(seq, num_new_tokens) + num_other_pages
        return self.pool.can_allocate(needed, reserve=self.num_watermark_pages)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        """Make room for the next ``num_new_tokens``; None (nothing changed) if the pool is short.

        Returns the ``(source, destination)`` page copies that must happen first.
        """
        computed = seq.num_computed_tokens
        offset = computed % self.block_size
        # The common decode step, checked first: the tokens fit in the partly filled last block,
        # which needs no copy unless a fork shares it or it is registered (only full blocks are:
        # a fork's recomputed last prompt token is written into a full one).
        if (
            offset
            and offset + num_new_tokens <= self.block_size
            and self.pool.ref_count(page_id := seq.block_ids[computed // self.block_size]) == 1
            and not self._is_registered(page_id)
        ):
            return []
        num_blocks = cdiv(computed + num_new_tokens, self.block_size)
        needs_copy = self._needs_copy(seq)
        needed = max(0, num_blocks - len(seq.block_ids)) + int(needs_copy)
        if needed == 0:
            return []
        if not self.pool.can_allocate(needed):
            return None
        copies: list[tuple[int, int]] = []
        if needs_copy:
            index = seq.num_computed_tokens // self.block_size
            source = seq.block_ids[index]
            (destination,) = self.pool.allocate(1, PageKind.KV)
            seq.block_ids[index] = destination
            seq.block_table_epoch += 1
            seq.num_registered_blocks = min(seq.num_registered_blocks, index)
            self._release([source])
            copies.append((source, destination))
            needed -= 1
        if needed:
            seq.block_ids.extend(self.pool.allocate(needed, PageKind.KV))
        return copies

    def _needs_copy(self, seq: Sequence) -> bool:
        """Whether the first page to be written is shared or registered (so immutable)."""
        index = seq.num_computed_tokens // self.block_size
        if index >= len(seq.block_ids):
            return False
        page_id = seq.block_ids[index]
        return self.pool.ref_count(page_id) > 1 or self._is_registered(page_id)

    def _is_registered(self, page_id: int) -> bool:
        return self.prefix_cache is not None and self.prefix_cache.hash_of(page_id) is not None

    def free(self, seq: Sequence) -> None:
        """Release the sequence's blocks, last block first (so it is evicted first)."""
        self._release(reversed(seq.block_ids))
        _set_block_ids(seq, [])

    def _release(self, page_ids: Iterable[int]) -> None:
        for page_id in self.pool.decref(page_ids):
            block_hash = self.prefix_cache.hash_of(page_id) if self.prefix_cache else None
            if block_hash is None:
                self.pool.free([page_id])
            else:
                self.pool.add_evictable(
                    ("kv", block_hash), [page_id], PageKind.PREFIX_CACHE, functools.partial(self._forget, page_id)
                )

    def _forget(self, page_id: int) -> None:
        assert self.prefix_cache is not None
        self.prefix_cache.remove_page(page_id)

    # ---- prefix caching -------------------------------------------------------------
    def match_prefix(self, seq: Sequence) -> int:
        """Start a fresh sequence from its cached leading blocks; return the tokens reused.

        The last prompt token is always computed (its logits are needed), so at most
        ``(num_tokens - 1) // block_size`` blocks are reused; a request for prompt logprobs
        reuses none.
        """
        cache = self._cache_for(seq)
        if cache is None:
            return 0
        assert not seq.block_ids and seq.num_computed_tokens == 0, "match_prefix needs a fresh sequence"
        max_blocks = (seq.num_tokens - 1) // self.block_size
        for block_hash in extend_block_hashes(seq, max_blocks, self.block_size):
            page_id = cache.lookup(block_hash)
            if page_id is None:
                break
            if self.pool.take_evictable(("kv", block_hash)) is None:
                self.pool.incref([page_id])
            seq.block_ids.append(page_id)
        num_hit_tokens = len(seq.block_ids) * self.block_size
        seq.num_computed_tokens = num_hit_tokens
        # Reported and counted: the prompt's hit when first admitted, not a recompute's (vLLM's
        # prefix_cache_queries/hits leave preempted requests' lookups out too).
        if not seq.num_preemptions:
            seq.num_cached_tokens = num_hit_tokens
            cache.num_queried_tokens += seq.num_tokens
            cache.num_hit_tokens += num_hit_tokens
        return num_hit_tokens

    def _cache_for(self, seq: Sequence) -> PrefixCacheIndex | None:
        # None for prompt logprobs: they need the logits of every prompt token, so nothing is skipped.
        return None if seq.params.prompt_logprobs is not None else self.prefix_cache

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; False (nothing changed) while a sequence holds KV pages.

        Idle cached pages go back to the free list, so later requests recompute their prefixes.
        """
        if self.prefix_cache is None:
            return True
        if self.pool.num_pages_by_kind()[PageKind.KV]:
            return False
        for key in self.pool.evictable_keys(PageKind.PREFIX_CACHE):
            self.pool.evict(key)
        return True

    def unmatch_prefix(self, seq: Sequence) -> None:
        """Undo ``match_prefix`` for a sequence that could not be admitted after all."""
        cache = self._cache_for(seq)
        if cache is None:
            return  # nothing was matched, nor counted
        if not seq.num_preemptions:  # only a first admission's lookup was counted
            cache.num_hit_tokens -= seq.num_computed_tokens  # what match_prefix reused
            cache.num_queried_tokens -= seq.num_tokens
            seq.num_cached_tokens = 0
        self.free(seq)
        seq.num_computed_tokens = 0

    def cache_full_blocks(self, seqs: Iterable[Sequence]) -> None:
        """Register the blocks each of ``seqs`` has filled since the last call (one call a step):
        computed, and every token known on the host (a step in flight has not reported its own)."""
        if self.prefix_cache is None:
            return
        block_size = self.block_size
        for seq in seqs:
            if seq.status is SequenceStatus.SWAPPED:  # swapped out while its step was in flight: host page ids
                continue
            num_full = min(min(seq.num_computed_tokens, len(seq.token_ids)) // block_size, len(seq.block_ids))
            if num_full > seq.num_registered_blocks:
                self._register(seq, num_full)

    def _register(self, seq: Sequence, num_full: int) -> None:
        assert self.prefix_cache is not None
        hashes = extend_block_hashes(seq, num_full, self.block_size)
        for index in range(seq.num_registered_blocks, num_full):
            page_id, block_hash = seq.block_ids[index], hashes[index]
            if self.prefix_cache.hash_of(page_id) is None and self.prefix_cache.lookup(block_hash) is None:
                self.prefix_cache.insert(block_hash, page_id)
        seq.num_registered_blocks = num_full

    # ---- forking ----------------------------------------------------------------------
    def fork(self, parent: Sequence, child: Sequence) -> None:
        """Give ``child`` the blocks of the parent's prompt, shared (copy-on-write); not blocks
        reserved past it (``ReservingKVCacheManager``), which the child reserves for itself."""
        shared = parent.block_ids[: cdiv(parent.num_prompt_tokens, self.block_size)]
        self.pool.incref(shared)
        _set_block_ids(child, list(shared))
        child.block_hashes = list(parent.block_hashes)

    # ---- swapping -------------------------------------------------------------------
    def can_swap_out(self, seq: Sequence) -> bool:
        return self.host_pool is not None and self.host_pool.can_allocate(len(seq.block_ids))

    def swap_out(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move the block table to host pages; return ``(device_page, host_page)`` copies."""
        assert self.host_pool is not None
        host_page_ids = self.host_pool.allocate(len(seq.block_ids))
        mapping = list(zip(seq.block_ids, host_page_ids, strict=True))
        self._release(seq.block_ids)
        _set_block_ids(seq, host_page_ids)
        return mapping

    def can_swap_in(self, seq: Sequence) -> bool:
        return self.pool.can_allocate(len(seq.block_ids), reserve=self.num_watermark_pages)

    def swap_in(self, seq: Sequence) -> list[tuple[int, int]]:
        """Move a swapped block table back; return ``(host_page, device_page)`` copies."""
        assert self.host_pool is not None
        device_page_ids = self.pool.allocate(len(seq.block_ids), PageKind.KV)
        mapping = list(zip(seq.block_ids, device_page_ids, strict=True))
        self.host_pool.release(seq.block_ids)
        _set_block_ids(seq, device_page_ids)
        return mapping

    def free_swapped(self, seq: Sequence) -> None:
        assert self.host_pool is not None
        self.host_pool.release(seq.block_ids)
        _set_block_ids(seq, [])


def _set_block_ids(seq: Sequence, block_ids: list[int]) -> None:
    """Give the sequence a new block table (none of whose blocks it has registered yet)."""
    seq.block_ids = block_ids
    seq.block_table_epoch += 1
    seq.num_registered_blocks = 0


class ReservingKVCacheManager(KVCacheManager):
    """KV reserved at admission (``kv_allocation="reserve"``): a sequence is admitted only when
    ``reserve_tokens(seq)`` tokens fit, and takes all their pages in its first step; later steps
    find their slots already there. The paging it replaces is what the default measures against."""

    def __init__(
        self,
        pool: PagePool,
        block_size: int,
        reserve_tokens: Callable[[Sequence], int],
        num_watermark_pages: int = 0,
        host_pool: PagePool | None = None,
        enable_prefix_caching: bool = False,
    ) -> None:
        super().__init__(pool, block_size, num_watermark_pages, host_pool, enable_prefix_caching)
        self.reserve_tokens = reserve_tokens

    def _ahead(self, seq: Sequence, num_new_tokens: int) -> int:
        return max(num_new_tokens, self.reserve_tokens(seq) - seq.num_computed_tokens)

    def can_admit(self, seq: Sequence, num_new_tokens: int, num_other_pages: int = 0) -> bool:
        return super().can_admit(seq, self._ahead(seq, num_new_tokens), num_other_pages)

    def allocate_slots(self, seq: Sequence, num_new_tokens: int) -> list[tuple[int, int]] | None:
        return super().allocate_slots(seq, self._ahead(seq, num_new_tokens))


def tokens_at_most(seq: Sequence) -> int:
    """The most tokens a sequence's KV can hold: its prompt plus ``max_tokens`` (the last sampled
    token is never written, so one fewer)."""
    return seq.num_prompt_tokens + seq.params.max_tokens - 1

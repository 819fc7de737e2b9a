"""Iteration-level scheduler: which sequences run this step, and how many tokens each.

Policy, in order, each step (a token budget of ``max_num_batched_tokens``):

1. Running sequences in admission order each get their uncomputed tokens (1 when
   decoding, a chunk of the prompt when prefilling). When the pool cannot hold them,
   the most recently admitted running sequence is preempted (recompute: its blocks
   are freed and it goes back to the front of the waiting queue; swap: its blocks
   move to host pages) until the request fits.
2. Swapped sequences come back, oldest first, while pages allow (with the watermark).
3. Waiting sequences are admitted first-come-first-served while there is budget,
   a free sequence slot and enough pages above the watermark; admission stops at
   the first that does not fit (no overtaking). Nothing is admitted in a step that
   preempted, nor while swapped sequences wait to come back (so they never starve).
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from loraserve.kv_cache_manager import KVCacheManager
from loraserve.lora.batch import AdapterLoad, AdapterPages
from loraserve.lora.residency import AdapterManager
from loraserve.sequence import FinishReason, Sequence, SequenceStatus

logger = logging.getLogger(__name__)


@dataclass
class ScheduledBatch:
    """What the runner executes in one step; the only message from scheduler to runner.

    Before the forward the runner applies, in order, the swaps and copies of KV pages and the
    adapter loads (weights into freshly allocated pages); ``adapters`` says where the adapter of
    every scheduled sequence sits, as each sequence's ``block_ids`` say where its KV is.
    """

    seqs: list[Sequence]
    num_new_tokens: list[int]
    swap_out: list[tuple[int, int]] = field(default_factory=list)
    swap_in: list[tuple[int, int]] = field(default_factory=list)
    copy_pages: list[tuple[int, int]] = field(default_factory=list)
    adapter_loads: list[AdapterLoad] = field(default_factory=list)
    adapters: dict[str, AdapterPages] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.swap_out and not self.swap_in

    def samples(self, index: int) -> bool:
        """Whether sequence ``index`` reaches its last token this step (so it samples)."""
        seq = self.seqs[index]
        return seq.num_computed_tokens + self.num_new_tokens[index] == seq.num_tokens


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "recompute",
        adapters: AdapterManager | None = None,
    ) -> None:
        self.kv_manager = kv_manager
        self.adapters = adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped)

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def add_fork(self, parent: Sequence, child: Sequence) -> None:
        """Queue a sample forked from ``parent`` first in line, sharing its blocks.

        The child recomputes the parent's last prompt token (writing into a private
        copy of that block) so that it samples its own first token.
        """
        self.kv_manager.fork(parent, child)
        child.num_computed_tokens = parent.num_prompt_tokens - 1
        child.status = SequenceStatus.WAITING
        self.waiting.appendleft(child)

    def schedule(self) -> ScheduledBatch:
        batch = ScheduledBatch(seqs=[], num_new_tokens=[])
        budget = self.max_num_batched_tokens
        preempted = self._schedule_running(batch, budget)
        budget -= batch.num_tokens
        if not preempted:
            budget = self._schedule_swapped(batch, budget)
            if not self.swapped:
                self._schedule_waiting(batch, budget)
        if self.adapters is not None:
            batch.adapter_loads = self.adapters.take_loads()
            for seq in batch.seqs:
                if seq.adapter_id is not None and seq.adapter_id not in batch.adapters:
                    batch.adapters[seq.adapter_id] = self.adapters.pages(seq.adapter_id)
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> bool:
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            num_new = min(seq.num_uncomputed_tokens, budget)
            while (copies := self.kv_manager.allocate_slots(seq, num_new)) is None:
                victim = self.running.pop()
                self._preempt(victim, batch)
                preempted = True
                if victim is seq:
                    break
            else:
                batch.copy_pages.extend(copies)
                batch.seqs.append(seq)
                batch.num_new_tokens.append(num_new)
                budget -= num_new
                index += 1
        return preempted

    def _schedule_swapped(self, batch: ScheduledBatch, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            num_new = min(seq.num_uncomputed_tokens, budget)
            pages_after_swap_in = len(seq.block_ids) + self.kv_manager.num_pages_needed(seq, num_new)
            pages_after_swap_in += self._adapter_pages_to_pin(seq)
            if not self.kv_manager.pool.can_allocate(pages_after_swap_in, reserve=self.kv_manager.num_watermark_pages):
                break
            acquired = self._acquire_adapter(seq)
            assert acquired, "swap-in checked the adapter's pages"
            self.swapped.popleft()
            batch.swap_in.extend(self.kv_manager.swap_in(seq))
            batch.copy_pages.extend(self.kv_manager.allocate_slots(seq, num_new) or [])
            self._start_running(seq, num_new, batch)
            budget -= num_new
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            fresh = not seq.block_ids and seq.num_computed_tokens == 0
            if fresh:
                self.kv_manager.match_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            # Adapter and KV pages are checked together, so a request that cannot start
            # loads (and evicts) nothing.
            if not self.kv_manager.can_admit(seq, num_new, self._adapter_pages_to_pin(seq)):
                if fresh:
                    self.kv_manager.unmatch_prefix(seq)
                break
            acquired = self._acquire_adapter(seq)
            assert acquired, "admission checked the adapter's pages"
            self.waiting.popleft()
            batch.copy_pages.extend(self.kv_manager.allocate_slots(seq, num_new) or [])
            self._start_running(seq, num_new, batch)
            budget -= num_new

    def _start_running(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> None:
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)

    def _adapter_pages_to_pin(self, seq: Sequence) -> int:
        if self.adapters is None or seq.adapter_id is None:
            return 0
        return self.adapters.num_pages_to_pin(seq.adapter_id)

    def _acquire_adapter(self, seq: Sequence) -> bool:
        """Pin the sequence's adapter in the pool (loading it); False if it does not fit."""
        return self.adapters is None or seq.adapter_id is None or self.adapters.acquire(seq.adapter_id)

    def _release_adapter(self, seq: Sequence) -> None:
        if self.adapters is not None and seq.adapter_id is not None:
            self.adapters.release(seq.adapter_id)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self._release_adapter(seq)
        self.num_preemptions += 1
        seq.num_preemptions += 1
        if self.preemption_mode == "swap" and self.kv_manager.can_swap_out(seq):
            batch.swap_out.extend(self.kv_manager.swap_out(seq))
            seq.status = SequenceStatus.SWAPPED
            self.swapped.append(seq)
            logger.debug("preempted seq %d by swapping", seq.seq_id)
            return
        self.kv_manager.free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        logger.debug("preempted seq %d for recomputation", seq.seq_id)

    def update(self, batch: ScheduledBatch) -> None:
        """Account the tokens the runner computed this step."""
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
            seq.num_computed_tokens += num_new
            self.kv_manager.cache_full_blocks(seq)

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """End a sequence wherever it is and free its pages."""
        if seq.is_finished:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.kv_manager.free(seq)
            self._release_adapter(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.kv_manager.free(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.kv_manager.free_swapped(seq)
        if self.adapters is not None and seq.adapter_id is not None:
            self.adapters.drop_live_seq(seq.adapter_id)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

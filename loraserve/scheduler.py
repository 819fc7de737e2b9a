"""Iteration-level scheduler: which sequences run this step, and how many tokens each.

Policy, in order, each step (a token budget of ``max_num_batched_tokens``):

0. Requests waiting for their adapter's files (``WAITING_FOR_ADAPTER``, read on the adapter
   manager's loader thread) join the waiting queue once the files are parsed, or end with
   ``abort`` (in ``ScheduledBatch.aborted``) if they cannot be loaded or cannot fit the pool.
1. Running sequences in admission order each get their uncomputed tokens (1 when
   decoding, a chunk of the prompt when prefilling). When the pool cannot hold them,
   the most recently admitted running sequence is preempted (recompute: its blocks
   are freed and it goes back to the front of the waiting queue; swap: its blocks
   move to host pages) until the request fits.
2. Swapped sequences come back, oldest first, while pages allow (with the watermark).
3. Waiting sequences are admitted first-come-first-served while there is budget,
   a free sequence slot and enough pages above the watermark (``admission.py``: KV and
   adapter pages counted together in the unified pool); admission stops at
   the first that does not fit (no overtaking). Nothing is admitted in a step that
   preempted, nor while swapped sequences wait to come back (so they never starve).
4. If nothing runs then, the forked samples waiting with their prompt's pages give them back
   (they recompute the prompt): nothing else could free the pages the head of the line needs.

After the runner's step, ``update_from_output`` is the one place where a sequence's state
changes: it accounts the computed tokens, appends the sampled ones, forks the other samples of
an ``n > 1`` request off the first once its prompt is computed, applies the stop conditions and
finishes (frees the pages and unpins the adapter of) the sequences that end.

With async scheduling (docs/design.md) ``launched`` accounts a step when it is launched, its
sampled tokens pending, and ``update_from_output(..., launched=True)`` appends them later.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from collections.abc import Sequence as Seq

from loraserve.adapters import AdapterError
from loraserve.admission import PoolAdmission
from loraserve.kv_cache_manager import KVCacheManager
from loraserve.lora.residency import AdapterManager
from loraserve.outputs import REQUEST_TOO_LARGE
from loraserve.scheduled_batch import ScheduledBatch
from loraserve.sequence import FinishReason, Sequence, SequenceStatus
from loraserve.stop_checker import Stop, never_stops_early

StopCheck = Callable[[Sequence, int], Stop | None]

logger = logging.getLogger(__name__)


class Scheduler:
    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        preemption_mode: str = "recompute",
        adapters: AdapterManager | None = None,
        stop_checker: StopCheck = never_stops_early,
    ) -> None:
        self.kv_manager = kv_manager
        self.adapters = adapters
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.preemption_mode = preemption_mode
        self.stop_checker = stop_checker
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.swapped: deque[Sequence] = deque()
        # First samples of requests whose adapter's files are on their way (WAITING_FOR_ADAPTER).
        self.loading: deque[Sequence] = deque()
        # The other samples of an n > 1 request, by the first's seq_id: forked once its prompt is computed.
        self._forks: dict[int, list[Sequence]] = {}
        self._released: list[int] = []  # seq ids finished or preempted since the last schedule
        self.num_preemptions = 0
        self.admission = PoolAdmission(kv_manager, adapters)  # whether a sequence fits; pins its adapter

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.swapped) + len(self.loading)

    @property
    def num_waiting(self) -> int:
        """Requests not started yet, those waiting for their adapter's files included."""
        return len(self.waiting) + len(self.loading)

    def add(self, seq: Sequence, forks: Seq[Sequence] = ()) -> None:
        """Queue a request's first sample; ``forks`` (its other samples) are forked from it once its
        prompt is computed. A sequence naming an adapter not resolved yet waits for its files."""
        if forks:
            self._forks[seq.seq_id] = list(forks)
        if seq.adapter_name is not None and seq.adapter_id is None:
            seq.status = SequenceStatus.WAITING_FOR_ADAPTER
            self.loading.append(seq)
            return
        self._count_live(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def wait_for_adapter(self, timeout: float) -> None:
        """Block until the oldest adapter read in flight is done, or ``timeout`` seconds."""
        if self.loading and self.adapters is not None and self.loading[0].adapter_name is not None:
            self.adapters.resolver.wait_for_load(self.loading[0].adapter_name, timeout=timeout)

    def _count_live(self, seq: Sequence) -> None:
        self.admission.count_live(seq, 1 + len(self._forks.get(seq.seq_id, ())))

    def _admit_loaded(self, batch: ScheduledBatch) -> None:
        """Move requests whose adapter is now in host memory to the waiting queue; abort the others."""
        assert self.adapters is not None
        for seq in list(self.loading):
            assert seq.adapter_name is not None
            error: str | None
            code: str | None = None
            try:
                adapter_id = self.adapters.resolve_nowait(seq.adapter_name)
                if adapter_id is None:
                    continue  # still being read
                params, error = self.admission.fitted(seq.params, seq.num_prompt_tokens, adapter_id)
                code = REQUEST_TOO_LARGE if error is not None else None
            except AdapterError as failure:  # AdapterNotFoundError: removed meanwhile
                error = f"adapter {seq.adapter_name!r} could not be loaded: {failure}"
                code = failure.code
            self.loading.remove(seq)
            if error is not None:
                logger.error("request %s: adapter %r: %s", seq.request_id, seq.adapter_name, error)
                for sample in (seq, *self._forks.pop(seq.seq_id, ())):  # counted nowhere yet
                    self._end(sample, FinishReason.ABORT, None)
                batch.aborted.append((seq, error, code))
                continue
            for sample in (seq, *self._forks.get(seq.seq_id, ())):
                sample.adapter_id, sample.params = adapter_id, params  # max_tokens lowered to fit, if allowed
            self._count_live(seq)
            seq.status = SequenceStatus.WAITING
            self.waiting.append(seq)

    def _add_fork(self, parent: Sequence, child: Sequence) -> None:
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
        if self.loading:
            self._admit_loaded(batch)
        budget = self.max_num_batched_tokens
        preempted = self._schedule_running(batch, budget)
        budget -= batch.num_tokens
        if not preempted:
            self._schedule_queued(batch, budget)
        if not self.running and self._free_waiting_forks() and not preempted:
            self._schedule_queued(batch, budget)
        batch.released_seq_ids, self._released = self._released, []
        if self.adapters is not None:
            for seq in batch.seqs:
                if seq.adapter_id is not None and seq.adapter_id not in batch.adapters:
                    batch.adapters[seq.adapter_id] = self.adapters.pages_for_step(seq.adapter_id)
            batch.adapter_loads = self.adapters.take_loads()
        return batch

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> bool:
        preempted = False
        index = 0
        while index < len(self.running) and budget > 0:
            seq = self.running[index]
            if seq.num_pending_tokens and seq.num_tokens - seq.num_prompt_tokens >= seq.params.max_tokens:
                index += 1  # its last token is on its way: it ends when that arrives
                continue
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

    def _schedule_queued(self, batch: ScheduledBatch, budget: int) -> None:
        budget = self._schedule_swapped(batch, budget)
        if not self.swapped:
            self._schedule_waiting(batch, budget)

    def _free_waiting_forks(self) -> bool:
        """Nothing runs: the head of the line did not fit, or the one running sequence preempted
        itself. Forked samples waiting behind it may hold pages (their request's prompt) that
        nothing else would free; they give them back and recompute their prompt (from the prefix
        cache while it keeps it), each counted as a preemption. True if any held pages."""
        forks = [seq for seq in self.waiting if seq.block_ids]  # only forks wait holding blocks
        for seq in forks:
            self.kv_manager.free(seq)
            seq.num_computed_tokens = 0
            self.num_preemptions += 1
            seq.num_preemptions += 1
        return bool(forks)

    def _schedule_swapped(self, batch: ScheduledBatch, budget: int) -> int:
        while self.swapped and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.swapped[0]
            if seq.num_pending_tokens:  # swapped out while in flight: back once its token arrives
                break
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self.admission.can_swap_in(seq, num_new):
                break
            acquired = self.admission.acquire(seq)
            assert acquired, "swap-in checked the adapter's pages"
            self.swapped.popleft()
            batch.swap_in.extend(self.kv_manager.swap_in(seq))
            self._start_running(seq, num_new, batch)
            budget -= num_new
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            if seq.num_pending_tokens:  # preempted while in flight: its prefix hashes need that token
                break
            fresh = not seq.block_ids and seq.num_computed_tokens == 0
            if fresh:
                self.kv_manager.match_prefix(seq)
            num_new = min(seq.num_uncomputed_tokens, budget)
            # Adapter and KV pages are checked together, so a request that cannot start
            # loads (and evicts) nothing.
            if not self.admission.can_admit(seq, num_new):
                if fresh:
                    self.kv_manager.unmatch_prefix(seq)
                break
            acquired = self.admission.acquire(seq)
            assert acquired, "admission checked the adapter's pages"
            self.waiting.popleft()
            self._start_running(seq, num_new, batch)
            budget -= num_new

    def _start_running(self, seq: Sequence, num_new: int, batch: ScheduledBatch) -> None:
        """Allocate an admitted sequence's slots (its admission checked the pages) and run it."""
        copies = self.kv_manager.allocate_slots(seq, num_new)
        assert copies is not None, "admission checked the KV pages"
        batch.copy_pages.extend(copies)
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)
        batch.seqs.append(seq)
        batch.num_new_tokens.append(num_new)

    def _preempt(self, seq: Sequence, batch: ScheduledBatch) -> None:
        self.admission.release(seq)
        self._released.append(seq.seq_id)
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

    def launched(self, batch: ScheduledBatch) -> None:
        """Async scheduling: the runner launched ``batch`` and its tokens are not known yet.
        Account its computed tokens and count each sampling sequence's token as pending."""
        for index, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens, strict=True)):
            samples = batch.samples(index)
            seq.num_computed_tokens += num_new
            seq.num_pending_tokens += samples

    def update_from_output(
        self, batch: ScheduledBatch, sampled: Seq[int | None], launched: bool = False
    ) -> list[Sequence]:
        """Apply a step's result: ``sampled[i]`` is the token of ``batch.seqs[i]`` (None mid-prefill).
        ``launched``: ``launched(batch)`` already accounted the step (async scheduling).

        Returns the sequences that got a token (finished ones included).
        """
        if not launched:
            for seq, num_new in zip(batch.seqs, batch.num_new_tokens, strict=True):
                seq.num_computed_tokens += num_new
        self.kv_manager.cache_full_blocks(batch.seqs)
        changed: list[Sequence] = []
        for seq, token in zip(batch.seqs, sampled, strict=True):
            if token is None or seq.is_finished:  # finished: ended while this step was in flight
                continue
            if launched:
                seq.num_pending_tokens -= 1
            seq.append_token(token)
            if self._forks and (forks := self._forks.pop(seq.seq_id, None)):
                for child in reversed(forks):
                    self._add_fork(seq, child)
            stop = self.stop_checker(seq, token)
            if stop is not None:
                self.finish(seq, *stop)
            changed.append(seq)
        return changed

    def finish(self, seq: Sequence, reason: FinishReason, stop_reason: str | int | None = None) -> None:
        """End a sequence wherever it is, freeing its pages (and, for a first sample whose other
        samples were not forked yet, end those too)."""
        if seq.is_finished:
            return
        counted = seq.status is not SequenceStatus.WAITING_FOR_ADAPTER
        self._released.append(seq.seq_id)
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            self.kv_manager.free(seq)
            self.admission.release(seq)
        elif seq.status is SequenceStatus.WAITING:
            self.waiting.remove(seq)
            self.kv_manager.free(seq)
        elif seq.status is SequenceStatus.SWAPPED:
            self.swapped.remove(seq)
            self.kv_manager.free_swapped(seq)
        elif seq.status is SequenceStatus.WAITING_FOR_ADAPTER:
            self.loading.remove(seq)
            name = seq.adapter_name
            if self.adapters is not None and name is not None and all(s.adapter_name != name for s in self.loading):
                self.adapters.resolver.drop_read(name)  # its last waiter: the read would be held for nobody
        for sample in (seq, *self._forks.pop(seq.seq_id, ())):
            if counted:
                self.admission.drop_live(sample)
            self._end(sample, reason, stop_reason if sample is seq else None)

    @staticmethod
    def _end(seq: Sequence, reason: FinishReason, stop_reason: str | int | None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.num_pending_tokens = 0  # a step in flight computes its token, which is dropped
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

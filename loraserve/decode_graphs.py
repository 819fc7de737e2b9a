"""Decode steps on fixed buffers, captured as CUDA graphs per padded batch size (nano-vllm's and
vLLM's design, our own code).

A decode-only step of ``n`` sequences runs at the smallest captured size ``>= n`` (1, 2, 4, 8,
16, then multiples of 16 up to ``max_num_seqs``). Its integers are copied, on the device, from
the step's uploaded batch into static buffers; rows ``n ..`` are padding: their KV slot is -1
(the fused RoPE + KV write skips them), their adapter slot -1 (no LoRA), and they belong to no
sequence (``query_starts`` stays at ``n``), so attention leaves them alone and they never touch a
real row. The forward over those buffers makes no host copy and reads no device scalar, so on
CUDA it is captured once per (size, with or without adapters) at warm-up and replayed; adapter
weights and page tables it reads (``lora/slots.py``) change in place between replays. On other
devices (the CPU tests, Triton's interpreter) the same padded forward runs eagerly: what a graph
would replay. Mixed and prefill steps always run eagerly.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from loraserve.forward_batch import ForwardBatch
from loraserve.kernels.lora import sort_by_slot
from loraserve.kernels.triton_compilations import compiled_variants
from loraserve.lora.batch import LoRABatch
from loraserve.lora.slots import AdapterSlots
from loraserve.models.llama import LlamaForCausalLM, LoRAHook

logger = logging.getLogger(__name__)

CHECK_COMPILATIONS_EVERY = 256  # decode steps between counts of Triton compilations (microseconds each)


def capture_sizes(max_num_seqs: int) -> list[int]:
    """Padded batch sizes: 1, 2, 4, 8, 16, 32, 48, ... up to ``max_num_seqs`` (always included)."""
    sizes = [size for size in (1, 2, 4, 8) if size < max_num_seqs]
    sizes += list(range(16, max_num_seqs, 16))
    return [*sizes, max_num_seqs]


@dataclass(frozen=True)
class StaticBuffers:
    """Inputs of the padded decode forward, allocated once for the largest size."""

    input_ids: torch.Tensor  # [max_size] int64
    positions: torch.Tensor  # [max_size] int64
    slot_mapping: torch.Tensor  # [max_size] int64, -1 on padded rows
    query_starts: torch.Tensor  # [max_size + 1] int64
    seq_lens: torch.Tensor  # [max_size] int64
    block_tables: torch.Tensor  # [max_size, max_blocks] int64
    token_slots: torch.Tensor  # [max_size] int64, -1 on padded rows and base-model rows
    logits_indices: torch.Tensor  # [max_size] int64, arange


class DecodeGraphs:
    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_caches: list[torch.Tensor],
        lora_hook: LoRAHook,
        slots: AdapterSlots,
        max_num_seqs: int,
        max_blocks: int,
        device: torch.device,
        capture: bool,
        splits_for_size: Callable[[int], int] = lambda size: 1,
    ) -> None:
        """``capture``: record CUDA graphs (CUDA only); otherwise run the padded forward eagerly.
        ``splits_for_size``: the split-KV shares of the attention at each padded size (fixed in its
        graph; the kernel divides each sequence's actual context into them)."""
        if capture and device.type != "cuda":
            raise ValueError(f"CUDA graphs need a CUDA device, not {device}")
        self.model = model
        self.kv_caches = kv_caches
        self.lora_hook = lora_hook
        self.slots = slots
        self.sizes = capture_sizes(max_num_seqs)
        self.splits = {size: splits_for_size(size) for size in self.sizes}
        self.capture = capture
        size = self.sizes[-1]

        def longs(*shape: int) -> torch.Tensor:
            return torch.zeros(*shape, dtype=torch.long, device=device)

        self.buffers = StaticBuffers(
            longs(size),
            longs(size),
            longs(size),
            longs(size + 1),
            longs(size),
            longs(size, max_blocks),
            longs(size),
            torch.arange(size, device=device),
        )
        self._graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self._logits: torch.Tensor | None = None  # [max_size, vocab], what every graph writes
        self._generation = slots.generation
        self._pool: Any = None  # the graphs' shared memory pool
        self._compiled_at_warm_up: int | None = None  # Triton kernel variants after warm_up (CUDA)
        self.compilations_after_warm_up = 0
        self.num_steps = 0  # decode steps run here (padded), replayed or eager
        self.num_replays = 0
        self.num_captures = 0

    def padded_size(self, num_seqs: int) -> int | None:
        """The captured size a step of ``num_seqs`` decode sequences runs at (None: too many)."""
        return next((size for size in self.sizes if size >= num_seqs), None)

    def static_batch(self, size: int, with_lora: bool) -> ForwardBatch:
        """The padded decode batch over the static buffers (what a graph of this size reads)."""
        b = self.buffers
        lora = None
        if with_lora:
            token_slots = b.token_slots[:size]
            grouping = sort_by_slot(token_slots, self.slots.num_slots)  # in the graph: replayed every step
            lora = LoRABatch((), {}, token_slots=token_slots, slots=self.slots.tables, slot_grouping=grouping)
        return ForwardBatch(
            input_ids=b.input_ids[:size],
            positions=b.positions[:size],
            slot_mapping=b.slot_mapping[:size],
            query_starts=b.query_starts[: size + 1],
            seq_lens=b.seq_lens[:size],
            block_tables=b.block_tables[:size],
            num_decode_tokens=size,
            decode_block_tables=b.block_tables[:size],
            decode_context_lens=b.seq_lens[:size],
            prefill=None,
            logits_indices=b.logits_indices[:size],
            lora=lora,
            attention_splits=self.splits[size],
        )

    def fill(self, batch: ForwardBatch, size: int) -> None:
        """Copy a decode step's inputs into the static buffers (device to device) and pad them."""
        n = batch.num_decode_tokens
        b = self.buffers
        b.input_ids[:n].copy_(batch.input_ids)
        b.positions[:n].copy_(batch.positions)
        b.slot_mapping[:n].copy_(batch.slot_mapping)
        b.seq_lens[:n].copy_(batch.seq_lens)
        b.query_starts[: n + 1].copy_(batch.query_starts)
        width = batch.block_tables.shape[1]
        b.block_tables[:n, :width].copy_(batch.block_tables)
        if batch.lora is not None and batch.lora.token_slots is not None:
            b.token_slots[:n].copy_(batch.lora.token_slots)
        if size > n:  # padding rows: no KV write, no adapter, no sequence
            b.input_ids[n:size].zero_()
            b.positions[n:size].zero_()
            b.slot_mapping[n:size].fill_(-1)
            b.seq_lens[n:size].zero_()
            b.query_starts[n + 1 : size + 1].fill_(n)
            b.token_slots[n:size].fill_(-1)

    def forward(self, size: int, with_lora: bool) -> torch.Tensor:  # [size, vocab]
        """The padded forward over the static buffers: what a graph captures."""
        hook = self.lora_hook if with_lora else None
        return self.model(self.static_batch(size, with_lora), self.kv_caches, hook)

    def run(self, batch: ForwardBatch) -> torch.Tensor | None:  # [num_sampled, vocab]
        """Logits of a decode-only step's sampled rows, or None when it is not one a graph takes."""
        n = batch.num_decode_tokens
        size = self.padded_size(n)
        if size is None or batch.prefill is not None:
            return None
        with_lora = batch.lora is not None
        if batch.lora is not None and batch.lora.token_slots is None:
            return None  # adapters without slots (not expected from the runner): run eagerly
        if self.capture and self.slots.generation != self._generation:  # the slot tables or row bound grew
            logger.info("adapter slot tables or their row bound grew: capturing the decode graphs again")
            self._graphs.clear()  # their memory pool goes with the last of them: captures start a new one
            self._pool = None
            self._generation = self.slots.generation
            self.warm_up()  # every size now, not one by one in later steps (it overwrites the buffers)
        self.fill(batch, size)
        self.num_steps += 1
        if self.num_steps % CHECK_COMPILATIONS_EVERY == 0:
            self.check_compilations()
        if not self.capture:
            return self.forward(size, with_lora).index_select(0, batch.logits_indices)
        key = (size, with_lora)
        if key not in self._graphs:
            self._capture(key)
        self._graphs[key].replay()
        self.num_replays += 1
        assert self._logits is not None  # written by the capture
        return self._logits.index_select(0, batch.logits_indices)  # the sampled rows (all below this size)

    def _capture(self, key: tuple[int, bool]) -> None:
        size, with_lora = key
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            warm = self.forward(size, with_lora)  # warm-up: compiles the kernels of this size outside the graph
        torch.cuda.current_stream().wait_stream(stream)
        if self._logits is None:  # one output buffer for every graph: their own outputs die with the capture
            self._logits = torch.empty(self.sizes[-1], warm.shape[1], dtype=warm.dtype, device=warm.device)
        del warm
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool):
            self._logits[:size].copy_(self.forward(size, with_lora))
        self._pool = graph.pool()
        self._graphs[key] = graph
        self.num_captures += 1

    def warm_up(self) -> None:
        """Capture every size, with and without adapters, largest first (they share one memory
        pool), over padding-only inputs (no KV write, no adapter, no sequence)."""
        if not self.capture:
            return
        b = self.buffers
        b.slot_mapping.fill_(-1)
        b.query_starts.zero_()
        b.token_slots.fill_(-1)
        for size in reversed(self.sizes):
            for with_lora in (False, True):
                if (size, with_lora) not in self._graphs:
                    self._capture((size, with_lora))
        torch.cuda.synchronize()
        self._compiled_at_warm_up = compiled_variants()
        logger.info(
            "captured %d decode graphs (sizes %s); %s Triton kernel variants compiled",
            len(self._graphs),
            self.sizes,
            self._compiled_at_warm_up,
        )

    def replay_ms(self, size: int, with_lora: bool, repeats: int = 20) -> float | None:
        """GPU milliseconds of one replay of a captured graph over the buffers as the last step
        left them (it rewrites that step's KV with the same values), or None if not captured."""
        graph = self._graphs.get((size, with_lora))
        if graph is None:
            return None
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        graph.replay()  # warm
        start.record()
        for _ in range(repeats):
            graph.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / repeats

    def check_compilations(self) -> int:
        """Triton compilations since the warm-up (logged when they grow; 0 in steady state)."""
        if self._compiled_at_warm_up is None:
            return 0
        now = compiled_variants()
        if now is None:
            return 0
        new = now - self._compiled_at_warm_up
        if new > self.compilations_after_warm_up:
            logger.warning("%d Triton kernel variants compiled after the warm-up (a step stalled for each)", new)
        self.compilations_after_warm_up = new
        return new

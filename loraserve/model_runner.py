"""Runs one scheduled step: builds the flattened batch, runs the model, samples.

Owns the pool's memory (``pool_storage.py``): its copies between pages run first in a step.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from loraserve.decode_graphs import DecodeGraphs
from loraserve.decode_path import DecodePath, DecodePathChoice
from loraserve.forward_batch import ForwardBatch, PrefillBatch, attention_splits
from loraserve.input_batch import InputBatch
from loraserve.launched_step import LaunchedStep, SampledTokens, fill_placeholders, placeholder_codes
from loraserve.logits_adjustments import LogitsAdjustments
from loraserve.lora.apply_torch import PerBatchLoRAHook
from loraserve.lora.batch import LoRABatch
from loraserve.lora.slots import AdapterSlots
from loraserve.models.llama import LlamaForCausalLM
from loraserve.page_layout import PageLayout
from loraserve.pool_storage import PoolStorage
from loraserve.sampler import Sampler, SamplingBatch, record_logprobs, record_prompt_logprobs
from loraserve.scheduled_batch import ScheduledBatch
from loraserve.sequence import Sequence
from loraserve.structured_outputs import TokenMask, apply_bitmasks

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PreparedStep:
    """A step's inputs as the runner built them from a ``ScheduledBatch``."""

    forward: ForwardBatch
    sampling: SamplingBatch
    sampled_rows: np.ndarray  # [num_sampled] int64: input-batch rows of the sequences that sample
    sampled_positions: np.ndarray  # [num_sampled] int64: where their new tokens go in those rows
    sampling_index: list[int]  # indices into batch.seqs of the sequences that sample, in logits-row order
    decode_path: tuple[int, DecodePath] | None = None  # (padded size, path) of a decode step with adapters


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        layout: PageLayout,
        num_pages: int,
        num_swap_pages: int,
        dtype: torch.dtype,
        device: torch.device,
        make_lora_hook: Callable[[torch.Tensor], PerBatchLoRAHook[Any]],
        max_num_seqs: int,
        max_model_len: int,
        eos_token_ids: frozenset[int] = frozenset(),
        decode_graphs: bool = False,
        adapter_slot_pages: int = 8,
        adapter_decode: DecodePathChoice | None = None,
        mask_tokens: TokenMask = apply_bitmasks,
    ) -> None:
        """``decode_graphs``: run decode-only steps padded on static buffers with adapters by slot
        (``decode_graphs.py``; the Triton backend), captured as CUDA graphs on a CUDA device.
        ``adapter_slot_pages``: the slot tables' first row width (a wider adapter grows them, and
        the graphs are captured again). ``adapter_decode``: how decode-only steps with adapters
        run under ``decode_graphs`` (``decode_path.py``; default: timed, the faster kept). ``mask_tokens``: the kernel
        backend's structured-outputs mask (``structured_outputs.apply_bitmasks`` or its twin)."""
        self.model = model
        self.layout = layout
        self.device = device
        self.vocab_size = int(model.config.vocab_size)
        self.pool = PoolStorage(layout, num_pages, num_swap_pages, dtype, device)
        self.sampler = Sampler()
        self.mask_tokens = mask_tokens
        self.lora_hook = make_lora_hook(self.pool.storage)
        max_blocks = min(num_pages, -(-max_model_len // layout.block_size) + 1)
        self.input_batch = InputBatch(max_num_seqs, max_blocks, max_model_len, self.vocab_size, device)
        self.adapter_slots: AdapterSlots | None = None
        self.decode_graphs: DecodeGraphs | None = None
        # Multiprocessors the one-launch attention should fill (0: never split contexts).
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 0
        self.split_kv = decode_graphs  # the backend's attention takes split-KV shares (Triton)
        if decode_graphs:
            self.adapter_slots = AdapterSlots(max_num_seqs, layout.num_layers, device, adapter_slot_pages)
            self.decode_graphs = DecodeGraphs(
                model,
                self.pool.kv_caches,
                self.lora_hook,
                self.adapter_slots,
                max_num_seqs,
                max_blocks,
                device,
                capture=device.type == "cuda",
                splits_for_size=lambda size: self.attention_splits(size, max_model_len),
            )
        self.adapter_decode = adapter_decode or DecodePathChoice()
        self.num_downloads = 0  # device-to-host copies of sampled ids (one per step that samples)
        self.num_launches = 0  # steps launched
        self._downloads: list[torch.Tensor | None] = [None, None]  # pinned buffers of sampled ids (CUDA)
        self.eos_token_ids = eos_token_ids  # banned before a request's min_tokens

    def attention_splits(self, num_seqs: int, max_context: int, decode_only: bool = True) -> int:
        """Split-KV shares for a step of ``num_seqs`` sequences (``forward_batch.attention_splits``);
        1 for a step with prefills, whose query blocks fill the GPU (splits would only add partials)."""
        if not self.split_kv or not decode_only:
            return 1
        return attention_splits(num_seqs * self.layout.num_kv_heads, max_context, self.num_sms)

    def prepare(self, batch: ScheduledBatch) -> PreparedStep:
        """Flatten the batch: decode tokens first, and within each part grouped by adapter.

        Input ids, positions, slots and block tables are computed with array ops from the
        persistent rows; every integer of the step reaches the device in one upload. Also returns
        how to sample each logits row, which sequences sample (in logits-row order), and where the sampled
        tokens go in the rows.
        """
        rows_of = self.input_batch
        unordered = rows_of.sync(batch.seqs)  # [n, 3], in the batch's order
        scheduled = np.array(batch.num_new_tokens, np.int64)  # [n]
        # Decode sequences first, then prefills; within each, grouped by adapter (one stable sort).
        order = np.lexsort((rows_of.adapter_codes[unordered[:, 2]], scheduled != 1))  # [n]
        seqs = [batch.seqs[i] for i in order.tolist()]
        count = len(seqs)
        block_size = self.layout.block_size
        per_seq = unordered[order]  # [n, 3]
        starts, totals, rows = per_seq[:, 0], per_seq[:, 1], per_seq[:, 2]  # [n] each
        num_new = scheduled[order]  # [n]
        ends = starts + num_new
        num_decode = int(np.count_nonzero(num_new == 1))  # sorted first
        token_ends = np.cumsum(num_new)  # [n], one past each sequence's last row
        token_starts = token_ends - num_new
        num_tokens = int(token_ends[-1])
        owner = np.repeat(np.arange(count), num_new)  # [num_tokens], the sequence of each row
        positions = np.arange(num_tokens) - token_starts[owner] + starts[owner]  # [num_tokens]
        tables = rows_of.block_tables
        slots = tables[rows[owner], positions // block_size] * block_size + positions % block_size
        input_ids = rows_of.token_ids[rows[owner], positions].astype(np.int64)  # [num_tokens]
        samples = ends == totals  # [n] bool: the sequence reaches its last token, so it samples
        prompt_spans, prompt_rows = self._prompt_logprob_rows(seqs, starts, ends, token_starts)
        sampled_rows = rows[samples]
        width = -(-int(ends.max()) // block_size)  # blocks of the longest context
        parts = [
            input_ids,
            positions,
            slots,
            ends,  # context of each sequence after the step
            np.concatenate([token_ends[samples] - 1, *prompt_rows]),  # logits rows: sampled, then prompt logprobs
            tables[rows, :width],  # decode sequences' rows first
            np.concatenate(([0], token_ends)),  # query starts of every sequence
            np.concatenate(([0], np.cumsum(num_new[num_decode:]))),  # prefill query starts
            starts[num_decode:],  # prefill cached lengths
            rows_of.top_ks[sampled_rows],
            rows_of.seeds[sampled_rows],
            totals[samples] - rows_of.num_prompt_tokens[sampled_rows],  # output index of each sampled token
            rows_of.temperatures[sampled_rows],
            rows_of.top_ps[sampled_rows],
            rows_of.min_ps[sampled_rows],
        ]
        slots_of: dict[str, int] | None = None
        decode_path: tuple[int, DecodePath] | None = None
        if self.decode_graphs is not None and num_decode == count and batch.adapters:
            graph_size = self.decode_graphs.padded_size(count)  # a decode step with adapters a graph could take
            if graph_size is not None:
                decode_path = (graph_size, self.adapter_decode.path(graph_size))
        if decode_path is not None and decode_path[1] is DecodePath.GRAPH:
            # A decode step that replays a graph: adapters by slot, each token's slot uploaded.
            assert self.adapter_slots is not None
            slots_of = self.adapter_slots.assign(batch.adapters)
            parts.append(np.array([slots_of.get(s.adapter_id or "", -1) for s in seqs], np.int64))
        adjusts = bool(rows_of.adjusts[sampled_rows].any())
        if adjusts:  # only steps with a penalty, bias or min_tokens pay for this
            sampled_seqs = [seq for seq, sample in zip(seqs, samples.tolist(), strict=True) if sample]
            extra = LogitsAdjustments.host_parts(sampled_seqs, self.eos_token_ids, self.vocab_size)
            parts.extend(extra)
        lora = LoRABatch.from_runs([seq.adapter_id for seq in seqs], token_ends, batch.adapters)
        # The LoRA hook's per-step tables travel in the same upload (not for steps by adapter slot).
        lora_upload = self.lora_hook.upload_parts(lora) if lora is not None and slots_of is None else None
        lora_arrays = lora_upload.arrays if lora_upload is not None else []
        parts.extend(lora_arrays)
        views = rows_of.upload(parts)
        if lora_upload is not None and lora is not None:  # its views are the upload's last ones
            split = len(views) - len(lora_arrays)
            views, lora_views = views[:split], views[split:]
            shaped = [view.view(array.shape) for view, array in zip(lora_views, lora_arrays, strict=True)]
            lora = replace(lora, prepared=lora_upload.build(shaped))
        (ids, pos, slot, seq_lens, logits_rows, flat_tables, all_starts, query_starts, cached,
         top_ks, seeds, counters, temperatures, top_ps, min_ps) = views[:15]  # fmt: skip
        block_tables = flat_tables.view(count, width)  # [num_seqs, width]
        token_slots = views[15] if slots_of is not None else None  # [num_tokens]
        adjustments = None
        if adjusts:
            any_penalty = any(seq.params.has_penalties for seq in sampled_seqs)
            first = 16 if slots_of is not None else 15
            adjustments = LogitsAdjustments.from_views(views[first:], [part.shape for part in extra], any_penalty)
        forward_batch = ForwardBatch(
            input_ids=ids,
            positions=pos,
            slot_mapping=slot,
            query_starts=all_starts,
            seq_lens=seq_lens,
            block_tables=block_tables,
            num_decode_tokens=num_decode,
            decode_block_tables=block_tables[:num_decode],
            decode_context_lens=seq_lens[:num_decode],
            prefill=None if num_decode == count else PrefillBatch(query_starts, cached, block_tables[num_decode:]),
            logits_indices=logits_rows,
            lora=lora,
            attention_splits=self.attention_splits(count, int(ends.max()), decode_only=num_decode == count),
        )
        if token_slots is not None and forward_batch.lora is not None and self.adapter_slots is not None:
            slotted = replace(forward_batch.lora, token_slots=token_slots, slots=self.adapter_slots.tables)
            forward_batch = replace(forward_batch, lora=slotted)
        sampling = SamplingBatch(
            temperatures=temperatures.float(),
            top_ks=top_ks,
            top_ps=top_ps.float(),
            seeds=seeds,
            counters=counters,
            all_greedy=bool(rows_of.greedy[sampled_rows].all()),
            any_filter=bool(rows_of.filtered[sampled_rows].any()),
            min_ps=min_ps if bool((rows_of.min_ps[sampled_rows] > 0).any()) else None,
            adjustments=adjustments,
            prompt_spans=prompt_spans,
        )
        sampling_index = order[samples].tolist()
        return PreparedStep(forward_batch, sampling, sampled_rows, totals[samples], sampling_index, decode_path)

    @staticmethod
    def _prompt_logprob_rows(
        seqs: list[Sequence], starts: np.ndarray, ends: np.ndarray, token_starts: np.ndarray
    ) -> tuple[tuple[tuple[Sequence, int, int], ...], list[np.ndarray]]:
        """Rows whose logits give prompt logprobs: for each prefill chunk of a request that asks,
        its positions ``p`` with ``p + 1`` a prompt token not recorded yet (so a prompt recomputed
        after preemption is not recorded twice). Every sequence is looked at: a prefill chunk of one
        token sorts with the decodes (a decode's positions are past its prompt: it gives none)."""
        spans: list[tuple[Sequence, int, int]] = []
        rows: list[np.ndarray] = []
        for i in range(len(seqs)):
            seq = seqs[i]
            if seq.params.prompt_logprobs is None or seq.sample_index != 0:
                continue
            first = max(int(starts[i]), len(seq.prompt_logprobs) - 1)
            last = min(int(ends[i]), seq.num_prompt_tokens - 1)
            if last > first:
                spans.append((seq, first, last - first))
                rows.append(token_starts[i] + np.arange(first, last) - starts[i])
        return tuple(spans), rows

    @torch.inference_mode()
    def launch(self, batch: ScheduledBatch, previous: LaunchedStep | None = None) -> LaunchedStep:
        """Start the step: page copies, inputs, forward, sampling, and the sampled ids' copy to the
        host (``launched_step.py``). ``previous``: the step launched before, whose tokens are not
        on the host yet; this step's input ids that are its tokens are taken from the device."""
        self.num_launches += 1
        self.input_batch.release(batch.released_seq_ids)
        self.pool.copy_pages(batch)
        if not batch.seqs:
            return LaunchedStep(batch, self.num_launches)
        started = self.adapter_decode.clock()
        step = self.prepare(batch)
        forward_batch, sampling = step.forward, step.sampling
        if previous is not None and previous.sampled is not None:
            fill_placeholders(forward_batch.input_ids, previous.sampled.device_ids)
        logits = self.decode_graphs.run(forward_batch) if self.decode_graphs is not None else None
        if logits is None:  # not a decode step a graph takes: eager
            hook = self.lora_hook if forward_batch.lora is not None else None
            logits = self.model(forward_batch, self.pool.kv_caches, hook)  # [num_sampled, vocab]
        sampling_index = step.sampling_index
        if sampling.prompt_spans:  # rows past the sampled ones: prompt logprobs
            record_prompt_logprobs(logits[len(sampling_index) :], sampling.prompt_spans)
            logits = logits[: len(sampling_index)]
        launched = LaunchedStep(batch, self.num_launches, sampling_index, step.sampled_rows, step.sampled_positions)
        if not sampling_index:
            return launched
        self._downloads = self._downloads[::-1]  # the other buffer: the last step's may be unread
        if sampling.adjustments is not None:
            sampling.adjustments.mask_grammars(logits, self.mask_tokens)  # for the sampler and the logprobs below
        launched.sampled = SampledTokens(self.sampler(logits, sampling), self._download_buffer())
        self.num_downloads += 1
        codes = placeholder_codes(len(sampling_index))  # until the tokens are on the host
        self.input_batch.append_sampled(step.sampled_rows, step.sampled_positions, codes)
        if self.input_batch.logprobs[step.sampled_rows].any():
            record_logprobs(logits, [batch.seqs[i] for i in sampling_index], launched.sampled.tokens())
        if step.decode_path is not None and not self.adapter_decode.settled(step.decode_path[0]):
            launched.sampled.tokens()  # timed until its tokens are on the host: its GPU work is done
            self.adapter_decode.record(*step.decode_path, started, len(batch.seqs))
        return launched

    def collect(self, launched: LaunchedStep) -> list[int | None]:
        """The sampled token of each sequence of a launched step (None mid-prefill), waiting for
        them if they are still on their way; written into the input rows over the placeholders."""
        batch = launched.batch
        sampled: list[int | None] = [None] * len(batch.seqs)
        if launched.sampled is None:
            return sampled
        tokens = launched.sampled.tokens()
        if launched.launch_index == self.num_launches:  # no launch since: its rows are still its sequences'
            self.input_batch.append_sampled(launched.sampled_rows, launched.sampled_positions, tokens)
        else:
            seq_ids = [batch.seqs[i].seq_id for i in launched.sampling_index]
            self.input_batch.fill_pending(seq_ids, launched.sampled_rows, launched.sampled_positions, tokens)
        for i, token in zip(launched.sampling_index, tokens, strict=True):
            sampled[i] = token
        return sampled

    def _download_buffer(self) -> torch.Tensor | None:
        """Pinned host memory for a step's sampled ids (CUDA); two, used in turn."""
        if self.device.type != "cuda":
            return None
        if self._downloads[0] is None:
            self._downloads[0] = torch.empty(self.input_batch.max_num_seqs, dtype=torch.long, pin_memory=True)
        return self._downloads[0]

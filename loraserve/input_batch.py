"""The runner's state kept across steps (vLLM v1's ``InputBatch``): one row per live sequence.

A row holds what stays fixed for a sequence (its sampling parameters, seed, prompt length),
written when it joins, and, in preallocated arrays updated incrementally, its token ids (the
prompt when it joins, then each sampled token as the runner samples it: ``append_sampled``) and
its KV block table (a step writes only the blocks appended since the last one, and rewrites a
row only when the KV cache manager gave the sequence a new table, ``Sequence.block_table_epoch``:
preemption, swap, copy-on-write). Rows are released when the scheduler reports the sequence finished or preempted
(``ScheduledBatch.released_seq_ids``). ``upload`` sends a step's integers to the device as one
buffer in one copy (from pinned memory, non-blocking, on CUDA; no copy at all on the CPU).
"""

from __future__ import annotations

from collections.abc import Iterable
from itertools import chain

import numpy as np
import torch

from loraserve.sequence import Sequence

_MAX_CODES = 1 << 16  # adapter codes kept before renumbering the live rows' adapters


class InputBatch:
    def __init__(
        self, max_num_seqs: int, max_blocks_per_seq: int, max_model_len: int, vocab_size: int, device: torch.device
    ) -> None:
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.vocab_size = vocab_size
        self.token_ids = np.zeros((max_num_seqs, max_model_len), dtype=np.int32)  # [rows, max_model_len]
        # Per row, how many leading token ids equal its sequence's (-1: joined, not written yet):
        self._num_token_ids = np.zeros(max_num_seqs, dtype=np.int64)
        self.block_tables = np.zeros((max_num_seqs, max_blocks_per_seq), dtype=np.int64)
        # Per row, fixed while the sequence lives (gathered by row for the sampled sequences):
        self.seeds = np.zeros(max_num_seqs, dtype=np.int64)
        self.num_prompt_tokens = np.zeros(max_num_seqs, dtype=np.int64)
        self.top_ks = np.zeros(max_num_seqs, dtype=np.int64)  # the vocabulary size when off
        self.temperatures = np.zeros(max_num_seqs, dtype=np.float64)
        self.top_ps = np.ones(max_num_seqs, dtype=np.float64)
        self.greedy = np.zeros(max_num_seqs, dtype=bool)
        self.filtered = np.zeros(max_num_seqs, dtype=bool)  # top-k or top-p on
        self.min_ps = np.zeros(max_num_seqs, dtype=np.float64)
        self.adjusts = np.zeros(max_num_seqs, dtype=bool)  # penalties, logit bias, min_tokens, masks
        self.logprobs = np.zeros(max_num_seqs, dtype=bool)  # asks for the sampled tokens' logprobs
        # A number per adapter (0: the base model), so a step groups its rows by adapter with one
        # sort: codes in order of first use, renumbered when more than ``_MAX_CODES`` were given.
        self.adapter_codes = np.zeros(max_num_seqs, dtype=np.int64)
        self._adapter_of_row: list[str | None] = [None] * max_num_seqs
        self._codes: dict[str, int] = {}
        self._num_synced = np.zeros(max_num_seqs, dtype=np.int64)  # leading entries of each row equal to its table
        self._epochs = np.full(max_num_seqs, -1, dtype=np.int64)  # the block_table_epoch they came from
        self._rows: dict[int, int] = {}  # seq_id -> row
        self._free_rows = list(reversed(range(max_num_seqs)))
        self._staging: torch.Tensor | None = None  # pinned host buffer of the uploads (CUDA)
        self._staging_copied: torch.cuda.Event | None = None  # recorded after the last upload's copy
        self.num_uploads = 0  # host-to-device copies made (one per step with tokens)

    @property
    def num_rows(self) -> int:
        return len(self._rows)

    def release(self, seq_ids: Iterable[int]) -> None:
        """Forget the rows of sequences that finished or were preempted (unknown ids are ignored)."""
        for seq_id in seq_ids:
            row = self._rows.pop(seq_id, None)
            if row is not None:
                self._free_rows.append(row)

    def row(self, seq: Sequence) -> int:
        """The sequence's row, its token ids and block table brought up to date."""
        return int(self.sync([seq])[0, 2])

    def sync(self, seqs: list[Sequence]) -> np.ndarray:
        """Bring the rows of ``seqs`` up to date (joining new ones); return ``[len(seqs), 3]``
        int64: each sequence's computed tokens, its tokens, and its row.

        One pass reads what the rows must match (token count, block count, table epoch); only
        the rows that differ (joined, a token the runner did not sample, new blocks) are written.
        """
        get = self._rows.get
        fields = [
            (s.num_computed_tokens, s.num_tokens, get(s.seq_id, -1), len(s.block_ids), s.block_table_epoch)
            for s in seqs
        ]
        # fromiter over the flattened tuples: about half the time of np.array over the tuples
        state = np.fromiter(chain.from_iterable(fields), np.int64, 5 * len(seqs)).reshape(len(seqs), 5)  # [n, 5]
        rows = state[:, 2]  # [n], a view: joined rows are written into it
        for i in np.flatnonzero(rows < 0).tolist():
            rows[i] = self._join(seqs[i])
        stale = (
            (self._num_token_ids[rows] != state[:, 1])
            | (self._num_synced[rows] != state[:, 3])
            | (self._epochs[rows] != state[:, 4])
        )  # [n] bool
        for i in np.flatnonzero(stale).tolist():
            self._update(seqs[i], int(rows[i]))
        return state[:, :3]

    def _update(self, seq: Sequence, row: int) -> None:
        num_tokens = len(seq.token_ids)
        if self._num_token_ids[row] != seq.num_tokens:  # joined, or a token the runner did not sample (a fork's)
            if seq.num_pending_tokens:  # only the runner knows where a pending token comes from
                raise RuntimeError(f"seq {seq.seq_id} needs its row rewritten while a step it samples in is in flight")
            if num_tokens > self.token_ids.shape[1]:
                raise RuntimeError(f"seq {seq.seq_id} has {num_tokens} tokens; rows hold {self.token_ids.shape[1]}")
            self.token_ids[row, :num_tokens] = seq.token_ids
            self._num_token_ids[row] = num_tokens
        table = seq.block_ids
        synced = int(self._num_synced[row])
        if len(table) == synced and self._epochs[row] == seq.block_table_epoch:
            return
        if len(table) > self.block_tables.shape[1]:
            raise RuntimeError(f"seq {seq.seq_id} has {len(table)} blocks; rows hold {self.block_tables.shape[1]}")
        if self._epochs[row] != seq.block_table_epoch or len(table) < synced:
            self.block_tables[row, : len(table)] = table
            self._epochs[row] = seq.block_table_epoch
        elif len(table) > synced:
            self.block_tables[row, synced : len(table)] = table[synced:]
        self._num_synced[row] = len(table)

    def _join(self, seq: Sequence) -> int:
        if not self._free_rows:
            raise RuntimeError(f"no free input-batch row for seq {seq.seq_id}: more live sequences than rows")
        row = self._rows[seq.seq_id] = self._free_rows.pop()
        self._epochs[row] = -1
        self._num_synced[row] = 0
        self._num_token_ids[row] = -1
        params = seq.params
        self.seeds[row] = seq.seed
        self.num_prompt_tokens[row] = seq.num_prompt_tokens
        self.top_ks[row] = min(params.top_k, self.vocab_size) if params.top_k > 0 else self.vocab_size  # k > vocab: all
        self.temperatures[row] = params.temperature
        self.top_ps[row] = params.top_p
        self.greedy[row] = params.is_greedy
        self.filtered[row] = params.top_k > 0 or params.top_p < 1.0
        self.min_ps[row] = params.min_p
        self.adjusts[row] = (
            params.has_penalties or bool(params.logit_bias) or params.min_tokens > 0 or params.restricts_tokens
        )
        self.logprobs[row] = params.logprobs is not None
        self._adapter_of_row[row] = seq.adapter_id
        self.adapter_codes[row] = self._code(seq.adapter_id)
        return row

    def _code(self, adapter_id: str | None) -> int:
        if adapter_id is None:
            return 0
        code = self._codes.get(adapter_id)
        if code is None:
            if len(self._codes) >= _MAX_CODES:  # forget adapters no row uses any more
                rows = self._rows.values()
                live = sorted({name for row in rows if (name := self._adapter_of_row[row]) is not None})
                self._codes = {name: i + 1 for i, name in enumerate(live)}
                for row in rows:
                    name = self._adapter_of_row[row]
                    self.adapter_codes[row] = 0 if name is None else self._codes[name]
                code = self._codes.get(adapter_id)
            if code is None:
                code = self._codes[adapter_id] = len(self._codes) + 1
        return code

    def append_sampled(self, rows: np.ndarray, positions: np.ndarray, tokens: list[int] | np.ndarray) -> None:
        """Write each sampled token at its position (the sequence's length when it was sampled) in
        its row, as the scheduler will append it: the next step reads its input ids from the rows."""
        self.token_ids[rows, positions] = tokens
        extends = self._num_token_ids[rows] == positions  # [n] bool: the token is the row's next
        self._num_token_ids[rows[extends]] = positions[extends] + 1

    def fill_pending(self, seq_ids: list[int], rows: np.ndarray, positions: np.ndarray, tokens: list[int]) -> None:
        """Async scheduling: write the tokens of a step that was in flight over the placeholders
        ``append_sampled`` wrote, in the rows their sequences still hold (a row released and
        taken by another sequence meanwhile is left alone)."""
        get = self._rows.get
        held = np.fromiter((get(seq_id, -1) for seq_id in seq_ids), np.int64, len(seq_ids)) == rows  # [n] bool
        self.token_ids[rows[held], positions[held]] = np.asarray(tokens, np.int32)[held]

    def tokens_match(self, seq: Sequence) -> bool:
        """Whether the sequence's row holds its token ids (a check for tests)."""
        row = self._rows.get(seq.seq_id)
        if row is None:
            return True
        n = int(self._num_token_ids[row])
        return n <= len(seq.token_ids) and self.token_ids[row, :n].tolist() == seq.token_ids[:n]

    def upload(self, parts: list[np.ndarray]) -> list[torch.Tensor]:
        """Send int64 (or float64, sent as its bits) arrays to the device in one copy; return
        each part as a 1-D view of the device buffer, in its own dtype."""
        sizes = [part.size for part in parts]
        host = np.concatenate([part.reshape(-1).view(np.int64) for part in parts]) if parts else np.zeros(0, np.int64)
        buffer = torch.from_numpy(host)  # [total] int64, shares the numpy memory
        if self.device.type != "cpu":
            if self._staging is None or self._staging.numel() < host.size:
                self._staging = torch.empty(max(host.size, 4096), dtype=torch.long, pin_memory=True)
            if self._staging_copied is not None:  # a step that sampled nothing did not wait for it
                self._staging_copied.synchronize()
            staging = self._staging[: host.size]
            staging.copy_(buffer)
            buffer = staging.to(self.device, non_blocking=True)
            if self.device.type == "cuda":
                self._staging_copied = torch.cuda.Event()
                self._staging_copied.record()
        self.num_uploads += 1
        views: list[torch.Tensor] = []
        offset = 0
        for part, size in zip(parts, sizes, strict=True):
            view = buffer[offset : offset + size]
            views.append(view.view(torch.float64) if part.dtype == np.float64 else view)
            offset += size
        return views

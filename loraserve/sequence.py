"""The request object that carries state from scheduler to runner to sampler."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import Any

from loraserve.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_ADAPTER = "waiting_for_adapter"  # its adapter's files are being read
    RUNNING = "running"
    SWAPPED = "swapped"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_seq_counter = itertools.count()


@dataclass(eq=False, slots=True)
class Sequence:
    """One sample of one request: its tokens, its KV block table and its progress.

    ``token_ids`` holds the prompt followed by every generated token. The KV cache
    holds the first ``num_computed_tokens`` of them; the rest are computed by the
    next steps (a prefill chunk, or the one token sampled last step).

    With a step in flight (async scheduling), the tokens it will sample are counted in
    ``num_pending_tokens`` before their values are known: ``num_tokens`` (what the scheduler and
    the KV cache count) includes them, ``token_ids`` and ``num_output_tokens`` do not.
    """

    request_id: str
    token_ids: list[int]
    params: SamplingParams
    sample_index: int = 0
    adapter_name: str | None = None
    adapter_id: str | None = None  # content digest of the adapter, resolved at arrival
    cache_salt: str | None = None  # isolates prefix-cache sharing between tenants
    random_seed: int = 0  # the sampling seed when the request gives none (drawn by the engine)
    seq_id: int = field(default_factory=lambda: next(_seq_counter))
    num_prompt_tokens: int = -1
    num_computed_tokens: int = 0
    num_pending_tokens: int = 0  # sampled by steps in flight, values not on the host yet (0, 1 or 2)
    block_ids: list[int] = field(default_factory=list)
    # Bumped by the KV cache manager whenever ``block_ids`` changes other than by appending.
    block_table_epoch: int = 0
    # Memo of the content hashes of this sequence's full blocks (see prefix_cache.py).
    block_hashes: list[bytes] = field(default_factory=list, repr=False)
    # Leading entries of ``block_ids`` already offered to the prefix cache (reset with the table).
    num_registered_blocks: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    num_cached_tokens: int = 0
    num_preemptions: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # time.monotonic() when the first and the latest output token reached the host
    first_token_time: float | None = None
    last_token_time: float | None = None
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # params.prompt_logprobs: per prompt position, token id -> (logprob, rank); None for position 0
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] = field(default_factory=lambda: [None])
    # params.bad_words as token ids (the engine's tokenizer): the last id is banned after the others
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # params.structured_outputs: this sample's xgrammar matcher, advanced by append_token
    grammar: Any = None
    grammar_rejected: bool = False
    # Incremental detokenization state (see detokenizer.py).
    output_text: str = ""
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self) -> None:
        if self.num_prompt_tokens < 0:
            self.num_prompt_tokens = len(self.token_ids)
        if self.num_prompt_tokens == 0:
            raise ValueError("a prompt must have at least one token")

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids) + self.num_pending_tokens

    @property
    def num_output_tokens(self) -> int:
        """Generated tokens known on the host (those of steps in flight not counted)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def last_token_id(self) -> int:
        return self.token_ids[-1]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def seed(self) -> int:
        """The seed of this sample's random stream (the request's, else the engine's draw)."""
        seed = self.params.sample_seed(self.sample_index)
        return self.random_seed if seed is None else seed

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        if self.grammar is not None and not self.grammar.is_terminated() and not self.grammar.accept_token(token_id):
            self.grammar_rejected = True  # its bitmask allowed it: only a broken mask gets here; ends it
        self.last_token_time = time.monotonic()
        if self.first_token_time is None:
            self.first_token_time = self.last_token_time

"""The message from scheduler to runner for one step."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraserve.lora.batch import AdapterLoad, AdapterPages
from loraserve.sequence import Sequence


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
    # Sequences finished or preempted since the last step: the runner drops their rows.
    released_seq_ids: list[int] = field(default_factory=list)
    # Not for the runner: requests ended while scheduling (their adapter could not be loaded, or
    # with it they cannot fit the pool): (sequence, why, RequestOutput.error_code or None).
    aborted: list[tuple[Sequence, str, str | None]] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)

    @property
    def is_empty(self) -> bool:
        """Nothing for the runner to do: no sequence, no swap, no row to release."""
        return not self.seqs and not self.swap_out and not self.swap_in and not self.released_seq_ids

    def samples(self, index: int) -> bool:
        """Whether sequence ``index`` reaches its last token this step (so it samples)."""
        seq = self.seqs[index]
        return seq.num_computed_tokens + self.num_new_tokens[index] == seq.num_tokens

"""A stand-in for the model runner in CPU tests of the scheduler: no model, fixed tokens."""

from __future__ import annotations

from loraserve.scheduled_batch import ScheduledBatch
from loraserve.scheduler import Scheduler


def step(sched: Scheduler) -> ScheduledBatch:
    """One engine step with a fake runner: sample where the batch reaches a sequence's end (the
    scheduler's default stop checker ends a sequence at ``max_tokens``)."""
    batch = sched.schedule()
    sampled = [1000 + seq.num_output_tokens if batch.samples(i) else None for i, seq in enumerate(batch.seqs)]
    sched.update_from_output(batch, sampled)
    return batch


def summary(batch: ScheduledBatch) -> list[tuple[str, int]]:
    """(request id, tokens scheduled) of each sequence in the batch."""
    return [(seq.request_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]

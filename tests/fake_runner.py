"""A stand-in for the model runner in CPU tests of the scheduler: no model, fixed tokens."""

from __future__ import annotations

from loraserve.scheduler import ScheduledBatch, Scheduler
from loraserve.sequence import FinishReason


def step(sched: Scheduler) -> ScheduledBatch:
    """One engine step with a fake runner: sample where the batch reaches a sequence's end."""
    batch = sched.schedule()
    sampling = [batch.samples(i) for i in range(len(batch.seqs))]  # before update, as the runner does
    sched.update(batch)
    for seq, samples in zip(batch.seqs, sampling, strict=True):
        if samples:
            seq.append_token(1000 + seq.num_output_tokens)
            if seq.num_output_tokens >= seq.params.max_tokens:
                sched.finish(seq, FinishReason.LENGTH)
    return batch


def summary(batch: ScheduledBatch) -> list[tuple[str, int]]:
    """(request id, tokens scheduled) of each sequence in the batch."""
    return [(seq.request_id, n) for seq, n in zip(batch.seqs, batch.num_new_tokens, strict=True)]

"""A step the runner launched whose sampled tokens may still be on their way (async scheduling).

On CUDA the forward, the sampler and the device-to-host copy of the sampled ids are queued on
the stream and ``ModelRunner.launch`` returns at once; the host schedules and launches the next
step meanwhile, and ``ModelRunner.collect`` waits for the copy only when it needs the tokens. On
the CPU every kernel has run by the time ``launch`` returns, so nothing overlaps, but the same
order of events runs (which is how the CPU tests check it).

A step launched before the previous one's tokens are known reads them as placeholders: the
runner writes ``-1 - k`` into the input rows for the previous step's ``k``-th sampled token, and
``fill_placeholders`` replaces those input ids on the device with the sampled ids themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from loraserve.scheduled_batch import ScheduledBatch


class SampledTokens:
    """The sampled ids of one step: on the device now, on the host once ``tokens()`` returns."""

    def __init__(self, device_ids: torch.Tensor, host_buffer: torch.Tensor | None) -> None:
        """``device_ids``: ``[num_sampled]`` int64. ``host_buffer``: pinned int64 memory of at least
        that size (CUDA), which nothing else writes until ``tokens()`` returned."""
        self.device_ids = device_ids  # [num_sampled] int64
        self._ready: torch.cuda.Event | None = None
        if device_ids.device.type == "cuda" and host_buffer is not None:
            self._host = host_buffer[: device_ids.numel()]
            self._host.copy_(device_ids, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = device_ids.to("cpu")
        self._tokens: list[int] | None = None

    def tokens(self) -> list[int]:
        """The ids as Python ints (waits for the step's copy to the host the first time)."""
        if self._tokens is None:
            if self._ready is not None:
                self._ready.synchronize()
            self._tokens = self._host.tolist()
        return self._tokens


@dataclass
class LaunchedStep:
    """What ``ModelRunner.collect`` needs to hand a launched step's tokens to the scheduler."""

    batch: ScheduledBatch
    launch_index: int  # the runner's count of launches, this one included
    sampling_index: list[int] = field(default_factory=list)  # indices into batch.seqs, in sampled-row order
    sampled_rows: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # their input-batch rows
    sampled_positions: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))  # their tokens' places
    sampled: SampledTokens | None = None


def placeholder_codes(num_sampled: int) -> np.ndarray:
    """``[num_sampled]`` int64: the input id standing for the ``k``-th sampled token, ``-1 - k``."""
    return -1 - np.arange(num_sampled, dtype=np.int64)


def fill_placeholders(input_ids: torch.Tensor, previous: torch.Tensor) -> None:
    """Replace, in place and on the device, each placeholder ``-1 - k`` of ``input_ids``
    (``[num_tokens]`` int64) with ``previous[k]`` (``[num_sampled]`` int64, the step before's
    sampled ids). No host synchronisation: a step launched behind that one reads them in order."""
    pending = input_ids < 0  # [num_tokens] bool
    index = (-1 - input_ids).clamp_(0, previous.numel() - 1)  # [num_tokens]
    input_ids.copy_(torch.where(pending, previous.index_select(0, index), input_ids))

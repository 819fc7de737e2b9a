"""What the engine reports: a request's samples, and the ``RequestOutput`` built from them."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraserve.outputs import CompletionOutput, RequestOutput
from loraserve.sequence import Sequence


@dataclass
class Request:
    """One request's samples. With ``n > 1`` only the first is scheduled at first; the
    scheduler forks the others from it, sharing its prompt blocks, once its prompt is computed."""

    request_id: str
    prompt: str | None
    seqs: list[Sequence]
    adapter_name: str | None
    # The prompt's ids, listed once: every output of the request shares this list (streamed
    # requests get an output each step, and copying a long prompt each time is not free).
    prompt_token_ids: list[int] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.prompt_token_ids = self.seqs[0].prompt_token_ids

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


def make_output(request: Request) -> RequestOutput:
    first = request.seqs[0]
    outputs = [
        CompletionOutput(
            index=seq.sample_index,
            text=seq.output_text,
            token_ids=seq.output_token_ids,
            finish_reason=seq.finish_reason.value if seq.finish_reason else None,
            stop_reason=seq.stop_reason,
            logprobs=_logprobs_of_tokens(seq) if seq.params.logprobs is not None else None,
        )
        for seq in request.seqs
    ]
    return RequestOutput(
        request_id=request.request_id,
        prompt=request.prompt,
        prompt_token_ids=request.prompt_token_ids,
        outputs=outputs,
        finished=request.is_finished,
        adapter_name=request.adapter_name,
        num_cached_tokens=first.num_cached_tokens,
        metrics=_token_times(first),
        prompt_logprobs=list(first.prompt_logprobs) if first.params.prompt_logprobs is not None else None,
    )


def _token_times(seq: Sequence) -> dict[str, float]:
    """``RequestOutput.metrics``: the first sample's arrival and, once it has output tokens, the
    times its first and latest reached the host (``time.monotonic()``)."""
    times = {"arrival_time": seq.arrival_time}
    if seq.first_token_time is not None and seq.last_token_time is not None:
        times["first_token_time"] = seq.first_token_time
        times["last_token_time"] = seq.last_token_time
    return times


def _logprobs_of_tokens(seq: Sequence) -> list[dict[int, float]]:
    """One entry per output token. With async scheduling a launched step records its token's entry
    at launch and the token only when collected, so a request ended between the two (a drain's
    deadline) holds one entry more than tokens: that token is never delivered, nor is its entry."""
    return seq.output_logprobs[: len(seq.output_token_ids)]

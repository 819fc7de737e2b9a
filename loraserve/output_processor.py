"""After each step: stop conditions, detokenization and the outputs the engine reports."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loraserve.detokenizer import Detokenizer, find_stop_string
from loraserve.outputs import CompletionOutput, RequestOutput
from loraserve.sequence import FinishReason, Sequence

if TYPE_CHECKING:
    from loraserve.scheduler import Scheduler


@dataclass
class Request:
    """One request's samples. With ``n > 1`` only the first is scheduled at first; the
    others are forked from it, sharing its prompt blocks, once its prompt is computed."""

    request_id: str
    prompt: str | None
    seqs: list[Sequence]
    adapter_name: str | None
    pending_forks: list[Sequence] = field(default_factory=list)

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)


class OutputProcessor:
    """Appends text, ends sequences that meet a stop condition, and builds ``RequestOutput`` s."""

    def __init__(
        self, detokenizer: Detokenizer, scheduler: Scheduler, eos_token_ids: frozenset[int], max_model_len: int
    ) -> None:
        self.detokenizer = detokenizer
        self.scheduler = scheduler
        self.eos_token_ids = eos_token_ids
        self.max_model_len = max_model_len

    def check_stop(self, seq: Sequence, token: int) -> None:
        """Detokenize ``seq``'s new token (or, for a ``final_only`` request without stop strings,
        its whole output once it ends) and finish it if it met a stop condition."""
        params = seq.params
        decode_at_end = params.output_kind == "final_only" and not params.stop
        num_new_chars = 0 if decode_at_end else len(self.detokenizer.update(seq))
        if not params.ignore_eos and token in self.eos_token_ids:
            self.scheduler.finish(seq, FinishReason.STOP)
        elif token in params.stop_token_ids:
            self.scheduler.finish(seq, FinishReason.STOP, token)
        elif params.stop and (found := find_stop_string(seq.output_text, num_new_chars, params.stop)):
            index, stop = found
            seq.output_text = seq.output_text[:index]
            self.scheduler.finish(seq, FinishReason.STOP, stop)
        elif seq.num_output_tokens >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self.scheduler.finish(seq, FinishReason.LENGTH)
        if decode_at_end and seq.is_finished:
            self.detokenizer.update(seq)

    @staticmethod
    def make_output(request: Request) -> RequestOutput:
        first = request.seqs[0]
        outputs = [
            CompletionOutput(
                index=seq.sample_index,
                text=seq.output_text,
                token_ids=seq.output_token_ids,
                finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                stop_reason=seq.stop_reason,
                logprobs=list(seq.output_logprobs) if seq.params.logprobs is not None else None,
            )
            for seq in request.seqs
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=first.prompt_token_ids,
            outputs=outputs,
            finished=request.is_finished,
            adapter_name=request.adapter_name,
            num_cached_tokens=first.num_cached_tokens,
        )

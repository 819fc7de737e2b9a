"""Results handed back to users (the vLLM shape)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[dict[int, float]] | None = None


REQUEST_TOO_LARGE = "request_too_large"  # RequestOutput.error_code: the request cannot fit the pool


@dataclass
class RequestOutput:
    """One request's state after a step; ``finished`` once every sample is done.

    ``text``, ``token_ids`` and ``finish_reason`` are those of the first sample. ``error`` says
    why the engine could not run the request at all (its adapter failed to load); it then
    comes finished, with finish reason ``abort`` and no tokens. ``error_code`` classifies it
    where a caller should act on the kind: ``"registry_unavailable"`` (the adapter registry
    could not be reached: retry later), ``"request_too_large"`` (``REQUEST_TOO_LARGE``: with its
    adapter, now loaded, the request can never fit the pool: the client's to change),
    ``"invalid_adapter"`` (the stored adapter does not parse or does not fit this server: retrying
    cannot help), ``"adapter_not_found"`` (deleted before it was read), else None.
    ``metrics``: the first sample's ``arrival_time`` and, once it has tokens, ``first_token_time``
    and ``last_token_time`` (``time.monotonic()``, on the engine's host).
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    adapter_name: str | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    error: str | None = None
    error_code: str | None = None
    # SamplingParams.prompt_logprobs: per prompt token, token id -> (logprob, rank); None first
    prompt_logprobs: list[dict[int, tuple[float, int]] | None] | None = None

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

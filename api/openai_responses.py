"""Pydantic models of the OpenAI-compatible response bodies, as vLLM serves them (the requests':
openai_protocol.py)."""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class UsageInfo(BaseModel):
    prompt_tokens: int = 0  # in vLLM's order
    total_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class _ResponseHead(BaseModel):
    """The fields every completion body and chunk starts with (``object`` narrowed by each)."""

    id: str
    object: str
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)  # in vLLM's order
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)

    @property
    def text_end(self) -> int:
        """Where the text after these tokens starts (vLLM's next ``text_offset``)."""
        return self.text_offset[-1] + len(self.tokens[-1]) if self.tokens else 0

    def extended(self, later: CompletionLogprobs) -> CompletionLogprobs:
        """These tokens followed by ``later``'s."""
        return CompletionLogprobs(
            text_offset=self.text_offset + later.text_offset,
            token_logprobs=self.token_logprobs + later.token_logprobs,
            tokens=self.tokens + later.tokens,
            top_logprobs=self.top_logprobs + later.top_logprobs,
        )


class PromptLogprob(BaseModel):
    """vLLM's entry of ``prompt_logprobs``, keyed by token id."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]


class _CompletionChoiceHead(BaseModel):
    """The fields a completion choice starts with, in a body and in a chunk."""

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionChoice(_CompletionChoiceHead):
    token_ids: list[int] | None = None  # vLLM's return_token_ids: the choice's tokens
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids: the prompt's tokens


class CompletionResponse(_ResponseHead):
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class _LeavesOutNones(BaseModel):
    """Leaves out the fields named in ``omitted_when_none`` while they are None, as vLLM leaves
    them unset in stream chunks (``usage`` but in the usage chunk, ``role`` but in the first)."""

    omitted_when_none: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _without_nones(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        data = self._unset_fields_left_out(handler(self))
        return {key: value for key, value in data.items() if value is not None or key not in self.omitted_when_none}

    def _unset_fields_left_out(self, data: dict[str, Any]) -> dict[str, Any]:
        return data


class CompletionChunkChoice(_CompletionChoiceHead):
    prompt_token_ids: list[int] | None = None  # return_token_ids: in each choice's first chunk
    token_ids: list[int] | None = None  # return_token_ids: this chunk's tokens


class CompletionChunk(_ResponseHead, _LeavesOutNones):
    omitted_when_none = ("usage",)
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChunkChoice]
    usage: UsageInfo | None = None


class ChatTopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(ChatTopLogprob):
    top_logprobs: list[ChatTopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None


class ChatResponseMessage(BaseModel):
    role: str = "assistant"  # the last message's role without add_generation_prompt (vLLM's)
    content: str | None = None


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatCompletionResponse(_ResponseHead):
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: UsageInfo | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # vLLM's return_token_ids


class ChatDelta(_LeavesOutNones):
    """A chunk's new message part (``{"content": ""}`` for one that only ends its choice, as vLLM's)."""

    omitted_when_none = ("role", "content")
    role: str | None = None
    content: str | None = None


class ChatChunkChoice(_LeavesOutNones):
    """``stop_reason`` is sent only with the ``finish_reason``, as vLLM sends it."""

    omitted_when_none = ("token_ids",)
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token id that ended it
    token_ids: list[int] | None = None  # return_token_ids: this chunk's tokens

    def _unset_fields_left_out(self, data: dict[str, Any]) -> dict[str, Any]:
        if self.finish_reason is None:
            del data["stop_reason"]
        return data


class ChatCompletionChunk(_ResponseHead, _LeavesOutNones):
    omitted_when_none = ("usage", "prompt_token_ids")
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = None  # return_token_ids: in the first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "loraserve"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None  # vLLM's: the base model's context length (None on adapters' cards)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int  # the HTTP status, as vLLM sends it


class ErrorResponse(BaseModel):
    error: ErrorInfo

"""Request and response bodies of Anthropic's Messages API (``POST /v1/messages`` and
``/v1/messages/count_tokens``) with the fields vLLM 0.32's models have. Unknown fields are
ignored (as vLLM's and every request body here); vLLM's output-changing extras that loraserve
does not implement are declared to be refused by name."""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_validator

from .openai_protocol import RequestBody

BlockType = Literal[
    "text",
    "image",
    "tool_use",
    "tool_result",
    "tool_reference",
    "thinking",
    "redacted_thinking",
    "tool_addition",
    "tool_removal",
]


class ContentBlock(RequestBody):
    """One block of a message or of ``system`` (vLLM's flat model: ``type`` and its fields)."""

    type: BlockType
    text: str | None = None
    source: dict[str, Any] | None = None  # image
    id: str | None = None  # tool_use
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None  # tool_result
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None  # thinking
    signature: str | None = None
    data: str | None = None  # redacted_thinking


class Message(RequestBody):
    """One turn: its role and its text (a string, or blocks)."""

    role: Literal["user", "assistant", "system"]
    content: str | list[ContentBlock]


class Tool(RequestBody):
    """A tool the model may call (declared to be refused: no tool-call parser)."""

    name: str
    description: str | None = None
    input_schema: dict[str, Any]


class ToolChoice(RequestBody):
    """Whether and which tool to call (only ``none`` is served)."""

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class Thinking(RequestBody):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(None, ge=1024)
    display: Literal["summarized", "omitted", "updates"] | None = None


class OutputFormat(RequestBody):
    type: Literal["json_schema"] = "json_schema"
    json_schema: dict[str, Any] | None = Field(None, alias="schema")


class OutputConfig(RequestBody):
    effort: Literal["low", "medium", "high", "xhigh", "max"] | None = None
    format: OutputFormat | None = None


class _Conversation(RequestBody):
    """What both routes read: the model, the conversation, and what shapes its prompt."""

    model: str = Field(min_length=1)
    messages: list[Message]
    system: str | list[ContentBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    output_config: OutputConfig | None = None
    chat_template_kwargs: dict[str, Any] | None = None


class MessagesRequest(_Conversation):
    """``POST /v1/messages``."""

    REFUSED: ClassVar[tuple[str, ...]] = ("vllm_xargs", "kv_transfer_params", "ec_transfer_params", "watermarking")
    max_tokens: int = Field(gt=0)
    metadata: dict[str, Any] | None = None  # accepted and unused, as vLLM's
    stop_sequences: list[str] | None = None
    stream: bool | None = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=1024)
    # Declared only to refuse them (vLLM's extras that loraserve does not implement).
    vllm_xargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    watermarking: bool | None = None

    @model_validator(mode="after")
    def _budget_under_max_tokens(self) -> MessagesRequest:
        budget = self.thinking.budget_tokens if self.thinking is not None else None
        if budget is not None and budget >= self.max_tokens:  # vLLM's rule and message
            raise ValueError("thinking.budget_tokens must be less than max_tokens")
        return self


class CountTokensRequest(_Conversation):
    """``POST /v1/messages/count_tokens``: the prompt's tokens, nothing generated."""


class TextBlock(BaseModel):
    type: Literal["text"] = "text"
    text: str


class Usage(BaseModel):
    """Anthropic's counts: ``input_tokens`` those neither read from nor written to the prefix cache."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int = 0
    cache_creation_input_tokens: int = 0


StopReason = Literal["end_turn", "max_tokens", "stop_sequence"]


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[TextBlock]
    model: str
    stop_reason: StopReason | None
    stop_sequence: str | None = None
    usage: Usage


class ErrorDetail(BaseModel):
    type: str  # vLLM's type names: BadRequestError, NotFoundError, ...
    message: str


class ErrorResponse(BaseModel):
    """Anthropic's error shape, which vLLM gives errors raised while a request is handled."""

    type: Literal["error"] = "error"
    error: ErrorDetail


class CountTokensResponse(BaseModel):
    input_tokens: int
    context_management: dict[str, int]  # vLLM's: {"original_input_tokens": the same count}

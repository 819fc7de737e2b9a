"""Pydantic models of ``/v1/responses`` (OpenAI's Responses API, text in and out, as vLLM 0.32 serves
it for a chat model without tool or reasoning parsers): the request body and the response object.

Unknown request fields are ignored, as vLLM ignores them (``n``, ``stream_options``,
``response_format`` are not fields of this API). Fields loraserve cannot honour are declared so
that ``routes_responses.py`` refuses a value other than the default with a 400 naming them.
"""

from __future__ import annotations

from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field

from .openai_protocol import MAX_LOGPROBS, RequestBody
from .openai_responses import ChatTokenLogprob

LOGPROBS_INCLUDE = "message.output_text.logprobs"
# OpenAI's ``include`` values; only the logprobs one applies to a text model's output (vLLM's set).
IncludeValue = Literal[
    "code_interpreter_call.outputs",
    "computer_call_output.output.image_url",
    "file_search_call.results",
    "message.input_image.image_url",
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
]


class ReasoningConfig(RequestBody):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # echoed: no reasoning parser to summarise
    generate_summary: Literal["auto", "concise", "detailed"] | None = None


class TextConfig(RequestBody):
    """``text``: ``format`` is ``{"type": "text"}``, ``{"type": "json_object"}`` or
    ``{"type": "json_schema", "name": ..., "schema": {...}}`` (OpenAI's flat form)."""

    format: dict[str, Any] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # echoed only, as vLLM


class ResponsesRequest(RequestBody):
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ("stream", "top_logprobs", "tools", "store", "background")
    model: str | None = Field(None, description="The base model id (the default), or a registered adapter's name")
    input: str | list[dict[str, Any]] = Field(
        description="A user message's text, or a list of message items (role user, system, developer or assistant)"
    )
    instructions: str | None = Field(None, description="A system message put before the input")
    max_output_tokens: int | None = Field(None, ge=1, description="Default: as many as the context leaves")
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, description="vLLM extension: -1 or None is off")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="vLLM extension")
    repetition_penalty: float | None = Field(None, gt=0.0, description="vLLM extension")
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)
    stop: str | list[str] | None = Field(None, description="vLLM extension")
    stop_token_ids: list[int] | None = Field(None, description="vLLM extension")
    ignore_eos: bool = Field(False, description="vLLM extension")
    include_stop_str_in_output: bool = Field(False, description="vLLM extension")
    skip_special_tokens: bool = Field(True, description="vLLM extension")
    stream: bool = False
    store: bool = Field(True, description="Accepted; nothing is stored (vLLM's default), so no retrieval")
    background: bool = Field(False, description="Refused when true (it needs storage)")
    previous_response_id: str | None = Field(None, description="Nothing is stored: any id is not found (404)")
    include: list[IncludeValue] | None = Field(None, description=f"{LOGPROBS_INCLUDE!r} turns logprobs on")
    top_logprobs: int = Field(0, ge=0, le=MAX_LOGPROBS, description=f"Only with {LOGPROBS_INCLUDE!r} in include")
    text: TextConfig | None = None
    reasoning: ReasoningConfig | None = Field(None, description="effort goes to the chat template, as in chat")
    tools: list[dict[str, Any]] = Field(default_factory=list, description="Refused when not empty")
    tool_choice: Literal["auto", "none", "required"] | dict[str, Any] = "auto"
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    truncation: Literal["auto", "disabled"] | None = Field("disabled", description="auto is refused")
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: Literal["auto", "default", "flex", "scale", "priority"] = "auto"
    prompt: dict[str, Any] | None = Field(None, description="Prompt templates: refused")
    request_id: str | None = Field(None, description="vLLM extension: the response id (default resp_ and hex)")
    priority: int = 0
    cache_salt: str | None = Field(None, min_length=1, description="vLLM extension")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM extension")
    structured_outputs: dict[str, Any] | None = Field(None, description="vLLM extension (not with text.format)")
    # vLLM's fields that change the output and that loraserve does not implement: refused when set.
    REFUSED: ClassVar[tuple[str, ...]] = (
        "vllm_xargs", "kv_transfer_params", "ec_transfer_params", "watermarking", "enable_response_messages"
    )  # fmt: skip
    vllm_xargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None
    ec_transfer_params: dict[str, Any] | None = None
    watermarking: Any = None
    enable_response_messages: bool = False


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatTokenLogprob] | None = None  # the chat shape: token, logprob, bytes, top_logprobs


class OutputMessage(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    status: Literal["in_progress", "completed"] = "completed"
    content: list[OutputText] = Field(default_factory=list)


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0  # prefix-cache hits
    cache_write_tokens: int = 0  # prompt tokens computed and put in the prefix cache (full blocks)


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


class ResponseObject(BaseModel):
    """The response, with the request's settings as they took effect (vLLM's echo: the effective
    ``max_output_tokens``, ``temperature`` and ``top_p``; ``tool_choice`` "none" without tools)."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: dict[str, str] | None = None
    model: str
    output: list[OutputMessage]
    usage: ResponseUsage | None = None
    instructions: str | None
    metadata: dict[str, str] | None
    parallel_tool_calls: bool
    temperature: float
    tool_choice: str | dict[str, Any]
    tools: list[dict[str, Any]]
    top_p: float
    background: bool = False
    max_output_tokens: int
    max_tool_calls: int | None
    previous_response_id: str | None = None
    prompt: None = None
    reasoning: ReasoningConfig | None
    service_tier: str
    text: TextConfig | None
    top_logprobs: int | None
    truncation: str
    user: str | None
    presence_penalty: float
    frequency_penalty: float

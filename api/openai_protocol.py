"""Pydantic models of the OpenAI-compatible request bodies (responses: openai_responses.py; the adapter API's:
adapter_protocol.py).

Unknown request fields are ignored (clients send many optional fields); fields whose
non-default values loraserve cannot honour are declared so the route can refuse them with a
clear 400 instead of silently ignoring them (see :func:`unsupported_fields`).
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

MAX_N = 1024  # a ceiling of the schema; the server's own limit is ServerSettings.max_n
MAX_LOGPROBS = 20


class RequestBody(BaseModel):
    """Base of every request body: unknown fields are ignored (clients send many optional ones).
    ``NULL_IS_DEFAULT``: fields that OpenAI's schema and vLLM let a client send as null, meaning
    the field's default."""

    model_config = ConfigDict(extra="ignore")
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ()

    @model_validator(mode="before")
    @classmethod
    def _null_is_default(cls, data: Any) -> Any:
        if isinstance(data, dict) and any(data.get(name, 0) is None for name in cls.NULL_IS_DEFAULT):
            return {key: value for key, value in data.items() if not (value is None and key in cls.NULL_IS_DEFAULT)}
        return data


class StreamOptions(RequestBody):
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ("include_usage", "continuous_usage_stats")
    include_usage: bool = False  # vLLM 0.32's default: stream_options {} asks for no usage chunk
    continuous_usage_stats: bool = False  # vLLM's: usage (so far) in every chunk


class _SamplingFields(RequestBody):
    """Fields shared by completions and chat completions."""

    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ("n", "stream")
    model: str | None = Field(
        None, description="The base model id (the default, also when empty), or a registered adapter's name"
    )
    temperature: float | None = Field(
        None, ge=0.0, le=2.0, description="0 is greedy; default the model's generation config's, else 1"
    )
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, description="loraserve extension: -1 or None is off")
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, description="loraserve extension")
    seed: int | None = Field(None, ge=-(2**63), lt=2**63)  # vLLM's range: any 64-bit signed integer
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = Field(False, description="loraserve extension: keep generating past EOS")
    user: str | None = None
    cache_salt: str | None = Field(
        None,
        min_length=1,
        description="vLLM extension: requests share cached prompt blocks only with requests of the same salt",
    )
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = Field(None, description="token id (as a string) -> bias in [-100, 100]")
    repetition_penalty: float | None = Field(None, gt=0.0, description="vLLM extension: 1 is off")
    min_p: float | None = Field(None, ge=0.0, le=1.0, description="vLLM extension: 0 is off")
    min_tokens: int | None = Field(None, ge=0, description="vLLM extension: no EOS or stop before this many")
    include_stop_str_in_output: bool = Field(False, description="vLLM extension: keep the stop string")
    # vLLM's other sampling extensions, declared so that a value loraserve cannot honour is refused
    # with a 400 naming it (see unsupported_fields) instead of being ignored.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    skip_special_tokens: bool = Field(True, description="vLLM extension: special tokens' text left out")
    spaces_between_special_tokens: bool = Field(
        True, description="vLLM extension: the tokenizer's decode option (no effect with fast tokenizers, as in vLLM)"
    )
    truncate_prompt_tokens: int | None = None
    prompt_logprobs: int | None = Field(
        None, ge=0, le=MAX_LOGPROBS, description="vLLM extension: logprobs of the prompt tokens and the top ones"
    )
    allowed_token_ids: list[int] | None = Field(None, min_length=1, description="vLLM extension: only these ids")
    bad_words: list[str] | None = Field(None, description="vLLM extension: words never generated")
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    response_format: dict[str, Any] | None = Field(
        None, description="text, json_object or json_schema (OpenAI's); read by structured_request.py"
    )
    structured_outputs: dict[str, Any] | None = Field(
        None, description="vLLM extension: one of json, json_object, regex, choice, grammar"
    )
    structural_tag: str | None = None  # vLLM's structured-output extension: refused (unsupported_fields)
    best_of: int | None = Field(None, ge=1)  # only best_of == n is honoured (unsupported_fields)
    logits_processors: list[Any] | None = None
    return_tokens_as_token_ids: bool = False
    return_token_ids: bool | None = Field(None, description="vLLM extension: the prompt's and choices' token ids")
    priority: int = 0  # vLLM refuses a priority unless its scheduler runs by priority (here: first come)
    request_id: str | None = Field(None, description="vLLM extension: the response id's suffix (X-Request-Id first)")
    # vLLM 0.32's fields that change the output and that loraserve does not implement: refused.
    logprob_token_ids: list[int] | None = None
    repetition_detection: dict[str, Any] | None = None
    thinking_token_budget: int | None = None
    vllm_xargs: dict[str, Any] | None = None
    kv_transfer_params: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ("n", "stream", "echo")
    prompt: str | list[str] | list[int] | list[list[int]] = Field(
        description="A string, a list of strings, a list of token ids, or a list of token-id lists"
    )
    max_tokens: int | None = Field(
        None, ge=0, description="16 when left out or null (vLLM's default); 0 only with echo: the prompt scored"
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    add_special_tokens: bool = Field(True, description="vLLM extension: the tokenizer's special tokens (BOS)")
    prompt_embeds: Any = None


class TextContentPart(RequestBody):
    type: str
    text: str | None = None


class ToolCallFunction(RequestBody):
    name: str
    arguments: str | dict[str, Any] | None = Field(None, description="JSON text (OpenAI's form) or an object")


class ToolCall(RequestBody):
    """A tool call in an assistant message of the history (handed to the chat template)."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(RequestBody):
    role: str = Field(min_length=1, description="Any role the chat template takes (a developer message: system)")
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # assistant messages: the calls it made
    tool_call_id: str | None = None  # tool messages: the call this answers


class ChatFields(_SamplingFields):
    """A chat completion request's fields but its ``messages`` (one conversation, or a batch's several)."""

    NULL_IS_DEFAULT: ClassVar[tuple[str, ...]] = ("n", "stream", "logprobs")
    max_tokens: int | None = Field(None, ge=1, description="Deprecated alias of max_completion_tokens")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = Field(True, description="loraserve extension (as in vLLM)")
    continue_final_message: bool = Field(False, description="vLLM extension: the last message left open")
    add_special_tokens: bool = Field(False, description="vLLM extension: special tokens added to the template's")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="vLLM extension: template variables")
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = Field(
        None, description="To the chat template, with enable_thinking (false for none), as vLLM hands them over"
    )
    # Declared only to refuse them (see unsupported_fields).
    chat_template: str | None = None  # vLLM too, unless started with --trust-request-chat-template
    echo: bool = False
    documents: list[dict[str, Any]] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    audio: dict[str, Any] | None = None
    modalities: list[str] | None = None
    web_search_options: dict[str, Any] | None = None


class ChatCompletionRequest(ChatFields):
    messages: list[ChatMessage] = Field(min_length=1)


class BatchChatCompletionRequest(ChatFields):
    """vLLM's ``/v1/chat/completions/batch``: the chat fields, with one conversation per item of
    ``messages``, each answered by its own choice."""

    messages: list[Annotated[list[ChatMessage], Field(min_length=1)]] = Field(min_length=1)


class TokenizeRequest(RequestBody):
    """vLLM's ``/tokenize`` body: a ``prompt``, or chat ``messages`` rendered by the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    add_special_tokens: bool | None = Field(None, description="default: true for a prompt, false for messages")
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False
    chat_template: str | None = None  # refused, as in chat completions
    tools: list[dict[str, Any]] | None = None  # refused, as in chat completions


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def unsupported_fields(request: _SamplingFields) -> list[str]:
    """Names of fields set to values loraserve cannot honour."""
    defaults: dict[str, Any] = {
        "use_beam_search": False,
        "length_penalty": 1.0,
        "return_tokens_as_token_ids": False,
        "priority": 0,
    }
    bad = [name for name, default in defaults.items() if getattr(request, name) != default]
    unset = ("truncate_prompt_tokens", "guided_json", "guided_regex", "guided_choice", "guided_grammar")
    vllm_only = (
        "logprob_token_ids",
        "repetition_detection",
        "thinking_token_budget",
        "vllm_xargs",
        "kv_transfer_params",
    )
    for name in (*unset, "structural_tag", "logits_processors", *vllm_only):
        if getattr(request, name) not in (None, [], {}):  # vLLM reads an empty list or object as unset
            bad.append(name)
    if request.best_of is not None and request.best_of != request.n:
        bad.append("best_of")
    if isinstance(request, CompletionRequest):
        if request.suffix:
            bad.append("suffix")
        if request.prompt_embeds is not None:
            bad.append("prompt_embeds")
    if isinstance(request, ChatFields):
        if request.tools:
            bad.append("tools")
        for name in ("chat_template", "documents"):
            if getattr(request, name) is not None:
                bad.append(name)
        if request.tool_choice not in (None, "none") and request.tools:  # tools are refused above
            bad.append("tool_choice")
        for name in ("functions", "function_call", "audio", "web_search_options"):
            if getattr(request, name) is not None:
                bad.append(name)
        if request.modalities is not None and set(request.modalities) != {"text"}:
            bad.append("modalities")
    return bad

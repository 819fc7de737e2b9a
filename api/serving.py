"""What every inference route shares: the server state, model -> adapter resolution, sampling
parameters, submission of engine requests, and the mapping of engine errors to HTTP errors."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from fastapi import Request
from loraserve.adapters import RegistryUnavailableError

from loraserve.input_processor import RequestError
from loraserve.llm_engine import LLMEngine, UnknownAdapterError
from loraserve.outputs import RequestOutput
from loraserve.sampling_params import SamplingParams, SamplingParamsError
from loraserve.structured_outputs import StructuredOutputsParams

from .async_engine import AsyncEngine, EngineDeadError, RequestStream
from .errors import APIError, registry_unavailable
from .limits import InFlightLimiter
from .metrics import ServerMetrics
from .openai_protocol import _SamplingFields, unsupported_fields
from .prompt_encoder import PromptEncoder
from .request_stream import EngineDrainingError
from .settings import ServerSettings
from .stats_reader import StatsReader

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass
class ServerState:
    """Everything a route needs; one per app (``app.state.server``).

    ``tokenizer`` is the API's own tokenizer instance (chat templates, token strings for
    logprobs, echo, short prompts; ``prompts`` tokenizes long ones with an instance of its own):
    the engine's is used only on the engine thread. Calls to the adapter registry are the one
    exception to "only the engine thread touches the engine": they wait on the registry, so they
    run on worker threads (:func:`registry_call`).
    """

    engine: LLMEngine
    async_engine: AsyncEngine
    settings: ServerSettings
    tokenizer: Any
    metrics: ServerMetrics
    in_flight: InFlightLimiter
    prompts: PromptEncoder  # prompt texts to token ids, long ones off the event loop
    stats: StatsReader  # the engine's stats for /health and /metrics, not waiting out a long step
    # The chat template refuses system messages after the first turn: /v1/messages then merges
    # inline ones into the leading system message (vLLM's rule; see chat_template.refuses_inline_system).
    merge_inline_system: bool

    @property
    def supports_adapters(self) -> bool:
        return hasattr(self.engine, "adapter_registry")

    def token_text(self, token_id: int) -> str:
        """The text of one token as the OpenAI API shows it (decoded, not the BPE symbol)."""
        return str(self.tokenizer.decode([token_id]))

    def max_new_tokens(self, num_prompt_tokens: int) -> int:
        """The largest max_tokens a prompt of this length can ask for."""
        limit = min(self.engine.max_model_len, self.engine.max_seq_tokens)
        return max(1, limit - num_prompt_tokens)


async def registry_call(state: ServerState, fn: Callable[[Any], T]) -> T:
    """``fn(engine)`` on a worker thread: adapter registry calls (register, remove, list, describe)
    may wait on the registry (Redis), and the engine thread must keep stepping meanwhile. Only the
    engine's registry-facing methods, which are thread-safe, may be called this way."""
    return await asyncio.to_thread(fn, state.engine)


def get_state(request: Request) -> ServerState:
    state: ServerState = request.app.state.server
    return state


def new_id(prefix: str, request: Request | None = None, body_id: str | None = None) -> str:
    """A response id, as vLLM makes it: ``prefix-`` and the ``X-Request-Id`` header, else the
    body's ``request_id``, else a random hex id."""
    given = request.headers.get("x-request-id") if request is not None else None
    return f"{prefix}-{given or body_id or uuid.uuid4().hex}"


def resolve_adapter(state: ServerState, model: str) -> str | None:
    """``None`` for the base model id, else the adapter name (checked by the engine at submission)."""
    if model == state.settings.model_id:
        return None
    if not state.supports_adapters:
        raise model_not_found(model, state)
    return model


def model_not_found(model: str, state: ServerState) -> APIError:
    return APIError(
        404,
        f"the model {model!r} does not exist: use {state.settings.model_id!r} for the base model or the "
        "name of a registered adapter (GET /v1/models lists them)",
        param="model",
    )


def sampling_params(
    request: _SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    defaults: Mapping[str, float | int],
    *,
    n: int | None = None,
    prompt_logprobs: int | None = None,
    structured_outputs: StructuredOutputsParams | None = None,
) -> SamplingParams:
    """Build engine sampling parameters, refusing unsupported fields with a 400 (``prompt_logprobs``:
    the request's unless given). A field left out takes ``defaults``' value (the server's, from
    the model's generation config), else OpenAI's: vLLM's order."""
    bad = unsupported_fields(request)
    if bad:
        raise APIError(400, f"unsupported parameter(s) {bad}: loraserve does not implement them", param=bad[0])
    if request.stream_options is not None and request.stream_options.model_fields_set and not request.stream:
        raise APIError(400, "stream_options can only be given with stream=true", param="stream_options")
    if request.prompt_logprobs is not None and request.stream:
        raise APIError(400, "prompt_logprobs is not supported with stream=true", param="prompt_logprobs")

    def value(name: str, openai_default: float) -> float:
        sent: float | None = getattr(request, name)
        return sent if sent is not None else defaults.get(name, openai_default)

    temperature = value("temperature", 1.0)
    if request.n > 1 and temperature == 0:  # vLLM's rule (its SamplingParams)
        raise APIError(400, f"n must be 1 when using greedy sampling, got {request.n}.", param="n")
    top_k = int(value("top_k", -1))
    stop = [request.stop] if isinstance(request.stop, str) else list(request.stop or [])
    try:
        logit_bias = {int(token): bias for token, bias in (request.logit_bias or {}).items()}
    except ValueError:
        raise APIError(400, "logit_bias keys must be token ids (integers as strings)", param="logit_bias") from None
    try:
        return SamplingParams(
            n=request.n if n is None else n,
            temperature=temperature,
            top_p=value("top_p", 1.0),
            top_k=-1 if top_k == 0 else top_k,
            seed=None if request.seed == -1 else request.seed,  # vLLM's: -1 is a random seed
            max_tokens=max_tokens,
            lower_max_tokens_to_pool=True,  # the rule output_budgets states, with the adapter's pages
            stop=tuple(stop),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            logprobs=logprobs,
            prompt_logprobs=request.prompt_logprobs if prompt_logprobs is None else prompt_logprobs,
            presence_penalty=value("presence_penalty", 0.0),
            frequency_penalty=value("frequency_penalty", 0.0),
            repetition_penalty=value("repetition_penalty", 1.0),
            min_p=value("min_p", 0.0),
            logit_bias=tuple(logit_bias.items()),
            min_tokens=request.min_tokens or 0,
            include_stop_str_in_output=request.include_stop_str_in_output,
            skip_special_tokens=request.skip_special_tokens,
            spaces_between_special_tokens=request.spaces_between_special_tokens,
            allowed_token_ids=None if request.allowed_token_ids is None else tuple(request.allowed_token_ids),
            bad_words=tuple(request.bad_words or ()),
            structured_outputs=structured_outputs,  # structured_request.py's reading of the request
            # A plain JSON response needs only the finished output (no per-step outputs or text).
            output_kind="cumulative" if request.stream else "final_only",
        )
    except SamplingParamsError as error:
        raise APIError(400, str(error)) from None


def engine_error(error: Exception, model: str, state: ServerState) -> APIError:
    """The HTTP error for an exception from ``add_request``."""
    if isinstance(error, UnknownAdapterError):
        return model_not_found(model, state)
    if isinstance(error, RegistryUnavailableError):  # before ValueError: it is one, but not the client's fault
        return registry_unavailable(error)
    if isinstance(error, EngineDrainingError):
        return APIError(503, "the server is shutting down: it takes no new requests")
    if isinstance(error, EngineDeadError):
        return APIError(503, f"the engine is not running: {error}")
    if isinstance(error, RequestError | SamplingParamsError | ValueError):
        return APIError(400, str(error))
    logger.exception("add_request failed")
    return APIError(500, f"the engine could not accept the request: {type(error).__name__}: {error}")


async def submit(
    state: ServerState,
    request_id: str,
    prompts: Sequence[str | list[int]],
    params: list[SamplingParams],
    adapter_name: str | None,
    model: str,
    cache_salt: str | None = None,
) -> list[RequestStream]:
    """Add one engine request per prompt (with ``params[i]``); all or nothing. The engine's ids are
    ``{request_id}-{i}-`` and a random suffix: a client may choose ``request_id`` (vLLM's
    ``X-Request-Id``), and two requests in flight may not share an engine id."""
    streams: list[RequestStream] = []
    unique = uuid.uuid4().hex[:12]
    try:
        for index, (prompt, prompt_params) in enumerate(zip(prompts, params, strict=True)):
            streams.append(
                await state.async_engine.add_request(
                    f"{request_id}-{index}-{unique}", prompt, prompt_params, adapter_name, cache_salt=cache_salt
                )
            )
    except BaseException as error:
        for stream in streams:
            stream.abort()
        if isinstance(error, Exception):
            raise engine_error(error, model, state) from None
        raise
    return streams


def check_request_limits(state: ServerState, n: int, prompt_lengths: list[int], max_tokens: int | None) -> None:
    """The operator's limits on ``n``, prompt length and ``max_tokens`` (``ServerSettings``): a 400
    naming the field past one of them."""
    settings = state.settings
    if n > settings.max_n:
        raise APIError(400, f"n={n} is above this server's limit of {settings.max_n} (--max-n)", param="n")
    limit = settings.max_prompt_tokens
    if limit is not None and prompt_lengths and max(prompt_lengths) > limit:
        raise APIError(
            400,
            f"the prompt has {max(prompt_lengths)} tokens, above this server's limit of {limit} (--max-prompt-tokens)",
            param="prompt",
        )
    limit = settings.max_output_tokens
    if limit is not None and max_tokens is not None and max_tokens > limit:
        raise APIError(
            400,
            f"max_tokens={max_tokens} is above this server's limit of {limit} (--max-output-tokens)",
            param="max_tokens",
        )


def require_json(request: Request) -> None:
    """vLLM's check of a JSON route: the body must say it is JSON (``Content-Type: application/json``)."""
    media_type = request.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media_type != "application/json":
        raise APIError(400, "Unsupported Media Type: Only 'application/json' is allowed")


def prefix_cache_writes(state: ServerState, final: RequestOutput) -> int:
    """The prompt tokens a request wrote to the prefix cache, as vLLM counts them: those in full
    blocks (the cache registers those once computed) less the ones it found there."""
    config = state.engine.config
    prompt = len(final.prompt_token_ids)
    in_full_blocks = prompt // config.block_size * config.block_size if config.enable_prefix_caching else 0
    return max(0, in_full_blocks - final.num_cached_tokens)


def limited_max_tokens(state: ServerState, default: int) -> int:
    """A default ``max_tokens`` capped by the operator's ``max_output_tokens``."""
    limit = state.settings.max_output_tokens
    return default if limit is None else min(default, limit)


def output_budgets(
    state: ServerState, prompt_lengths: list[int], asked: int | None, default: int | None, field: str, prompt_field: str
) -> list[int]:
    """Each prompt's ``max_tokens`` as vLLM sets it: ``asked`` (or ``default``; None: as many as
    fit), lowered to the room the context leaves after that prompt. A 400 naming ``field`` when
    ``asked`` alone is longer than the context, or ``prompt_field`` when a prompt leaves no room."""
    max_model_len = state.engine.max_model_len
    if asked is not None and asked > max_model_len:
        raise APIError(
            400,
            f"{field}={asked} cannot be greater than max_model_len={max_model_len}. "
            "Please request fewer output tokens.",
            param=field,
        )
    budgets = []
    for length in prompt_lengths:
        if length >= max_model_len:
            raise APIError(
                400,
                f"This model's maximum context length is {max_model_len} tokens. However, your prompt contains "
                f"{length} input tokens, which leaves no room for output tokens. Please reduce the length of "
                "the input prompt.",
                param=prompt_field,
            )
        room = state.max_new_tokens(length)
        wanted = asked if asked is not None else limited_max_tokens(state, room if default is None else default)
        budgets.append(min(wanted, room))
    return budgets

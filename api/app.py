"""The FastAPI application factory."""

from __future__ import annotations

import copy
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI

from loraserve.llm_engine import LLMEngine

from . import (
    routes_adapters,
    routes_chat,
    routes_chat_batch,
    routes_completions,
    routes_invocations,
    routes_messages,
    routes_models,
    routes_responses,
    routes_tokenize,
)
from .async_engine import AsyncEngine
from .chat_template import refuses_inline_system
from .errors import install_error_handlers
from .limits import InFlightLimiter, RequestBodyLimit
from .metrics import ServerMetrics
from .prompt_encoder import PromptEncoder
from .serving import ServerState
from .settings import ServerSettings
from .stats_reader import StatsReader

logger = logging.getLogger(__name__)

_DESCRIPTION = """OpenAI-compatible multi-LoRA serving. Pass an adapter's name as `model` to use it,
the base model's id for the base model. Errors use the OpenAI shape
`{"error": {"message", "type", "param", "code"}}`."""


def _api_tokenizer(engine: LLMEngine) -> Any:
    """A tokenizer instance of the API's own, so the event loop never shares one with the engine thread."""
    try:
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(engine.model_dir)
    except (OSError, ValueError):
        return copy.deepcopy(engine.tokenizer)


def create_app(engine: LLMEngine, settings: ServerSettings) -> FastAPI:
    """An app serving ``engine`` (already loaded) with ``settings``.

    The engine loop thread starts with the app (lifespan startup, or lazily on the first
    request) and stops at shutdown, aborting whatever is still in flight. The app owns the
    engine from then on: nothing else may call the engine while the app is running.
    """
    metrics = ServerMetrics(settings.model_id, engine.max_model_len)
    async_engine = AsyncEngine(engine, observer=metrics)
    limiter = InFlightLimiter(settings.max_requests_per_key, settings.api_key, settings.admin_key)
    tokenizer = _api_tokenizer(engine)
    prompts = PromptEncoder(tokenizer, _api_tokenizer(engine))  # its worker thread's own instance
    merge_system = refuses_inline_system(tokenizer)
    if merge_system and getattr(tokenizer, "chat_template", None) is not None:
        logger.warning(
            "the chat template refuses system messages after the first turn: /v1/messages merges inline system "
            "messages into the leading one (each new one changes the prompt's prefix, so the prefix cache misses)"
        )
    stats = StatsReader(async_engine)
    state = ServerState(engine, async_engine, settings, tokenizer, metrics, limiter, prompts, stats, merge_system)
    if settings.adapter_key is None:
        logger.warning("no --admin-key or --api-key: anyone who can reach the server can change adapters")

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        async_engine.start()
        try:
            yield
        finally:
            try:
                async_engine.shutdown()
            finally:
                prompts.close()

    app = FastAPI(title="loraserve", description=_DESCRIPTION, version="0.1.0", lifespan=lifespan)
    app.state.server = state
    app.state.settings = settings
    install_error_handlers(app)
    app.add_middleware(RequestBodyLimit, max_bytes=settings.max_request_body_bytes)
    inference = (routes_completions, routes_chat, routes_chat_batch, routes_responses, routes_messages)
    for module in (*inference, routes_invocations, routes_tokenize, routes_models, routes_adapters):
        app.include_router(module.router)
    return app

"""``POST /tokenize`` and ``POST /detokenize`` with vLLM's request and response shapes."""

from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from loraserve.adapters import InvalidAdapterNameError, RegistryUnavailableError

from .auth import require_api_key
from .chat_template import render_chat_prompt
from .errors import APIError, registry_unavailable
from .openai_protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from .routes_completions import ERROR_RESPONSES
from .serving import ServerState, get_state, model_not_found, registry_call, require_json, resolve_adapter

router = APIRouter(tags=["inference"])


async def _check_model(state: ServerState, model: str | None) -> None:
    """404 for a ``model`` that is neither the base model nor a registered adapter (adapters share
    the base model's tokenizer, so the answer does not depend on which)."""
    name = None if not model else resolve_adapter(state, model)  # none or empty: the base model, as vLLM
    if name is None:
        return
    try:
        known = await registry_call(state, lambda engine: engine.adapter_registry.contains(name))
    except InvalidAdapterNameError:  # a name no adapter can have
        known = False
    except RegistryUnavailableError as error:
        raise registry_unavailable(error) from None
    if not known:
        raise model_not_found(name, state)


@router.post(
    "/tokenize",
    response_model=TokenizeResponse,
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_api_key), Depends(require_json)],
    summary="Token ids of a prompt, or of chat messages through the chat template (vLLM's shape)",
)
async def tokenize(body: TokenizeRequest, request: Request) -> TokenizeResponse:
    state = get_state(request)
    await _check_model(state, body.model)
    if (body.prompt is None) == (body.messages is None):
        raise APIError(400, "give exactly one of prompt and messages", param="prompt")
    if body.messages is not None:
        for name in ("chat_template", "tools"):
            if getattr(body, name) is not None:
                raise APIError(400, f"{name} is not supported (the model's own chat template renders)", param=name)
        add_special = bool(body.add_special_tokens)  # the template already has the special tokens
        tokens = await render_chat_prompt(
            state,
            body.messages,
            body.add_generation_prompt,
            add_special,
            body.continue_final_message,
            body.chat_template_kwargs,
        )
    else:
        add_special = True if body.add_special_tokens is None else body.add_special_tokens
        assert body.prompt is not None  # exactly one of the two, checked above
        tokens = await state.prompts.encode(body.prompt, add_special)
    strs = state.tokenizer.convert_ids_to_tokens(tokens) if body.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=state.engine.max_model_len, tokens=tokens, token_strs=strs)


@router.post(
    "/detokenize",
    response_model=DetokenizeResponse,
    responses=ERROR_RESPONSES,
    dependencies=[Depends(require_api_key), Depends(require_json)],
    summary="The text of token ids (vLLM's shape)",
)
async def detokenize(body: DetokenizeRequest, request: Request) -> DetokenizeResponse:
    state = get_state(request)
    await _check_model(state, body.model)
    vocab = int(state.engine.hf_config.vocab_size)
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise APIError(400, f"tokens {bad[:5]} are outside the vocabulary [0, {vocab})", param="tokens")
    return DetokenizeResponse(prompt=state.tokenizer.decode(body.tokens))

"""Adapter management: upload, list, inspect, delete, and the vLLM-compatible load/unload calls.

Every call runs on a worker thread (``registry_call``), never the engine thread: it waits on the
registry (Redis), and the engine keeps stepping meanwhile. A change is in this replica's catalog
when the call returns, so the next request sees it; other replicas see it when the registry's
message reaches them. Removing an adapter stops new requests from using it; requests already
running on it finish (the engine's contract for ``remove_adapter``). With the registry
unreachable, every call here answers 503 naming it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, PlainTextResponse
from loraserve.adapters import (
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    AdapterTooLargeError,
    RegistryConflictError,
    RegistryUnavailableError,
)

from .adapter_protocol import AdapterCard, AdapterDeleted, AdapterList, LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from .auth import require_admin_key, require_api_key
from .errors import APIError, registry_unavailable
from .openai_responses import ErrorResponse
from .routes_models import list_adapter_infos
from .serving import ServerState, UnknownAdapterError, get_state, registry_call, require_json
from .uploads import read_adapter_upload, read_confined_adapter_dir

router = APIRouter(tags=["adapters"])

_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorResponse} for code in (400, 401, 403, 404, 409, 413, 503)
}
_UPLOAD_BODY = {
    "requestBody": {
        "required": True,
        "content": {
            "multipart/form-data": {
                "schema": {
                    "type": "object",
                    "required": ["name", "files"],
                    "properties": {
                        "name": {"type": "string", "description": "The adapter's name (used as `model`)"},
                        "files": {
                            "type": "array",
                            "items": {"type": "string", "format": "binary"},
                            "description": "adapter_config.json and adapter_model.safetensors, or one "
                            ".zip / .tar.gz / .tar of the adapter directory",
                        },
                    },
                }
            }
        },
    }
}


def adapter_card(info: Any) -> AdapterCard:
    return AdapterCard(
        id=info.name,
        rank=info.rank,
        ranks=dict(info.ranks) if isinstance(info.ranks, dict) else info.ranks,
        target_modules=list(info.target_modules),
        digest=info.digest,
        num_bytes=info.num_bytes,
        num_parameters=info.num_parameters,
    )


def _require_adapter_support(state: ServerState) -> None:
    if not state.supports_adapters:
        raise APIError(501, "this engine does not support adapters")


def _check_new_name(state: ServerState, name: str) -> None:
    if name == state.settings.model_id:
        raise APIError(409, f"{name!r} is the base model's id; choose another adapter name")


async def _registry_call(
    state: ServerState,
    fn: Callable[[Any], Any],
    name: str,
    exists: APIError | None = None,
    not_found: APIError | None = None,
    conflict_status: int = 409,
) -> Any:
    """Run an adapter operation on a worker thread, mapping adapter errors to HTTP errors
    (``exists``: the error for a name already registered, 409 by default; ``not_found``: for a
    name not registered, a 404 by default; ``conflict_status``: for a full registry or a name in
    the way)."""
    _require_adapter_support(state)
    try:
        return await registry_call(state, fn)
    except RegistryUnavailableError as error:  # before AdapterError, its base class
        raise registry_unavailable(error) from None
    except AdapterExistsError as error:
        if exists is not None:
            raise exists from None
        raise APIError(409, f"an adapter named {name!r} already exists: {error}") from None
    except (AdapterNotFoundError, UnknownAdapterError):
        raise (not_found or APIError(404, f"no adapter named {name!r}")) from None
    except AdapterTooLargeError as error:
        raise APIError(413, str(error)) from None
    except RegistryConflictError as error:
        raise APIError(conflict_status, f"adapter {name!r}: {error}") from None
    except AdapterError as error:
        raise APIError(400, f"invalid adapter {name!r}: {error}") from None
    except OSError as error:  # the registry's directory (a full or read-only disk, a stale mount)
        raise APIError(503, f"the adapter registry cannot be used now: {type(error).__name__}: {error}",
                       headers={"Retry-After": "1"}) from None  # fmt: skip


@router.post(
    "/v1/adapters",
    status_code=201,
    response_model=AdapterCard,
    responses=_ERRORS,
    dependencies=[Depends(require_admin_key)],
    openapi_extra=_UPLOAD_BODY,
    summary="Upload a PEFT LoRA adapter (multipart: `name` plus the files or one archive)",
)
async def upload_adapter(request: Request) -> JSONResponse:
    state = get_state(request)
    _require_adapter_support(state)
    upload = await read_adapter_upload(request, state.settings.max_upload_bytes)
    _check_new_name(state, upload.name)
    info = await _registry_call(state, lambda engine: engine.register_adapter(upload.name, upload.files), upload.name)
    return JSONResponse(adapter_card(info).model_dump(), status_code=201)


@router.get(
    "/v1/adapters",
    response_model=AdapterList,
    responses={401: {"model": ErrorResponse}},
    dependencies=[Depends(require_api_key)],
    summary="List registered adapters",
)
async def list_adapters(request: Request) -> AdapterList:
    state = get_state(request)
    return AdapterList(data=[adapter_card(info) for info in await list_adapter_infos(state)])


@router.get(
    "/v1/adapters/{name}",
    response_model=AdapterCard,
    responses={401: {"model": ErrorResponse}, 404: {"model": ErrorResponse}},
    dependencies=[Depends(require_api_key)],
    summary="Describe one adapter (rank, target modules, digest, size)",
)
async def get_adapter(name: str, request: Request) -> AdapterCard:
    state = get_state(request)
    return adapter_card(await _registry_call(state, lambda engine: engine.adapter_info(name), name))


@router.delete(
    "/v1/adapters/{name}",
    response_model=AdapterDeleted,
    responses=_ERRORS,
    dependencies=[Depends(require_admin_key)],
    summary="Delete an adapter (new requests cannot use it; running ones finish)",
)
async def delete_adapter(name: str, request: Request) -> AdapterDeleted:
    state = get_state(request)
    await _registry_call(state, lambda engine: engine.remove_adapter(name), name)
    return AdapterDeleted(id=name)


@router.post(
    "/v1/load_lora_adapter",
    response_class=PlainTextResponse,
    responses=_ERRORS,
    dependencies=[Depends(require_admin_key), Depends(require_json)],
    summary="vLLM-compatible: register the adapter directory at a server path under --allowed-lora-dir",
)
async def load_lora_adapter(body: LoadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    """As vLLM's route: its errors are 400s, and `load_inplace` replaces an adapter of that name."""
    state = get_state(request)
    _require_adapter_support(state)
    name = body.lora_name
    if body.is_3d_lora_weight:
        message = "is_3d_lora_weight: adapters with 3D (MoE) weights are not supported"
        raise APIError(400, message, param="is_3d_lora_weight")
    if name == state.settings.model_id:
        raise APIError(400, f"The lora adapter '{name}' conflicts with a served base model.")
    settings = state.settings
    files = await asyncio.to_thread(
        read_confined_adapter_dir, body.lora_path, settings.allowed_lora_dirs, settings.max_upload_bytes
    )
    exists = APIError(
        400,
        f"The lora adapter '{name}' has already been loaded. If you want to load the adapter in place, "
        "set 'load_inplace' to True.",
    )

    def register(engine: Any) -> Any:
        return engine.register_adapter(name, files, overwrite=body.load_inplace)

    await _registry_call(state, register, name, exists=exists, conflict_status=400)  # vLLM's: all 400s
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


@router.post(
    "/v1/unload_lora_adapter",
    response_class=PlainTextResponse,
    responses=_ERRORS,
    dependencies=[Depends(require_admin_key), Depends(require_json)],
    summary="vLLM-compatible: unregister an adapter by name",
)
async def unload_lora_adapter(body: UnloadLoRAAdapterRequest, request: Request) -> PlainTextResponse:
    state = get_state(request)
    name = body.lora_name
    not_found = APIError(404, f"The lora adapter '{name}' cannot be found.")  # vLLM's
    await _registry_call(state, lambda engine: engine.remove_adapter(name), name, not_found=not_found)
    return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

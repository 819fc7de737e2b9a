"""``GET /v1/models``, ``GET /health`` (and vLLM's ``/ping``), ``GET /version``, ``GET /load`` and ``GET /metrics``."""

from __future__ import annotations

from importlib import metadata
from typing import Any

from fastapi import APIRouter, Depends, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from .async_engine import EngineDeadError
from .auth import require_api_key
from .openai_responses import ErrorResponse, ModelCard, ModelList
from .serving import ServerState, get_state, registry_call

router = APIRouter()

# How long /health and /metrics wait for the engine's stats (read between steps) before answering
# with the last ones read: under a probe's timeout (Kubernetes': 1 s) and a scrape's (Prometheus': 10 s).
HEALTH_WAIT_S = 0.5
METRICS_WAIT_S = 2.0


async def list_adapter_infos(state: ServerState) -> list[Any]:
    """The engine's registered adapters (asked of the registry on a worker thread); empty without
    adapter support."""
    if not state.supports_adapters:
        return []
    infos: list[Any] = await registry_call(state, lambda engine: list(engine.list_adapters()))
    return sorted(infos, key=lambda info: info.name)


async def list_adapter_names(state: ServerState) -> list[str]:
    """Registered adapter names (cheap: no adapter is parsed); empty without adapter support."""
    if not state.supports_adapters:
        return []
    names: list[str] = await registry_call(state, lambda engine: list(engine.adapter_registry.names()))
    return sorted(names)


@router.get(
    "/v1/models",
    response_model=ModelList,
    responses={401: {"model": ErrorResponse}},
    dependencies=[Depends(require_api_key)],
    tags=["models"],
    summary="List the base model and every registered adapter (each usable as `model`)",
)
async def list_models(request: Request) -> ModelList:
    state = get_state(request)
    base = state.settings.model_id
    cards = [ModelCard(id=base, root=str(state.engine.model_dir), max_model_len=state.engine.max_model_len)]
    cards += [ModelCard(id=name, root=name, parent=base) for name in await list_adapter_names(state)]
    return ModelList(data=cards)


@router.get("/health", tags=["operations"], summary="200 while the model is loaded and the engine loop runs")
async def health(request: Request) -> JSONResponse:
    state = get_state(request)
    if state.async_engine.draining:  # a load balancer stops sending requests here
        return JSONResponse({"status": "draining", "message": "the server is shutting down"}, status_code=503)
    try:
        state.async_engine.start()
    except EngineDeadError as error:
        return JSONResponse({"status": "error", "message": str(error)}, status_code=503)
    try:
        stats = await state.stats.read(HEALTH_WAIT_S)
    except EngineDeadError as error:
        return JSONResponse({"status": "error", "message": str(error)}, status_code=503)
    body: dict[str, Any] = {"status": "ok", "model": state.settings.model_id}
    if stats is None:  # the first read waits for a long step: the engine loop runs, so the server is up
        return JSONResponse(body)
    body["kernels"] = stats.kernels
    if stats.kernel_fallbacks:  # compiled kernels on a slower fallback (a library symbol missing)
        body["kernel_fallbacks"] = list(stats.kernel_fallbacks)
    if stats.cpu_gemm:  # the CPU GEMM kernel of each linear layer shape and row bucket, and how it was chosen
        body["cpu_gemm"] = stats.cpu_gemm
    if stats.cpu_lora:  # how the compiled LoRA kernel runs each segment length (tiles, loops, GEMM), and why
        body["cpu_lora"] = stats.cpu_lora
    if stats.cpu_prefill_attention:  # whether the prefill attention runs on AMX tiles, and how it was chosen
        body["cpu_prefill_attention"] = stats.cpu_prefill_attention
    if stats.cpu_decode_attention:  # the compiled decode attention's vector width, and how it was chosen
        body["cpu_decode_attention"] = stats.cpu_decode_attention
    if stats.adapter_decode_paths:  # decode graphs: the path measured faster for steps with adapters, per size
        body["adapter_decode_paths"] = {str(size): path for size, path in stats.adapter_decode_paths.items()}
    return JSONResponse(body)


_PING_SUMMARY = "/health's status, no body (vLLM's route)"


@router.get("/ping", tags=["operations"], summary=_PING_SUMMARY, response_class=Response)
@router.post("/ping", tags=["operations"], summary=_PING_SUMMARY, response_class=Response, operation_id="ping_post")
async def ping(request: Request) -> Response:
    return Response(status_code=(await health(request)).status_code)


@router.get("/load", tags=["operations"], summary="Inference requests in flight (vLLM's route)")
async def load(request: Request) -> dict[str, int]:
    """vLLM's ``server_load``: the completion, chat, responses and messages requests being answered
    (always counted here; vLLM counts them with ``--enable-server-load-tracking``)."""
    return {"server_load": get_state(request).in_flight.total()}


@router.get("/version", tags=["operations"], summary="The server's version (vLLM's route)")
async def version() -> dict[str, str]:
    try:
        return {"version": metadata.version("loraserve")}
    except metadata.PackageNotFoundError:  # run from a source tree that was not installed
        return {"version": "unknown"}


@router.get(
    "/metrics",
    tags=["operations"],
    summary="Prometheus metrics (pages by kind, queues, preemptions, evictions, tokens, latencies)",
    response_class=Response,
    responses={200: {"content": {"text/plain": {}}}},
)
async def metrics(request: Request) -> Response:
    state = get_state(request)
    collector = state.metrics.engine_collector
    try:
        collector.snapshot = await state.stats.read(METRICS_WAIT_S)
    except EngineDeadError:
        collector.snapshot = None
    collector.num_step_errors = state.async_engine.num_step_errors
    return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

"""The HTTP API served by Ray Serve: N engine replicas behind one ingress, routed by adapter.

    loraserve serve --ray-address local --num-replicas 2          # a local Ray instance
    loraserve serve --ray-address auto --num-replicas 4           # the cluster this machine joined

Each ``EngineReplica`` is one engine with its own unified pool, serving loraserve's whole API
(``api/``) on a private loopback port; the ``Ingress`` deployment takes the public HTTP requests
and forwards each, body and headers as they are, to a replica through a deployment handle. A
request whose ``model`` names an adapter carries it as Serve's multiplexed model id, so Serve
sends it to a replica that already holds that adapter (its pages resident, its prefix blocks
cached) when there is one, and otherwise to a lightly loaded replica; requests for the base model
spread by load. Streams come back chunk by chunk through a streaming handle. Every replica uses
the same adapter registry (``--registry redis://...``, or the default directory on this machine
for ``local``), so an adapter uploaded or deleted through any replica is seen by all. Auth, limits
and errors are the replicas' own (the same code as one process). Ray is optional: this module is
imported only with ``--ray-address`` (``pip install 'loraserve[ray]'``).

(No ``from __future__ import annotations`` here, and what the ingress calls is defined above it:
Serve's ingress wrapper takes the module namespace as it is when the class is decorated, so
FastAPI must see the route's parameter types as objects, and later names would be missing.)
"""


import json
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import Response, StreamingResponse
from ray import serve
from ray.serve.handle import DeploymentHandle

logger = logging.getLogger(__name__)

HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}
MAX_ADAPTERS_PER_REPLICA = 64  # adapter ids Serve remembers per replica for routing (not a pool limit)


@serve.deployment(ray_actor_options={"num_cpus": 0})
class EngineReplica:
    """One engine and loraserve's API on a loopback port of the replica's machine."""

    def __init__(self, model: str | None, engine_options: dict[str, Any], settings: dict[str, Any]) -> None:
        from loraserve.api import ServerSettings, ServerThread, create_app
        from loraserve.config import EngineConfig
        from loraserve.llm_engine import LLMEngine

        engine = LLMEngine(EngineConfig.from_options(model, **engine_options))
        self.server = ServerThread(create_app(engine, ServerSettings(**settings))).start()
        self.client = httpx.AsyncClient(base_url=self.server.url, timeout=None)
        self.replica_id = serve.get_replica_context().replica_id.unique_id  # answered as X-Loraserve-Replica

    @serve.multiplexed(max_num_models_per_replica=MAX_ADAPTERS_PER_REPLICA)
    async def hold(self, adapter: str) -> str:
        """Serve's record that this replica serves ``adapter`` (the engine makes it resident on use)."""
        return adapter

    async def _route(self) -> None:
        adapter = serve.get_multiplexed_model_id()
        if adapter:
            await self.hold(adapter)

    async def forward(
        self, method: str, path: str, headers: dict[str, str], body: bytes
    ) -> tuple[int, dict[str, str], bytes]:
        await self._route()
        reply = await self.client.request(method, path, headers=headers, content=body)
        return reply.status_code, _passable(reply.headers, self.replica_id), reply.content

    async def forward_stream(self, method: str, path: str, headers: dict[str, str], body: bytes) -> AsyncIterator[Any]:
        """Yields ``(status, headers)`` first, then the body's chunks as the replica's API sends them."""
        await self._route()
        async with self.client.stream(method, path, headers=headers, content=body) as reply:
            yield reply.status_code, _passable(reply.headers, self.replica_id)
            async for chunk in reply.aiter_raw():
                yield chunk

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()


def _passable(headers: httpx.Headers, replica_id: str) -> dict[str, str]:
    passed = {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}
    passed["x-loraserve-replica"] = replica_id
    return passed


def adapter_and_stream(body: bytes, content_type: str, base_model: str) -> tuple[str, bool]:
    """The adapter a JSON body names in ``model`` ("" for the base model or none) and its ``stream``."""
    if "json" not in content_type or not body:
        return "", False
    try:
        fields = json.loads(body)
    except ValueError:
        return "", False  # the replica answers the 400
    if not isinstance(fields, dict):
        return "", False
    model = fields.get("model")
    adapter = model if isinstance(model, str) and model != base_model else ""
    return adapter, fields.get("stream") is True


ingress_app = FastAPI(title="loraserve (Ray Serve)", docs_url=None, redoc_url=None, openapi_url=None)


@serve.deployment(ray_actor_options={"num_cpus": 0})
@serve.ingress(ingress_app)
class Ingress:
    """Forwards every request to an engine replica, adapter requests by multiplexed model id."""

    def __init__(self, replicas: DeploymentHandle, base_model: str) -> None:
        self.replicas = replicas
        self.base_model = base_model

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH"])
    async def forward(self, path: str, request: Request) -> Response:
        body = await request.body()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        target = "/" + path + (f"?{request.url.query}" if request.url.query else "")
        adapter, stream = adapter_and_stream(body, request.headers.get("content-type", ""), self.base_model)
        handle = self.replicas.options(multiplexed_model_id=adapter) if adapter else self.replicas
        if not stream:
            status, reply_headers, content = await handle.forward.remote(request.method, target, headers, body)
            return Response(content=content, status_code=status, headers=reply_headers)
        chunks: Any = handle.options(stream=True).forward_stream.remote(request.method, target, headers, body)
        status, reply_headers = await chunks.__anext__()

        async def rest() -> AsyncIterator[bytes]:
            async for chunk in chunks:
                yield chunk

        return StreamingResponse(rest(), status_code=status, headers=reply_headers)


def build_app(model: str | None, engine_options: dict[str, Any], settings: dict[str, Any], num_replicas: int) -> Any:
    """The Serve application: ``num_replicas`` engine replicas behind the ingress."""
    # (serve.deployment turns the classes into Deployments: options/bind are theirs.)
    replicas = EngineReplica.options(num_replicas=num_replicas).bind(model, engine_options, settings)  # type: ignore[attr-defined]
    return Ingress.bind(replicas, settings["model_id"])  # type: ignore[attr-defined]


def run_ray_serve(args: Any, model: str | None, engine_options: dict[str, Any], settings: dict[str, Any]) -> int:
    """``loraserve serve --ray-address ...``: start (or join) Ray, deploy, serve until interrupted."""
    import ray

    address = None if args.ray_address == "local" else args.ray_address
    ray.init(address=address, logging_level=logging.WARNING)
    serve.start(http_options={"host": args.host, "port": args.port})
    num_replicas = args.num_replicas or 1
    serve.run(build_app(model, engine_options, settings, num_replicas), route_prefix="/")
    logger.info("serving %s with %d replicas on http://%s:%d (Ray Serve)", settings["model_id"], num_replicas,
                args.host, args.port)  # fmt: skip
    try:
        while True:
            time.sleep(1)
    except KeyboardInterrupt:
        logger.info("stopping")
    finally:
        serve.shutdown()
        ray.shutdown()
    return 0

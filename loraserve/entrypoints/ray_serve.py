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
and errors are the replicas' own (the same code as one process); the ingress, which reads a body
whole before it forwards it, refuses one past the body limits first (413, as a replica would).
Ray is optional: this module is imported only with ``--ray-address`` (``pip install
'loraserve[ray]'``).

Faults and operations:

* ``GET /metrics`` on the ingress asks every replica for its own ``/metrics`` (Serve's
  ``broadcast``) and answers one exposition, every sample labelled ``replica="<id>"``
  (:func:`merge_replica_metrics`), plus ``loraserve_replica_up{replica}`` (0 for a replica that
  did not answer within :data:`INGRESS_METRICS_TIMEOUT_S`) and the ingress's own counters.
* A replica that dies: a request that had not started answering there (every non-streamed one, a
  stream before its first bytes) is sent to another replica, at most :data:`MAX_ATTEMPTS` times in
  all, unless it changes the adapter registry (:func:`may_resend`: the change may have been made);
  a stream cut in the middle ends with an error event. Serve starts a replacement. A replica
  that can no longer serve while its actor lives (its engine loop or its API's server thread
  stopped) fails Serve's health check (:meth:`EngineReplica.check_health`) and is replaced too.
* Stopping (``run_ray_serve`` in ``ray_launch.py``): the first SIGTERM or SIGINT drains every replica's engine (new
  requests get 503, those in flight run for up to ``--shutdown-timeout`` seconds, then end with
  finish reason ``abort``), waits for the ingress to send their last bytes, then stops Serve (on
  a cluster it joined, only deletes this application).

(No ``from __future__ import annotations`` here, and what the ingress calls is defined above it:
Serve's ingress wrapper takes the module namespace as it is when the class is decorated, so
FastAPI must see the route's parameter types as objects, and later names would be missing.)
"""

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, generate_latest
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.handle import DeploymentHandle

from loraserve.api.errors import error_response
from loraserve.api.limits import body_limit, read_body_within
from loraserve.api.settings import ServerSettings
from loraserve.entrypoints.fleet_metrics import (
    each_answer,
    live_replica_ids,
    merge_replica_metrics,
)
from loraserve.entrypoints.ingress_protocol import (
    EventFramer,
    adapter_and_stream,
    may_resend,
    replica_client,
    stream_cut_event,
    unavailable_body,
)
from loraserve.entrypoints.startup_heap import freeze_startup_objects

logger = logging.getLogger(__name__)

APP_NAME = "loraserve"  # the Serve application ``loraserve serve --ray-address`` deploys
HOP_HEADERS = {"host", "content-length", "connection", "transfer-encoding", "keep-alive"}
MAX_ADAPTERS_PER_REPLICA = 64  # adapter ids Serve remembers per replica for routing (not a pool limit)
# Serve's default of 5 requests at once per replica would cap an engine that batches dozens of
# sequences (and the ingress, which only forwards): the engine queues what it cannot run yet.
REPLICA_MAX_ONGOING_REQUESTS = 256
INGRESS_MAX_ONGOING_REQUESTS = 4096
HEALTH_CHECK_PERIOD_S = 2.0  # how soon Serve notices a dead replica and starts another (Serve's default: 10)
MAX_ATTEMPTS = 3  # sends of one request when the replica it went to dies before answering
REPLICA_METRICS_TIMEOUT_S = 4.0  # a replica's wait for its own /metrics (its engine thread answers between steps)
INGRESS_METRICS_TIMEOUT_S = 5.0  # the ingress's wait for each replica's answer
DRAIN_POLL_S = 0.05


@serve.deployment(
    ray_actor_options={"num_cpus": 0},
    max_ongoing_requests=REPLICA_MAX_ONGOING_REQUESTS,
    health_check_period_s=HEALTH_CHECK_PERIOD_S,
)
class EngineReplica:
    """One engine and loraserve's API on a loopback port of the replica's machine."""

    def __init__(self, model: str | None, engine_options: dict[str, Any], settings: dict[str, Any]) -> None:
        from loraserve.api import ServerSettings, ServerThread, create_app
        from loraserve.config import EngineConfig
        from loraserve.llm_engine import LLMEngine

        engine = LLMEngine(EngineConfig.from_options(model, **engine_options))
        app = create_app(engine, ServerSettings(**settings))
        freeze_startup_objects()
        self.async_engine = app.state.server.async_engine
        self.server = ServerThread(app).start()
        self.client = replica_client(self.server.url)
        self.replica_id = serve.get_replica_context().replica_id.unique_id  # answered as X-Loraserve-Replica

    def check_health(self) -> None:
        """Serve's health check (every :data:`HEALTH_CHECK_PERIOD_S`): raises when this replica can
        no longer serve, its engine loop or its API's server thread having stopped, so Serve stops
        it and starts another (the actor alone answering is not enough). A draining replica is
        healthy: it still serves what it has."""
        if not self.async_engine.is_running:
            raise RuntimeError(f"replica {self.replica_id}: the engine loop has stopped (see its log)")
        if not self.server.thread.is_alive():
            raise RuntimeError(f"replica {self.replica_id}: its API server thread has stopped")

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

    async def metrics_text(self) -> tuple[str, str | None]:
        """This replica's id and its API's ``/metrics`` text (None if its server did not answer in time)."""
        try:
            reply = await self.client.get("/metrics", timeout=REPLICA_METRICS_TIMEOUT_S)
        except httpx.HTTPError as error:
            logger.warning("replica %s: /metrics did not answer: %s", self.replica_id, error)
            return self.replica_id, None
        return self.replica_id, reply.text if reply.status_code == 200 else None

    async def drain(self, timeout_s: float) -> int:
        """Graceful stop of this engine (as one process does on SIGTERM): new requests get 503 (and
        ``/health`` 503), those in flight run for up to ``timeout_s`` seconds, the rest then end with
        finish reason ``abort``. Returns how many were ended that way."""
        engine = self.async_engine
        engine.begin_drain()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while engine.num_in_flight and loop.time() < deadline:
            await asyncio.sleep(DRAIN_POLL_S)
        cut = engine.num_in_flight
        if cut:
            logger.warning("replica %s: %d request(s) still running after %.0f s: ending them", self.replica_id,
                           cut, timeout_s)  # fmt: skip
            engine.finish_all()
            end = loop.time() + 5.0
            while engine.num_in_flight and loop.time() < end:
                await asyncio.sleep(DRAIN_POLL_S)
        return int(cut)

    def __del__(self) -> None:
        server = getattr(self, "server", None)
        if server is not None:
            server.stop()


def replica_actor_options(device: str) -> dict[str, Any]:
    """Ray's resources for one engine replica on ``device``: no CPU reserved (the engine's threads
    are set by ``num_threads``), and one GPU on CUDA, so Ray places replicas by GPU and gives each
    its own. ``ValueError`` for a CUDA device with an index: Ray picks each replica's GPU."""
    if device.startswith("cuda"):
        if device != "cuda":
            raise ValueError(f"device {device!r}: under Ray each replica gets its own GPU; give device 'cuda'")
        return {"num_cpus": 0, "num_gpus": 1}
    return {"num_cpus": 0}


def _passable(headers: httpx.Headers, replica_id: str) -> dict[str, str]:
    passed = {k: v for k, v in headers.items() if k.lower() not in HOP_HEADERS}
    passed["x-loraserve-replica"] = replica_id
    return passed


def _unavailable(message: str) -> JSONResponse:
    return JSONResponse(unavailable_body(message), status_code=503, headers={"Retry-After": "1"})


ingress_app = FastAPI(title="loraserve (Ray Serve)", docs_url=None, redoc_url=None, openapi_url=None)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=INGRESS_MAX_ONGOING_REQUESTS)
@serve.ingress(ingress_app)
class Ingress:
    """Forwards every request to an engine replica, adapter requests by multiplexed model id
    (``route_by_adapter=False``: by load only, for comparison); ``/metrics`` of all replicas."""

    def __init__(self, replicas: DeploymentHandle, settings: dict[str, Any], route_by_adapter: bool = True) -> None:
        self.replicas = replicas
        self.settings = ServerSettings(**settings)  # the replicas' too: the body limits are checked here first
        self.base_model = self.settings.model_id
        self.route_by_adapter = route_by_adapter
        self.registry = CollectorRegistry()
        self.in_flight = Gauge("loraserve_ingress_requests_in_flight", "Requests the ingress is forwarding",
                               registry=self.registry)  # fmt: skip
        self.resent = Counter(
            "loraserve_ingress_resent_requests",
            "Requests sent to another replica because the one they went to died before answering",
            registry=self.registry,
        )
        self.cut = Counter(
            "loraserve_ingress_streams_cut",
            "Streams ended with an error event because their replica died",
            registry=self.registry,
        )
        self.num_forwarding = 0

    @ingress_app.get("/metrics")
    async def metrics(self) -> Response:
        """Every replica's ``/metrics``, labelled by replica (see :func:`merge_replica_metrics`)."""
        app_name = serve.get_replica_context().app_name
        texts: dict[str, str | None] = dict.fromkeys(
            await asyncio.to_thread(live_replica_ids, app_name, self.replicas.deployment_name)
        )
        answers = await each_answer(self.replicas.broadcast("metrics_text"), INGRESS_METRICS_TIMEOUT_S)
        for answer in answers:
            if isinstance(answer, tuple):
                texts[answer[0]] = answer[1]
        merged = merge_replica_metrics(texts, own=generate_latest(self.registry).decode())
        return Response(merged, media_type=CONTENT_TYPE_LATEST)

    @ingress_app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH"])
    async def forward(self, path: str, request: Request) -> Response:
        limit, too_large = body_limit("/" + path, self.settings)
        body = await read_body_within(request.receive, request.headers.get("content-length"), limit)
        if body is None:
            return error_response(too_large)
        headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
        target = "/" + path + (f"?{request.url.query}" if request.url.query else "")
        adapter, stream = adapter_and_stream("/" + path, request.headers, body, self.base_model)
        routed = adapter and self.route_by_adapter
        handle = self.replicas.options(multiplexed_model_id=adapter) if routed else self.replicas
        self._started()
        done_here = True
        try:
            call = (request.method, target, headers, body)
            sends = MAX_ATTEMPTS if may_resend(request.method, "/" + path) else 1
            if not stream:
                return await self._whole(handle, call, sends)
            reply = await self._stream(handle, call, sends, "/" + path)
            done_here = not isinstance(reply, StreamingResponse)  # a stream ends when its body is sent
            return reply
        finally:
            if done_here:
                self._finished()

    async def _whole(
        self, handle: DeploymentHandle, call: tuple[str, str, dict[str, str], bytes], sends: int
    ) -> Response:
        for attempt in range(sends):
            try:
                status, reply_headers, content = await handle.forward.remote(*call)
                return Response(content=content, status_code=status, headers=reply_headers)
            except RayActorError as error:  # the replica died before answering: nothing was sent yet
                failure = error
                if attempt + 1 < sends:
                    self.resent.inc()
        return _unavailable(f"no engine replica could answer: {failure}")

    async def _stream(
        self, handle: DeploymentHandle, call: tuple[str, str, dict[str, str], bytes], sends: int, path: str
    ) -> Response:
        for attempt in range(sends):
            chunks: Any = handle.options(stream=True).forward_stream.remote(*call)
            try:
                status, reply_headers = await chunks.__anext__()
                break
            except RayActorError as error:  # before the first byte: another replica may take it
                failure = error
                if attempt + 1 < sends:
                    self.resent.inc()
        else:
            return _unavailable(f"no engine replica could answer: {failure}")
        event_stream = reply_headers.get("content-type", "").startswith("text/event-stream")

        async def rest() -> AsyncIterator[bytes]:
            finished = False
            # Whole events only, so a stream cut mid-event ends with the error event alone; the
            # Responses API numbers its events, the error event too.
            events = EventFramer()
            try:
                async for chunk in chunks:
                    if not event_stream:
                        yield chunk
                    elif whole := events.feed(chunk):
                        yield whole
                finished = True
                if rest := events.rest():
                    yield rest
            except RayActorError as error:
                finished = True
                self.cut.inc()
                if event_stream:
                    message = f"the engine replica serving this stream died: {error}"
                    yield stream_cut_event(path, message, events.num_events)
            finally:
                if not finished:  # the client left: stop the replica's request too
                    chunks.cancel()
                self._finished()

        return StreamingResponse(rest(), status_code=status, headers=reply_headers)

    def _started(self) -> None:
        self.num_forwarding += 1
        self.in_flight.inc()

    def _finished(self) -> None:
        self.num_forwarding -= 1
        self.in_flight.dec()

    def num_in_flight(self) -> int:
        """Requests this ingress is forwarding (a stream until its last byte is handed to Serve's proxy)."""
        return self.num_forwarding


def build_app(model: str | None, engine_options: dict[str, Any], settings: dict[str, Any], num_replicas: int,
              route_by_adapter: bool = True) -> Any:  # fmt: skip
    """The Serve application: ``num_replicas`` engine replicas behind the ingress; on a CUDA device
    each replica holds one GPU of its own (Ray sets its ``CUDA_VISIBLE_DEVICES``)."""
    actor_options = replica_actor_options(engine_options.get("device", "cpu"))
    # (serve.deployment turns the classes into Deployments: options/bind are theirs.)
    replicas = EngineReplica.options(num_replicas=num_replicas, ray_actor_options=actor_options).bind(  # type: ignore[attr-defined]
        model, engine_options, settings
    )
    return Ingress.bind(replicas, settings, route_by_adapter)  # type: ignore[attr-defined]

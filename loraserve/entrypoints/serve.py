"""The ``loraserve serve`` subcommand: argument setup and the run function.

``loraserve/entrypoints/cli.py`` calls :func:`add_serve_parser` with its subparsers and :func:`run_serve`
with the parsed arguments.
"""

from __future__ import annotations

import argparse
import hashlib
import ipaddress
import logging
import math
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

from loraserve.config import EngineConfig
from loraserve.entrypoints.engine_args import add_engine_arguments, engine_options
from loraserve.entrypoints.startup_heap import freeze_startup_objects
from loraserve.models.loader import ModelLoadError, resolve_model_dir

logger = logging.getLogger(__name__)

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
DEFAULT_SHUTDOWN_TIMEOUT = 30.0
API_KEY_ENV = "LORASERVE_API_KEY"
ADMIN_KEY_ENV = "LORASERVE_ADMIN_KEY"


def default_registry_spec(model: str | None) -> str:
    """This base model's own adapter store under the loraserve cache:
    ``$LORASERVE_CACHE/registries/<model directory name>-<8 hex digits of its absolute path>``.

    One per model, so adapters registered for one base model are never listed, counted against
    ``max_adapters`` or requested on a server of another (they would not fit it).
    """
    from loraserve.models.loader import DEFAULT_MODEL_NAME, cache_root

    path = (cache_root() / "models" / DEFAULT_MODEL_NAME) if model is None else Path(model).expanduser()
    path = path.resolve()
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:8]
    registry = cache_root() / "registries" / f"{path.name or 'model'}-{digest}"
    shared = cache_root() / "adapters"  # the one default registry that every model shared in earlier versions
    try:
        earlier = (
            not registry.exists() and shared.is_dir() and any(not p.name.startswith(".") for p in shared.iterdir())
        )
    except OSError:  # only a warning hangs on it
        earlier = False
    if earlier:
        logger.warning(
            "the default adapter registry is now one per base model (%s); adapters registered earlier "
            "are in %s: serve with --registry dir:%s to use them",
            registry, shared, shared,
        )  # fmt: skip
    return f"dir:{registry}"


def _port(text: str) -> int:
    """A TCP port for argparse (uvloop would bind a number past 65535 modulo 65536)."""
    port = int(text)
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{port} is not a TCP port (0-65535)")
    return port


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``serve`` subcommand to ``subparsers`` (from ``ArgumentParser.add_subparsers``)."""
    parser: argparse.ArgumentParser = subparsers.add_parser(
        "serve",
        help="serve the OpenAI-compatible HTTP API",
        description="Serve an OpenAI-compatible API (completions, chat, models) with per-request LoRA "
        "adapters, adapter upload and registration, health and Prometheus metrics.",
    )
    parser.add_argument(
        "--model", default=None, help="local Hugging Face model directory (default: SmolLM2-135M-Instruct)"
    )
    parser.add_argument(
        "--served-model-name", default=None, help="model id of the base model (default: its directory name)"
    )
    parser.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST})")
    parser.add_argument("--port", type=_port, default=DEFAULT_PORT, help=f"port to bind (default {DEFAULT_PORT})")
    parser.add_argument(
        "--registry",
        default=None,
        help="adapter store: 'dir:/path' or a path for a local directory, 'redis://host:port/db' for Redis "
        "shared by replicas (default: a directory of this base model under the loraserve cache)",
    )
    parser.add_argument(
        "--api-key",
        default=os.environ.get(API_KEY_ENV),
        help=f"require 'Authorization: Bearer <key>' on inference endpoints (default: ${API_KEY_ENV}, else none)",
    )
    parser.add_argument(
        "--admin-key",
        default=os.environ.get(ADMIN_KEY_ENV),
        help=f"require this key on adapter-changing endpoints (default: ${ADMIN_KEY_ENV}, else the API key)",
    )
    parser.add_argument(
        "--allowed-lora-dir",
        action="append",
        default=[],
        metavar="DIR",
        help="directory /v1/load_lora_adapter may read adapters from (repeatable; default: none, disabled)",
    )
    parser.add_argument(
        "--max-upload-mb", type=int, default=512, help="largest adapter upload or archive content in MiB (default 512)"
    )
    parser.add_argument(
        "--max-request-body-mb", type=int, default=32, help="largest body of any other request in MiB (default 32)"
    )
    parser.add_argument("--max-n", type=int, default=64, help="most samples per prompt, n (default 64, at most 1024)")
    parser.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="longest prompt in tokens (default: the context length)"
    )
    parser.add_argument(
        "--max-output-tokens", type=int, default=None, help="largest max_tokens a request may ask (default: no limit)"
    )
    parser.add_argument(
        "--max-requests-per-key",
        type=int,
        default=512,
        help="completion requests in flight per API key (--api-key, --admin-key), 429 past it; all other "
        "requests share one (default 512)",
    )
    parser.add_argument(
        "--generation-config",
        default="auto",
        metavar="auto|vllm|DIR",
        help="sampling defaults for request fields left out, as vLLM's: 'auto' the model's generation_config.json "
        "(temperature, top_p, top_k, min_p, penalties, max_new_tokens), 'vllm' none (OpenAI's defaults), or a "
        "directory with a generation_config.json (default auto)",
    )
    parser.add_argument(
        "--override-generation-config",
        default=None,
        metavar="JSON",
        help="generation-config fields set over --generation-config's, e.g. '{\"temperature\": 0.5}'",
    )
    parser.add_argument(
        "--ray-address",
        default=None,
        help="serve with Ray Serve: 'local' (start Ray here), 'auto' (the cluster this machine joined) or "
        "HOST:PORT; requests are routed to replicas by adapter (default: one process, no Ray)",
    )
    parser.add_argument(
        "--num-replicas", type=int, default=None, help="engine replicas under --ray-address, one pool each (default 1)"
    )
    parser.add_argument(
        "--shutdown-timeout",
        type=float,
        default=None,
        help="on SIGTERM or Ctrl-C: seconds to finish the requests in flight (new ones get 503, /health 503) "
        "before the rest end with finish reason 'abort'; a second signal stops at once; under --ray-address "
        "every replica drains so before Serve stops (default 30)",
    )
    parser.add_argument(
        "--log-level", default="info", choices=["debug", "info", "warning", "error"], help="log level (default info)"
    )
    add_engine_arguments(parser)
    return parser


def build_engine_config(args: argparse.Namespace) -> EngineConfig:
    """EngineConfig from the parsed arguments (options not given keep their defaults)."""
    options = engine_options(args)
    options["registry"] = args.registry or default_registry_spec(args.model)
    return EngineConfig.from_options(args.model, **options)


def build_settings(args: argparse.Namespace, model_dir: Path) -> Any:
    """ServerSettings from the parsed arguments; ``model_dir`` names the base model by default."""
    from loraserve.api import ServerSettings
    from loraserve.api.generation_defaults import load_sampling_defaults

    for flag, value in (("--api-key", args.api_key), ("--admin-key", args.admin_key)):
        if value == "":  # e.g. --admin-key "$KEY" with KEY unset: not "no key", which leaves the server open
            raise ValueError(f"{flag} is empty (is the variable it comes from set?); leave it out for no key")
    if args.served_model_name == "":
        raise ValueError("--served-model-name is empty")
    if "" in args.allowed_lora_dir:  # realpath('') is the current directory
        raise ValueError("--allowed-lora-dir is empty (is the variable it comes from set?)")
    for directory in args.allowed_lora_dir:
        if not Path(directory).is_dir():
            logger.warning("--allowed-lora-dir %s is not a directory (yet): loads from it fail until it is", directory)
    if args.api_key is None and os.environ.get("VLLM_API_KEY"):
        logger.warning("VLLM_API_KEY is set, but loraserve reads --api-key or $%s: no API key is required", API_KEY_ENV)
    return ServerSettings(
        model_id=args.served_model_name or Path(model_dir).name,
        api_key=args.api_key,
        admin_key=args.admin_key,
        allowed_lora_dirs=tuple(args.allowed_lora_dir),
        max_upload_bytes=args.max_upload_mb * 2**20,
        max_request_body_bytes=args.max_request_body_mb * 2**20,
        max_n=args.max_n,
        max_prompt_tokens=args.max_prompt_tokens,
        max_output_tokens=args.max_output_tokens,
        max_requests_per_key=args.max_requests_per_key,
        sampling_defaults=load_sampling_defaults(model_dir, args.generation_config, args.override_generation_config),
    )


def start_engine(config: Any) -> Any:
    """``LLMEngine(config)``, or ``SystemExit`` with the reason when it cannot start (an option the
    model or this machine cannot take, a registry that cannot be opened): one line, not a traceback
    (``--log-level debug`` logs the traceback too)."""
    from loraserve.llm_engine import LLMEngine

    try:
        return LLMEngine(config)
    except (ValueError, ModelLoadError, OSError, RuntimeError) as error:
        logger.debug("the engine could not start", exc_info=True)
        kind = "bad option" if isinstance(error, ValueError) else f"the engine could not start ({type(error).__name__})"
        raise SystemExit(f"{kind}: {error}") from None


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def run_serve(args: argparse.Namespace) -> int:
    """Load the model, build the app and serve it under uvicorn until interrupted; returns 0."""
    import uvicorn

    from loraserve.api import create_app

    if not logging.getLogger().handlers:
        logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.max_upload_mb <= 0:
        raise SystemExit("--max-upload-mb must be positive")
    if args.shutdown_timeout is None:
        args.shutdown_timeout = DEFAULT_SHUTDOWN_TIMEOUT
    if not (math.isfinite(args.shutdown_timeout) and args.shutdown_timeout >= 0):
        raise SystemExit("--shutdown-timeout must be a number of seconds >= 0")
    if args.ray_address:
        if args.num_replicas is not None and args.num_replicas < 1:
            raise SystemExit("--num-replicas must be at least 1")
        return _run_on_ray(args)
    if args.num_replicas is not None:
        raise SystemExit("--num-replicas needs --ray-address (one process serves one engine)")
    try:  # every option checked before the model loads
        config = build_engine_config(args)
        settings = build_settings(args, Path(resolve_model_dir(config.model)))
    except (ValueError, ModelLoadError, OSError) as error:  # ConfigError included
        raise SystemExit(f"bad option: {error}") from None
    engine = start_engine(config)
    if not _is_loopback(args.host) and settings.adapter_key is None:
        logger.warning("serving on %s without --admin-key or --api-key: anyone can change adapters", args.host)
    app = create_app(engine, settings)
    freeze_startup_objects()
    logger.info("serving %s on http://%s:%d (docs at /docs)", settings.model_id, args.host, args.port)
    uvicorn_config = uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=10
    )
    server = uvicorn.Server(uvicorn_config)
    async_engine = app.state.server.async_engine

    def serve_http() -> None:
        try:
            server.run()
        finally:  # uvicorn stopped, or could not start: end the engine loop too
            async_engine.shutdown()

    # The engine loop keeps the main thread (it runs there much faster than on a new thread, see
    # AsyncEngine.run_on_this_thread); uvicorn serves from a background thread.
    http = threading.Thread(target=serve_http, name="uvicorn", daemon=True)
    drain = threading.Thread(
        target=_drain, args=(async_engine, server, http, args.shutdown_timeout), name="drain", daemon=True
    )

    signalled: list[int] = []  # set before the drain starts: a second signal may land inside start()

    def on_signal(signum: int, frame: object) -> None:
        if signalled:  # the second signal: stop now
            raise KeyboardInterrupt
        signalled.append(signum)
        logger.info("%s: finishing the requests in flight (at most %.0f s)", signal.Signals(signum).name,
                    args.shutdown_timeout)  # fmt: skip
        drain.start()

    def start_serving() -> None:
        """Runs on this (the main) thread once the engine loop owns it. The handlers come after
        uvicorn's thread starts, so the drain always has a thread to join; a signal before then
        (the model still loading) stops the process as it would any other program."""
        http.start()
        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)

    try:
        async_engine.run_on_this_thread(ready=start_serving)
    except KeyboardInterrupt:
        logger.info("stopping")
    finally:
        server.should_exit = True
        if http.is_alive():
            http.join(60)
        engine.close()  # the adapter catalog and loader threads
    logger.info("stopped")
    return 0 if server.started else 1


def _drain(async_engine: Any, server: Any, http: threading.Thread, timeout: float) -> None:
    """Graceful shutdown: refuse new requests, let those in flight finish for up to ``timeout``
    seconds, end the rest (finish reason ``abort``), let uvicorn send their last bytes, stop."""
    async_engine.begin_drain()
    deadline = time.monotonic() + timeout
    while async_engine.num_in_flight and time.monotonic() < deadline:
        time.sleep(0.05)
    if async_engine.num_in_flight:
        logger.warning("%d request(s) still running after %.0f s: ending them", async_engine.num_in_flight, timeout)
        async_engine.finish_all()
        end = time.monotonic() + 5
        while async_engine.num_in_flight and time.monotonic() < end:
            time.sleep(0.05)
    server.should_exit = True  # uvicorn closes its sockets once the responses in progress are sent
    http.join(15)
    async_engine.shutdown()  # the engine loop on the main thread returns


def threads_per_replica(cores: int, num_replicas: int) -> int:
    """Each of ``num_replicas`` CPU engines on one machine's ``cores``: its share, at least one
    (each engine's OpenMP team on every core would make the replicas take each other's cores)."""
    return max(1, cores // num_replicas)


def _run_on_ray(args: argparse.Namespace) -> int:
    """The same API on Ray Serve (``entrypoints/ray_serve.py``); Ray is imported only here."""
    import dataclasses

    from loraserve.adapters.store_factory import is_directory_spec

    try:
        from loraserve.entrypoints.ray_launch import run_ray_serve
        from loraserve.entrypoints.ray_serve import replica_actor_options
    except ImportError as error:
        raise SystemExit(f"--ray-address needs Ray Serve: pip install 'loraserve[ray]' ({error})") from None
    try:  # validated here, before any replica starts
        config = build_engine_config(args)
        replica_actor_options(config.device)
        settings = dataclasses.asdict(build_settings(args, Path(resolve_model_dir(config.model))))
    except (ValueError, ModelLoadError, OSError) as error:  # ConfigError included
        raise SystemExit(f"bad option: {error}") from None
    if args.ray_address != "local" and is_directory_spec(config.registry or ""):
        logger.warning("--registry %s is a directory on each machine: replicas on other machines of the cluster "
                       "will not see adapters uploaded here; give --registry redis://HOST:PORT/DB to share them",
                       config.registry)  # fmt: skip
    options = engine_options(args) | {"registry": config.registry}
    if args.ray_address == "local" and args.num_threads is None and config.device == "cpu":
        # Replicas on this machine's cores: each its share, not torch's default of all of them.
        options["num_threads"] = threads_per_replica(len(os.sched_getaffinity(0)), args.num_replicas or 1)
        logger.info("%d torch threads per replica (--num-threads to choose)", options["num_threads"])
    return run_ray_serve(args, config.model, options, settings)  # SIGTERM and SIGINT: drain, as here

"""``loraserve serve --ray-address ...``: start or join Ray, deploy the application of
``ray_serve.py``, serve until SIGTERM or SIGINT, drain, stop. Ray is optional: this module is
imported only with ``--ray-address``."""

from __future__ import annotations

import logging
import signal
import time
from typing import Any

from ray import serve

from loraserve.entrypoints.ray_serve import APP_NAME, build_app

logger = logging.getLogger(__name__)


def drain(app_name: str, timeout_s: float) -> None:
    """Every engine replica of ``app_name`` finishes what it runs (see :meth:`EngineReplica.drain`),
    then the ingress sends the last bytes; afterwards Serve can stop with nothing in flight."""
    replicas = serve.get_deployment_handle("EngineReplica", app_name=app_name)
    answers = replicas.broadcast("drain", timeout_s).results(timeout_s=timeout_s + 15.0, return_exceptions=True)
    cut = sum(answer for answer in answers if isinstance(answer, int))
    failed = [answer for answer in answers if not isinstance(answer, int)]
    if failed:
        logger.warning("%d replica(s) could not drain: %s", len(failed), failed[0])
    logger.info("replicas drained (%d request(s) ended early)", cut)
    ingress = serve.get_app_handle(app_name)
    deadline = time.monotonic() + 15.0
    while time.monotonic() < deadline:
        counts = ingress.broadcast("num_in_flight").results(timeout_s=5.0, return_exceptions=True)
        if not any(isinstance(count, int) and count > 0 for count in counts):
            break
        time.sleep(0.1)


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def run_ray_serve(args: Any, model: str | None, engine_options: dict[str, Any], settings: dict[str, Any]) -> int:
    """``loraserve serve --ray-address ...``: start (or join) Ray, deploy, serve until SIGTERM or
    SIGINT, drain (up to ``args.shutdown_timeout`` seconds; a second signal stops at once), stop."""
    import ray

    ray.init(address=args.ray_address, logging_level=logging.WARNING)  # "local": a new instance, always
    # Replacing Ray's handlers (SIGTERM: exit at once), before Serve starts: a signal then raises
    # KeyboardInterrupt here, whatever this thread is doing.
    signal.signal(signal.SIGTERM, _interrupt)
    signal.signal(signal.SIGINT, _interrupt)
    try:
        num_replicas = args.num_replicas or 1
        try:
            serve.start(http_options={"host": args.host, "port": args.port})
            serve.run(build_app(model, engine_options, settings, num_replicas), name=APP_NAME, route_prefix="/")
        except KeyboardInterrupt:
            logger.info("interrupted while starting: stopping")
            return 1
        logger.info("serving %s with %d replicas on http://%s:%d (Ray Serve)", settings["model_id"], num_replicas,
                    args.host, args.port)  # fmt: skip
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            logger.info("finishing the requests in flight (at most %.0f s); new ones get 503", args.shutdown_timeout)
            try:
                drain(APP_NAME, args.shutdown_timeout)
            except KeyboardInterrupt:
                logger.info("second signal: stopping now")
        logger.info("stopping")
    finally:
        try:
            if args.ray_address == "local":
                serve.shutdown()  # its own Ray instance: everything goes
            else:  # a cluster others may use: only this application, Serve and Ray stay up
                serve.delete(APP_NAME)
        finally:
            ray.shutdown()  # stops a "local" instance; elsewhere only disconnects
    logger.info("stopped")
    return 0

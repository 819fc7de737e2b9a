"""Run an app under uvicorn on a background thread (tests, notebooks, benchmarks)."""

from __future__ import annotations

import logging
import socket
import threading
import time
from types import TracebackType

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger(__name__)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class ServerThread:
    """``with ServerThread(app) as server: httpx.get(server.url + "/health")``.

    Starts a real uvicorn server on ``host:port`` (a free port by default) and waits until it
    accepts connections; leaving the block shuts it down (running the app's lifespan shutdown).
    """

    def __init__(self, app: FastAPI, host: str = "127.0.0.1", port: int | None = None, log_level: str = "warning"):
        self.host = host
        self.port = port or free_port(host)
        config = uvicorn.Config(app, host=host, port=self.port, log_level=log_level, lifespan="on")
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{self.port}", daemon=True)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 60.0) -> ServerThread:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError(f"uvicorn exited during startup on {self.url}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"uvicorn did not start within {timeout} s on {self.url}")
            time.sleep(0.02)
        return self

    def stop(self, timeout: float = 60.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            logger.warning("uvicorn thread on %s did not stop within %.0f s", self.url, timeout)

    def __enter__(self) -> ServerThread:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

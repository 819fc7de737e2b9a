"""A real redis-server a test controls: start it, kill it like a crash, start it again on the same port.

Persistence is on (an append-only file fsynced on every write, in ``data_dir``), so what was
stored before a kill is there again after the restart: the state a production Redis with AOF
comes back with.
"""

from __future__ import annotations

import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisProcess:
    """``RedisProcess(tmp_path).start()``; ``kill()`` (SIGKILL) and ``start()`` again on the same port."""

    def __init__(self, data_dir: Path, port: int | None = None) -> None:
        binary = shutil.which("redis-server")
        if binary is None:
            pytest.fail("redis-server not found: run `apt-get install -y redis-server` (the registry tests need it)")
        self.binary = binary
        self.data_dir = data_dir
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 10.0) -> RedisProcess:
        command = [self.binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.data_dir)]
        command += ["--save", "", "--appendonly", "yes", "--appendfsync", "always"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        client = redis.Redis.from_url(self.url)
        deadline = time.monotonic() + timeout
        try:
            while True:
                try:
                    client.ping()
                    return self
                except (redis.ConnectionError, redis.BusyLoadingError):
                    if self.process.poll() is not None or time.monotonic() > deadline:
                        stderr = self.process.stderr.read().decode() if self.process.stderr else ""
                        pytest.fail(f"redis-server did not start on port {self.port}: {stderr}")
                    time.sleep(0.02)
        finally:
            client.close()

    def kill(self) -> None:
        """SIGKILL, as a crash or a lost machine: no shutdown, clients see their connections drop."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGKILL)
            self.process.wait(timeout=10)
        self.process = None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None

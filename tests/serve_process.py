"""A real ``loraserve serve`` process for tests that need one (signals, several servers)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from conftest import _free_port


def start_serve(model_dir: Path, log_path: Path, *options: str) -> tuple[subprocess.Popen[bytes], str]:
    """Start ``loraserve serve`` on a free port with the torch kernels and ``options``; return the
    process and its URL once ``/health`` answers 200 (the test fails if it exits or takes 120 s)."""
    port = _free_port()
    command = [sys.executable, "-m", "loraserve.entrypoints.cli", "serve", "--model", str(model_dir),
               "--port", str(port), "--kernels", "torch", "--log-level", "info", *options]  # fmt: skip
    log = open(log_path, "wb")  # noqa: SIM115 (the process writes it until it exits)
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if process.poll() is not None:
            pytest.fail(f"the server exited at start: {log_path.read_text()[-3000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return process, url
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    process.kill()
    pytest.fail("the server did not start within 120 s")

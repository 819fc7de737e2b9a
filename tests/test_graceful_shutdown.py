"""Graceful shutdown of ``loraserve serve`` (a real process, signalled as a process manager does):
on SIGTERM it refuses new requests (503, ``/health`` 503), finishes the ones in flight, and exits 0,
whichever of its threads the signal lands on; past ``--shutdown-timeout`` the rest end with finish
reason ``abort``; a second signal stops at once."""

from __future__ import annotations

import ctypes
import json
import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from serve_process import start_serve

pytestmark = pytest.mark.slow


def _start(model_dir: Path, timeout: float, tmp_path: Path) -> tuple[subprocess.Popen[bytes], str]:
    return start_serve(model_dir, tmp_path / "server.log", "--num-pages", "400", "--max-num-seqs", "16",
                       "--registry", f"dir:{tmp_path / 'registry'}", "--shutdown-timeout", str(timeout))  # fmt: skip


@pytest.fixture
def stopped_processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    processes: list[subprocess.Popen[bytes]] = []
    yield processes
    for process in processes:
        if process.poll() is None:
            process.kill()
            process.wait()


def _requests(url: str, model: str, max_tokens: int, first_chunks: threading.Barrier) -> list[dict[str, Any]]:
    """8 streamed and 8 plain completions at once; each result: finish reason, tokens, status."""
    results: list[dict[str, Any]] = [{} for _ in range(16)]
    body = {"model": model, "prompt": "Count with me: one, two,", "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0}  # fmt: skip

    def streamed(index: int) -> None:
        chunks, reason = 0, None
        streaming = {**body, "stream": True, "stream_options": {"include_usage": True}}
        with httpx.stream("POST", url + "/v1/completions", json=streaming, timeout=300) as reply:
            results[index]["status"] = reply.status_code
            for line in reply.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                chunks += 1
                if chunks == 1:
                    first_chunks.wait(60)
                if chunk["choices"]:
                    reason = chunk["choices"][0]["finish_reason"] or reason
                if chunk.get("usage"):
                    results[index]["tokens"] = chunk["usage"]["completion_tokens"]
        results[index].update(finish_reason=reason, chunks=chunks)

    def plain(index: int) -> None:
        reply = httpx.post(url + "/v1/completions", json=body, timeout=300)
        results[index]["status"] = reply.status_code
        if reply.status_code == 200:
            answer = reply.json()
            choice = answer["choices"][0]
            results[index].update(
                finish_reason=choice["finish_reason"], tokens=answer["usage"]["completion_tokens"], text=choice["text"]
            )

    threads = [threading.Thread(target=streamed if i < 8 else plain, args=(i,)) for i in range(16)]
    for thread in threads:
        thread.start()
    results.append({"threads": threads})
    return results


def _wait_running(url: str, count: int) -> None:
    """Until the engine runs ``count`` sequences (every request accepted and started)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for line in httpx.get(url + "/metrics").text.splitlines():
            if line.startswith("loraserve_requests_running ") and float(line.split()[1]) >= count:
                return
        time.sleep(0.05)
    pytest.fail(f"{count} requests did not start")


def _model(url: str) -> str:
    return str(httpx.get(url + "/v1/models").json()["data"][0]["id"])


def test_sigterm_finishes_requests_in_flight_then_exits_0(
    tiny_model_dir: Path, tmp_path: Path, stopped_processes: list[subprocess.Popen[bytes]]
) -> None:
    process, url = _start(tiny_model_dir, timeout=60, tmp_path=tmp_path)
    stopped_processes.append(process)
    first_chunks = threading.Barrier(9)  # the 8 streams have their first chunk, and this thread
    results = _requests(url, _model(url), max_tokens=300, first_chunks=first_chunks)
    threads = results.pop()["threads"]
    first_chunks.wait(60)
    _wait_running(url, 16)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    while httpx.get(url + "/health", timeout=60).status_code != 503:  # the handler ran: draining
        assert time.monotonic() - signalled < 30, "SIGTERM did not start the drain"
        time.sleep(0.05)
    late = httpx.post(url + "/v1/completions", json={"model": _model(url), "prompt": "x", "max_tokens": 2}, timeout=60)
    error = late.json()["error"]
    assert late.status_code == 503 and error["code"] == 503 and "shutting down" in error["message"]
    for thread in threads:
        thread.join(120)
    assert process.wait(60) == 0
    assert time.monotonic() - signalled < 60
    assert all(r["status"] == 200 and r["finish_reason"] == "length" for r in results), results
    assert all(r["tokens"] == 300 for r in results), results


def test_past_the_timeout_the_rest_end_with_finish_reason_abort(
    tiny_model_dir: Path, tmp_path: Path, stopped_processes: list[subprocess.Popen[bytes]]
) -> None:
    process, url = _start(tiny_model_dir, timeout=1, tmp_path=tmp_path)
    stopped_processes.append(process)
    first_chunks = threading.Barrier(9)
    results = _requests(url, _model(url), max_tokens=1900, first_chunks=first_chunks)
    threads = results.pop()["threads"]
    first_chunks.wait(60)
    _wait_running(url, 16)
    signalled = time.monotonic()
    process.send_signal(signal.SIGTERM)
    for thread in threads:
        thread.join(120)
    assert process.wait(60) == 0
    assert time.monotonic() - signalled < 30
    assert all(r["status"] == 200 and r["finish_reason"] == "abort" for r in results), results
    assert all(0 < r["tokens"] < 1900 for r in results), results  # what they had so far
    assert all(r["text"] for r in results[8:]), results  # the plain ones' text too (was empty)


def test_a_second_signal_stops_at_once(
    tiny_model_dir: Path, tmp_path: Path, stopped_processes: list[subprocess.Popen[bytes]]
) -> None:
    process, url = _start(tiny_model_dir, timeout=600, tmp_path=tmp_path)
    stopped_processes.append(process)
    body = {"model": _model(url), "prompt": "x", "max_tokens": 1900, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as reply:
        lines = reply.iter_lines()  # kept: a closed iterator would close the stream (a disconnect)
        next(lines)
        process.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert process.poll() is None  # draining: it waits for the stream (up to 600 s)
        process.send_signal(signal.SIGINT)
        assert process.wait(30) == 0
        del lines
    log = (tmp_path / "server.log").read_text()
    assert "stopping" in log
    assert "start-up objects frozen for the garbage collector" in log  # (tests/test_startup_heap.py)
    assert "leaked" not in log  # unfrozen at exit: extensions' objects are freed, not reported as leaks


def _threads_taking(pid: int, signum: int) -> list[int]:
    """The process's threads other than the main one that do not block ``signum``."""
    found = []
    for tid in sorted(int(name) for name in os.listdir(f"/proc/{pid}/task")):
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        blocked = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
        if tid != pid and not blocked >> (signum - 1) & 1:
            found.append(tid)
    return found


def test_sigterm_taken_by_another_thread_stops_an_idle_server(
    tiny_model_dir: Path, tmp_path: Path, stopped_processes: list[subprocess.Popen[bytes]]
) -> None:
    """The kernel may hand a process's SIGTERM to any of its threads; Python runs the handler on
    the main thread, which runs the engine loop: idle, it must still wake up to see it (it once
    slept until the next request, so a server stopped while idle could hang for ever)."""
    process, url = _start(tiny_model_dir, timeout=60, tmp_path=tmp_path)
    stopped_processes.append(process)
    reply = httpx.post(url + "/v1/completions", json={"model": _model(url), "prompt": "x", "max_tokens": 2})
    assert reply.status_code == 200  # every thread of a serving process is up
    time.sleep(1.0)  # the engine loop is idle, waiting for a command
    others = _threads_taking(process.pid, signal.SIGTERM)
    assert others, "no thread other than the main one takes SIGTERM"
    libc = ctypes.CDLL(None, use_errno=True)
    assert libc.tgkill(process.pid, others[0], signal.SIGTERM) == 0, os.strerror(ctypes.get_errno())
    assert process.wait(30) == 0
    assert "stopped" in (tmp_path / "server.log").read_text()

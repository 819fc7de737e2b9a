"""The Redis registry's layout and its catalogs, on real redis-servers.

Weights stored once per content digest (two names, one blob; the blob goes with the last name),
files chunked (a tiny chunk size here) and read back byte-exact, damage detected; a change
published on one client reaching another replica's catalog (another process) within a second;
a catalog that lost its connection re-reads the index (messages lost meanwhile), marks the
registry down while Redis is dead, logs that once, and comes back by itself. The local
directory store's polling catalog follows another store on the same directory.
"""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis
from loraserve.adapters import (
    AdapterCatalog,
    AdapterError,
    AdapterNotFoundError,
    LocalDirStore,
    RedisStore,
    RegistryUnavailableError,
    content_digest,
)
from loraserve.adapters import redis_store as redis_store_module
from redis_process import RedisProcess

FILES = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": bytes(range(256)) * 40}
OTHER = {"adapter_config.json": b'{"r": 4}', "adapter_model.safetensors": b"\x01" * 5000}


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> float:
    """Seconds until ``condition()`` held (checked every millisecond); fails after ``timeout``."""
    start = time.monotonic()
    while not condition():
        if time.monotonic() - start > timeout:
            pytest.fail(f"not within {timeout} s: {what}")
        time.sleep(0.001)
    return time.monotonic() - start


@pytest.fixture()
def prefix() -> str:
    return f"reg-{uuid.uuid4().hex[:8]}:"  # isolates tests sharing the session's server


@pytest.fixture()
def store(redis_url: str, prefix: str) -> Iterator[RedisStore]:
    store = RedisStore(redis_url, prefix=prefix)
    yield store
    store.close()


def keys_under(redis_url: str, prefix: str) -> set[str]:
    client = redis.Redis.from_url(redis_url)
    try:
        return {key.decode().removeprefix(prefix) for key in client.scan_iter(match=f"{prefix}*")}
    finally:
        client.close()


def test_two_names_with_the_same_files_share_one_blob(store: RedisStore, redis_url: str, prefix: str) -> None:
    store.put("a", FILES)
    store.put("b", dict(reversed(FILES.items())))  # same files, another order: same content
    digest = content_digest(FILES)
    assert store.content_key("a") == store.content_key("b") == digest
    assert store.num_blobs() == 1 and store.index() == {"a": digest, "b": digest}
    store.delete("a")
    assert store.get("b") == FILES and store.num_blobs() == 1  # b still loads
    store.delete("b")
    assert store.num_blobs() == 0 and store.names() == []
    assert keys_under(redis_url, prefix) == {"seq"}  # no blob, no reference set, no upload left behind
    with pytest.raises(AdapterNotFoundError):
        store.get_content(digest)


def test_overwrites_move_references_and_drop_unreferenced_content(
    store: RedisStore, redis_url: str, prefix: str
) -> None:
    store.put("a", FILES)
    store.put("b", FILES)
    store.put("a", OTHER, overwrite=True)  # FILES is still b's
    assert store.num_blobs() == 2 and store.get("b") == FILES and store.get("a") == OTHER
    store.put("b", OTHER, overwrite=True)  # FILES has no name left
    assert store.num_blobs() == 1 and store.get_content(content_digest(OTHER)) == OTHER
    with pytest.raises(AdapterNotFoundError):
        store.get_content(content_digest(FILES))
    store.put("a", OTHER, overwrite=True)  # the same content again: nothing changes but the change number
    assert store.num_blobs() == 1
    assert keys_under(redis_url, prefix) == {
        "index",
        "seq",
        f"blob:{content_digest(OTHER)}",
        f"refs:{content_digest(OTHER)}",
    }


@pytest.mark.parametrize("sizes", [[0, 1, 7, 8, 100], [7 * 13]], ids=["ragged", "exact"])
def test_chunked_files_round_trip_byte_exact(
    redis_url: str, prefix: str, sizes: list[int], monkeypatch: pytest.MonkeyPatch
) -> None:
    files = {f"f{i}.bin": os.urandom(size) for i, size in enumerate(sizes)}
    tiny = RedisStore(redis_url, prefix=prefix, chunk_size=7)
    tiny.put("chunky", files)
    raw = redis.Redis.from_url(redis_url)
    try:
        blob = f"{prefix}blob:{content_digest(files)}"
        assert raw.hlen(blob) == 1 + sum(max(1, math.ceil(size / 7)) for size in sizes)  # manifest + chunks
        assert max(raw.hstrlen(blob, field) for field in raw.hkeys(blob) if field != b"manifest") <= 7
    finally:
        raw.close()
    monkeypatch.setattr(redis_store_module, "CHUNK_BYTES", 16)  # replies of at most ~16 bytes: many HMGETs
    assert tiny.get("chunky") == files
    default = RedisStore(redis_url, prefix=prefix)  # a reader with another chunk size reads it too
    assert default.get("chunky") == files and default.get_content(content_digest(files)) == files
    tiny.close()
    default.close()


def test_damaged_content_is_refused(store: RedisStore, redis_url: str, prefix: str) -> None:
    store.put("hurt", FILES)
    raw = redis.Redis.from_url(redis_url)
    try:
        raw.hset(f"{prefix}blob:{content_digest(FILES)}", "1:0", b"tampered")
    finally:
        raw.close()
    with pytest.raises(AdapterError, match="damaged"):
        store.get("hurt")


_FOLLOWER = textwrap.dedent(
    """
    import sys, time
    from loraserve.adapters import RedisStore
    catalog = RedisStore(sys.argv[1], prefix=sys.argv[2]).open_catalog()
    assert catalog.wait_ready(10) and catalog.up
    seen = catalog.lookup("shared")  # None: the parent writes only after "ready"
    print("ready", flush=True)
    deadline = time.time() + 30
    while time.time() < deadline:
        key = catalog.lookup("shared")  # a dictionary read: the catalog thread keeps it current
        if key != seen:
            seen = key
            print(f"{time.time()!r} {key}", flush=True)
            if key is None:
                break
        time.sleep(0.001)
    """
)


def test_a_delete_reaches_a_replica_in_another_process_within_a_second(store: RedisStore, prefix: str) -> None:
    follower = subprocess.Popen([sys.executable, "-c", _FOLLOWER, store.url, prefix], stdout=subprocess.PIPE, text=True)
    try:
        assert follower.stdout is not None
        assert follower.stdout.readline().strip() == "ready"
        store.put("shared", FILES)
        seen_at, key = follower.stdout.readline().split()
        assert key == content_digest(FILES)
        deleted_at = time.time()
        store.delete("shared")
        seen_at, key = follower.stdout.readline().split()
        assert key == "None"
        assert float(seen_at) - deleted_at < 5.0  # typically a millisecond: pushed (a lost connection: 15 s)
        assert follower.wait(timeout=10) == 0
    finally:
        follower.kill()
        follower.wait()


def test_a_catalog_re_reads_the_index_after_losing_its_connection(
    store: RedisStore, redis_url: str, prefix: str
) -> None:
    catalog = RedisStore(redis_url, prefix=prefix).open_catalog()
    try:
        assert catalog.wait_ready(5) and catalog.up
        store.put("seen", FILES)
        wait_until(lambda: catalog.lookup("seen") is not None, 1.0, "the catalog sees a published change")
        raw = redis.Redis.from_url(redis_url)
        try:
            # A change whose message is lost (written without one), then the connection drops:
            # only re-reading the index on reconnection can reveal it.
            raw.hset(f"{prefix}index", "unannounced", content_digest(FILES))
            raw.incr(f"{prefix}seq")
            assert catalog.lookup("unannounced") is None
            raw.client_kill_filter(_type="pubsub")
        finally:
            raw.close()
        wait_until(lambda: catalog.lookup("unannounced") is not None, 3.0, "the catalog re-reads the index")
        assert catalog.up and catalog.lookup("seen") == content_digest(FILES)
    finally:
        catalog.close()


def test_a_catalog_marks_an_outage_logs_it_once_and_reconnects_by_itself(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    server = RedisProcess(tmp_path / "redis").start()
    store = RedisStore(server.url, prefix="outage:")
    catalog = store.open_catalog()
    try:
        assert catalog.wait_ready(5) and catalog.up
        store.put("kept", FILES)
        caplog.set_level(logging.INFO, logger="loraserve.adapters.catalog")
        server.kill()
        wait_until(lambda: not catalog.up, 2.0, "the catalog notices the dead server")
        assert catalog.lookup("kept") == content_digest(FILES)  # the last map stays readable
        with pytest.raises(RegistryUnavailableError, match=r"adapter registry redis://127\.0\.0\.1:\d+/0"):
            store.put("new", OTHER)
        time.sleep(1.0)  # several reconnection attempts fail meanwhile
        server.start()  # same port, same data (append-only file)
        wait_until(lambda: catalog.up, 5.0, "the catalog reconnects by itself")
        store.put("new", OTHER)
        wait_until(lambda: catalog.lookup("new") is not None, 5.0, "changes flow again")
        assert catalog.lookup("kept") == content_digest(FILES)
        messages = [r.getMessage() for r in caplog.records if r.name == "loraserve.adapters.catalog"]
        assert sum("unreachable" in m for m in messages) == 1, messages  # once per outage, not per attempt
        assert sum("reachable again" in m for m in messages) == 1, messages
    finally:
        catalog.close()
        store.close()
        server.stop()


def test_a_catalog_notices_a_server_that_stops_answering(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A partition (here: the server frozen with SIGSTOP) closes no socket; the silence gives it away."""
    from loraserve.adapters import redis_catalog

    monkeypatch.setattr(redis_catalog, "PING_AFTER_S", 0.2)
    monkeypatch.setattr(redis_catalog, "SILENT_LIMIT_S", 1.0)
    server = RedisProcess(tmp_path / "redis").start()
    catalog = RedisStore(server.url, prefix="frozen:").open_catalog()
    try:
        assert catalog.wait_ready(5) and catalog.up
        assert server.process is not None
        server.process.send_signal(signal.SIGSTOP)
        try:
            wait_until(lambda: not catalog.up, 3.0, "the catalog notices the silent server")
            assert "no answer" in catalog.last_error or "Timeout" in catalog.last_error, catalog.last_error
        finally:
            server.process.send_signal(signal.SIGCONT)
        wait_until(lambda: catalog.up, 5.0, "the catalog reconnects once the server answers")
    finally:
        catalog.close()
        server.stop()


def test_the_directory_store_catalog_follows_another_process(tmp_path: Path) -> None:
    writer, reader = LocalDirStore(tmp_path / "shared"), LocalDirStore(tmp_path / "shared")
    catalog: AdapterCatalog = reader.open_catalog()
    try:
        assert catalog.wait_ready(5) and catalog.up and catalog.names() == []
        writer.put("x", FILES)  # through another store object, as another process would
        assert catalog.lookup("x") == writer.content_key("x")  # lookups read the link: at once
        assert reader.get_content(writer.content_key("x")) == FILES
        wait_until(lambda: catalog.names() == ["x"], 1.0, "the poll sees a put")
        writer.put("x", OTHER, overwrite=True)
        assert catalog.lookup("x") == writer.content_key("x")
        writer.delete("x")
        assert catalog.lookup("x") is None
        wait_until(lambda: catalog.num_names == 0, 1.0, "the poll sees a delete")
        assert catalog.lookup("../shared/.versions") is None  # never a path outside the root
    finally:
        catalog.close()


def test_a_catalog_thread_ends_at_close_or_once_the_catalog_is_dropped(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path)
    catalog = store.open_catalog()
    thread = catalog._thread
    assert thread is not None and thread.is_alive()
    catalog.close()
    assert not thread.is_alive()
    catalog = store.open_catalog()
    thread = catalog._thread
    assert thread is not None
    del catalog
    gc.collect()
    thread.join(2.0)  # it holds the catalog only weakly, between ticks
    assert not thread.is_alive()

"""Adapter stores (local directory and a real Redis server) and the registry (upload archives:
``test_adapter_archives.py``)."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from loraserve.adapters import (
    CONFIG_FILE,
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    AdapterRegistry,
    AdapterStore,
    BaseModelShapes,
    InvalidAdapterNameError,
    LocalDirStore,
    RedisStore,
    make_store,
    register_store_scheme,
)
from small_adapter import Files, adapter_files_fixture, shapes_and_files_fixture  # noqa: F401 (pytest fixtures)

# ---------------------------------------------------------------------------------------------
# Fixtures: a real redis-server, stores of both kinds (the small valid adapter: small_adapter.py)
# ---------------------------------------------------------------------------------------------


def _redis_store(redis_url: str, prefix: str) -> RedisStore:
    return RedisStore(redis_url, prefix=prefix)


@pytest.fixture(params=["dir", "redis"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[AdapterStore]:
    if request.param == "dir":
        yield LocalDirStore(tmp_path / "store")
        return
    # A fresh prefix per test isolates tests sharing the session's server.
    redis_store = _redis_store(request.getfixturevalue("redis_url"), f"test-{uuid.uuid4().hex}:")
    yield redis_store
    redis_store.close()


# ---------------------------------------------------------------------------------------------
# Store behaviour, identical for both kinds
# ---------------------------------------------------------------------------------------------


def test_put_get_names_contains_delete(store: AdapterStore) -> None:
    assert store.names() == []
    store.put("beta", {"a.json": b"{}", "w.bin2": b"\x00\x01"})
    store.put("alpha", {"a.json": b"[1]"})
    assert store.names() == ["alpha", "beta"]
    assert store.contains("beta") and not store.contains("gamma")
    assert store.get("beta") == {"a.json": b"{}", "w.bin2": b"\x00\x01"}
    store.delete("beta")
    assert store.names() == ["alpha"] and not store.contains("beta")
    with pytest.raises(AdapterNotFoundError, match="beta"):
        store.get("beta")


def test_duplicate_put_needs_overwrite(store: AdapterStore) -> None:
    store.put("x", {"f": b"1", "g": b"old"})
    with pytest.raises(AdapterExistsError, match="'x' already exists"):
        store.put("x", {"f": b"2"})
    assert store.get("x") == {"f": b"1", "g": b"old"}
    store.put("x", {"f": b"2"}, overwrite=True)
    assert store.get("x") == {"f": b"2"}  # replaced as a whole: no stale "g"
    store.put("new", {"f": b"3"}, overwrite=True)
    assert store.names() == ["new", "x"]


def test_missing_adapter_raises_not_found(store: AdapterStore) -> None:
    with pytest.raises(AdapterNotFoundError):
        store.get("nope")
    with pytest.raises(AdapterNotFoundError):
        store.delete("nope")


@pytest.mark.parametrize("name", ["", "../x", "a/b", "a\\b", ".hidden", "-x", "x" * 129, "a b", "é", "names:x"])
def test_bad_adapter_names_are_refused(store: AdapterStore, name: str) -> None:
    for call in (lambda: store.put(name, {"f": b"1"}), lambda: store.get(name), lambda: store.contains(name)):
        with pytest.raises(InvalidAdapterNameError, match="invalid adapter name"):
            call()
    assert store.names() == []


@pytest.mark.parametrize("files", [{}, {"../f": b"1"}, {".hidden": b"1"}, {"a/b": b"1"}])
def test_bad_file_sets_are_refused(store: AdapterStore, files: Files) -> None:
    with pytest.raises(AdapterError):
        store.put("ok", files)
    assert not store.contains("ok")


def test_readers_never_see_a_mix_of_two_versions(store: AdapterStore) -> None:
    versions = [{"a": bytes([i]) * 1000, "b": bytes([i]) * 2000} for i in range(2)]
    store.put("hot", versions[0])
    stop = threading.Event()
    errors: list[str] = []

    def write() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            store.put("hot", versions[i % 2], overwrite=True)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        for _ in range(300):
            files = store.get("hot")
            if files not in versions:
                errors.append(f"inconsistent read: { {k: v[:1] for k, v in files.items()} }")
    finally:
        stop.set()
        writer.join()
    assert errors == []


def test_two_redis_replicas_share_adapters(redis_url: str) -> None:
    prefix = f"replicas-{uuid.uuid4().hex}:"
    first, second = _redis_store(redis_url, prefix), _redis_store(redis_url, prefix)
    first.put("shared", {"f": b"payload"})
    assert second.names() == ["shared"] and second.get("shared") == {"f": b"payload"}
    with pytest.raises(AdapterExistsError):
        second.put("shared", {"f": b"other"})
    second.delete("shared")
    assert not first.contains("shared") and first.names() == []
    other_prefix = _redis_store(redis_url, f"other-{uuid.uuid4().hex}:")
    first.put("mine", {"f": b"1"})
    assert other_prefix.names() == []  # prefixes isolate deployments on one server


def test_local_store_crash_mid_write_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalDirStore(tmp_path)

    def failing_fsync(fd: int) -> None:
        raise OSError("disk on fire")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OSError, match="disk on fire"):
        store.put("x", {"a": b"1", "b": b"2"})
    monkeypatch.undo()
    assert store.names() == [] and not store.contains("x")
    assert list((tmp_path / ".versions").iterdir()) == []


def test_local_store_overwrites_and_deletes_at_once_leave_only_the_current_version(tmp_path: Path) -> None:
    """Two writers (two stores on one root, as two server processes) overwrite and delete one name
    at once: every replaced version is removed, none is left behind unreferenced."""
    stores = [LocalDirStore(tmp_path), LocalDirStore(tmp_path)]
    stores[0].put("hot", {"a": b"0"})

    def churn(store: LocalDirStore, seed: int) -> None:
        for i in range(150):
            if i % 10 == 9:
                with contextlib.suppress(AdapterNotFoundError):
                    store.delete("hot")
            else:
                store.put("hot", {"a": bytes([seed, i])}, overwrite=True)

    threads = [threading.Thread(target=churn, args=(store, seed)) for seed, store in enumerate(stores)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    left = sorted(path.name for path in (tmp_path / ".versions").iterdir())
    assert left == ([stores[0].content_key("hot")] if stores[0].contains("hot") else [])


def test_local_store_ignores_and_collects_orphaned_versions(tmp_path: Path) -> None:
    orphan = tmp_path / ".versions" / "ghost.0123"
    orphan.mkdir(parents=True)
    (orphan / "a").write_bytes(b"half")
    fresh = LocalDirStore(tmp_path)
    assert fresh.names() == [] and orphan.exists()  # young: may belong to a put in progress
    old = time.time() - 2 * 3600
    os.utime(orphan, (old, old))
    LocalDirStore(tmp_path)
    assert not orphan.exists()


def test_make_store_picks_the_kind_from_the_spec(tmp_path: Path, redis_url: str) -> None:
    assert isinstance(make_store(f"dir:{tmp_path / 'a'}"), LocalDirStore)
    plain = make_store(str(tmp_path / "b"))
    assert isinstance(plain, LocalDirStore) and plain.root == tmp_path / "b"
    remote = make_store(redis_url)
    assert isinstance(remote, RedisStore)
    remote.close()
    made: list[str] = []

    def factory(spec: str) -> AdapterStore:
        made.append(spec)
        return LocalDirStore(tmp_path / "custom")

    register_store_scheme("memtest", factory)
    make_store("memtest:thing")
    assert made == ["memtest:thing"]


# ---------------------------------------------------------------------------------------------
# Registry
# ---------------------------------------------------------------------------------------------


def test_registry_registers_loads_and_describes(
    store: AdapterStore, shapes_and_files: tuple[BaseModelShapes, Files]
) -> None:
    shapes, files = shapes_and_files
    registry = AdapterRegistry(store, shapes)
    info = registry.register("tenant-a", {**files, "README.md": b"dropped"})
    assert store.get("tenant-a") == files  # only the two PEFT files are kept
    assert info.name == "tenant-a" and info.rank == 2 and info.target_modules == ("down_proj", "q_proj")
    assert info.ranks == {"down_proj": 2, "q_proj": 2}
    adapter = registry.load("tenant-a")
    assert adapter.digest == info.digest and info.num_bytes == adapter.num_bytes == 4 * info.num_parameters
    assert registry.info("tenant-a") == info
    assert info.to_dict()["target_modules"] == ["down_proj", "q_proj"]
    with pytest.raises(AdapterExistsError):
        registry.register("tenant-a", files)
    assert registry.register("tenant-b", files).digest == info.digest  # content, not name
    assert registry.names() == ["tenant-a", "tenant-b"]
    registry.delete("tenant-a")
    assert registry.names() == ["tenant-b"] and not registry.contains("tenant-a")


def test_registry_validates_before_storing(
    store: AdapterStore, shapes_and_files: tuple[BaseModelShapes, Files]
) -> None:
    shapes, files = shapes_and_files
    registry = AdapterRegistry(store, shapes)
    broken = {**files, CONFIG_FILE: files[CONFIG_FILE].replace(b'"use_dora": false', b'"use_dora": true')}
    with pytest.raises(AdapterError, match="DoRA"):
        registry.register("bad", broken)
    with pytest.raises(AdapterError, match="missing"):
        registry.register("bad", {CONFIG_FILE: files[CONFIG_FILE]})
    with pytest.raises(InvalidAdapterNameError):
        registry.register("../bad", files)
    assert store.names() == [] and not store.contains("bad")
    registry.register("good", files)
    with pytest.raises(AdapterError):
        registry.register("good", broken, overwrite=True)
    assert store.get("good") == files  # a failed overwrite keeps the old adapter


def test_register_from_path_is_confined_to_allowed_roots(
    tmp_path: Path, shapes_and_files: tuple[BaseModelShapes, Files]
) -> None:
    shapes, files = shapes_and_files
    allowed, outside = tmp_path / "allowed", tmp_path / "outside"
    for directory in (allowed / "ok", outside / "secret"):
        directory.mkdir(parents=True)
        for name, content in files.items():
            (directory / name).write_bytes(content)
    (allowed / "sneaky").symlink_to(outside / "secret")
    registry = AdapterRegistry(LocalDirStore(tmp_path / "store"), shapes, allowed_roots=[allowed])
    assert registry.register_from_path("ok", allowed / "ok").name == "ok"
    for path in (outside / "secret", allowed / "sneaky", allowed / ".." / "outside" / "secret"):
        with pytest.raises(AdapterError, match="must be under"):
            registry.register_from_path("nope", path)
    assert registry.names() == ["ok"]


def test_the_stores_do_not_import_each_other() -> None:
    """store.py and redis_store.py form no import loop: make_store lives in store_factory.py."""
    import ast

    root = Path(__file__).resolve().parents[1] / "adapters"
    imported = {
        name: {
            node.module or ""
            for node in ast.walk(ast.parse((root / f"{name}.py").read_text()))
            if isinstance(node, ast.ImportFrom)
        }
        for name in ("store", "redis_store")
    }
    assert "redis_store" not in imported["store"] and ".redis_store" not in str(imported["store"])
    assert "store" in imported["redis_store"]  # the base class, one way only

"""Adapter stores (local directory and a real Redis server), upload archives, and the registry."""

from __future__ import annotations

import io
import os
import tarfile
import threading
import time
import uuid
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from adapter_factory import make_peft_adapter, make_tiny_llama
from loraserve.adapters import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    AdapterExistsError,
    AdapterNotFoundError,
    AdapterRegistry,
    AdapterStore,
    AdapterTooLargeError,
    BaseModelShapes,
    InvalidAdapterNameError,
    LocalDirStore,
    RedisStore,
    extract_adapter_archive,
    make_store,
    read_adapter_dir,
    register_store_scheme,
)

Files = dict[str, bytes]


# ---------------------------------------------------------------------------------------------
# Fixtures: a real redis-server, stores of both kinds, a small valid adapter
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


@pytest.fixture(scope="module")
def shapes_and_files(tmp_path_factory: pytest.TempPathFactory) -> tuple[BaseModelShapes, Files]:
    model = make_tiny_llama(num_layers=2, hidden=32, intermediate=64, heads=2, kv_heads=1)
    path = make_peft_adapter(model, tmp_path_factory.mktemp("adapter"), rank=2, target_modules=["q_proj", "down_proj"])
    return BaseModelShapes.from_hf_config(model.config), read_adapter_dir(path)


@pytest.fixture()
def adapter_files(shapes_and_files: tuple[BaseModelShapes, Files]) -> Files:
    return dict(shapes_and_files[1])


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
# Upload archives
# ---------------------------------------------------------------------------------------------


def _zip(entries: dict[str, bytes], symlinks: dict[str, str] | None = None) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, content in entries.items():
            archive.writestr(name, content)
        for name, target in (symlinks or {}).items():
            info = zipfile.ZipInfo(name)
            info.create_system = 3
            info.external_attr = 0o120777 << 16
            archive.writestr(info, target)
    return buffer.getvalue()


def _tar(entries: dict[str, bytes], mode: str = "w:gz", extra: list[tarfile.TarInfo] | None = None) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as archive:
        for name, content in entries.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            archive.addfile(info, io.BytesIO(content))
        for info in extra or []:
            archive.addfile(info)
    return buffer.getvalue()


def _tar_special(name: str, kind: bytes, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    return info


def _nest(files: Files, folder: str) -> Files:
    return {f"{folder}/{name}": content for name, content in files.items()}


@pytest.mark.parametrize(
    "build",
    [
        lambda f: _zip(f),
        lambda f: _zip({**_nest(f, "my-adapter"), "my-adapter/README.md": b"hi", "my-adapter/training_args.bin": b"x"}),
        lambda f: _tar(_nest(f, "./lora")),
        lambda f: _tar(f, mode="w"),
        lambda f: _tar({**f, "checkpoint/optimizer.pt": b"x"}, mode="w:gz"),
    ],
    ids=["zip-root", "zip-nested-with-extras", "tgz-nested", "tar-root", "tgz-extras"],
)
def test_good_archives_extract_the_two_files(build: Callable[[Files], bytes], adapter_files: Files) -> None:
    assert extract_adapter_archive(build(adapter_files)) == adapter_files


BAD_ARCHIVES: dict[str, tuple[Callable[[Files], bytes], str]] = {
    "zip-traversal": (lambda f: _zip({**f, "../evil": b"x"}), "path traversal"),
    "zip-absolute": (lambda f: _zip({**f, "/etc/evil": b"x"}), "absolute"),
    "zip-symlink": (lambda f: _zip(f, symlinks={"link": "/etc/passwd"}), "links"),
    "tar-traversal": (lambda f: _tar({**_nest(f, "a"), "a/../../evil": b"x"}), "path traversal"),
    "tar-symlink": (lambda f: _tar(f, extra=[_tar_special("x", tarfile.SYMTYPE, "/etc/passwd")]), "links"),
    "tar-hardlink": (lambda f: _tar(f, extra=[_tar_special("h", tarfile.LNKTYPE, CONFIG_FILE)]), "links"),
    "tar-device": (lambda f: _tar(f, extra=[_tar_special("dev", tarfile.CHRTYPE)]), "special files"),
    "tar-fifo": (lambda f: _tar(f, extra=[_tar_special("fifo", tarfile.FIFOTYPE)]), "special files"),
    "not-an-archive": (lambda f: b"just some bytes", "not a .zip"),
    "truncated-zip": (lambda f: _zip(f)[:200], "corrupt zip"),
    "truncated-tgz": (lambda f: _tar(f)[:100], "corrupt gzip"),
    "pickle-only": (lambda f: _zip({CONFIG_FILE: f[CONFIG_FILE], "adapter_model.bin": b"\x80"}), "pickle"),
    "no-config": (lambda f: _zip({WEIGHTS_FILE: f[WEIGHTS_FILE]}), "no adapter_config.json"),
    "two-deep": (lambda f: _zip(_nest(_nest(f, "a"), "b")), "no adapter_config.json"),
    "two-adapters": (lambda f: _zip({**_nest(f, "a"), **_nest(f, "b")}), "several adapters"),
    "duplicate": (lambda f: _tar({**f, f"./{CONFIG_FILE}": b"{}"}), "more than once"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARCHIVES))
def test_bad_archives_are_refused(case: str, adapter_files: Files) -> None:
    build, fragment = BAD_ARCHIVES[case]
    with pytest.raises(AdapterError, match=fragment):
        extract_adapter_archive(build(adapter_files))


@pytest.mark.parametrize("pack", [_zip, _tar], ids=["zip", "tgz"])
def test_size_limits_raise_too_large(pack: Callable[[Files], bytes], adapter_files: Files) -> None:
    bomb = pack({**adapter_files, "padding.txt": b"\x00" * 4_000_000})
    assert len(bomb) < 100_000  # compresses well: a small upload that expands a lot
    with pytest.raises(AdapterTooLargeError, match="limit"):
        extract_adapter_archive(bomb, max_total_bytes=1_000_000)
    many = pack({**adapter_files, **{f"f{i}.txt": b"" for i in range(20)}})
    with pytest.raises(AdapterTooLargeError, match="members"):
        extract_adapter_archive(many, max_members=10)
    assert extract_adapter_archive(bomb, max_total_bytes=5_000_000) == adapter_files


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

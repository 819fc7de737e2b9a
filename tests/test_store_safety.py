"""What the stores never do: act on entries of a registry directory they did not make (an operator's
link to their own adapter folder, a plain folder), or show a Redis password."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from loraserve.adapters import AdapterNotFoundError, LocalDirStore, RedisStore, RegistryConflictError
from loraserve.adapters.redis_store import _redact

FILES = {"adapter_config.json": b"{}", "adapter_model.safetensors": b"weights"}


@pytest.fixture
def operator_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "my-loras" / "mine"
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    return folder


@pytest.mark.parametrize("entry", ["link", "folder", "file"])
def test_entries_the_directory_store_did_not_make_are_never_read_replaced_or_removed(
    tmp_path: Path, operator_folder: Path, entry: str
) -> None:
    """Deleting or overwriting an operator's ``ln -s ~/loras/mine registry/mine`` removed the
    folder it points to; a plain folder or file by an adapter's name gave 409s and 500s."""
    store = LocalDirStore(tmp_path / "registry")
    stray = store.root / "mine"
    if entry == "link":
        stray.symlink_to(operator_folder)
    elif entry == "folder":
        stray.mkdir()
    else:
        stray.write_text("notes")
    assert store.names() == [] and store.index() == {} and not store.contains("mine")
    with pytest.raises(AdapterNotFoundError):
        store.get("mine")
    with pytest.raises(AdapterNotFoundError):
        store.content_key("mine")
    with pytest.raises(AdapterNotFoundError):
        store.delete("mine")
    for overwrite in (False, True):
        with pytest.raises(RegistryConflictError, match="is in the way"):
            store.put("mine", FILES, overwrite=overwrite)
    assert (operator_folder / "adapter_config.json").read_text() == "{}"  # untouched
    assert os.path.lexists(stray) and list((store.root / ".versions").iterdir()) == []  # nothing left behind
    store.put("other", FILES)  # the store's own entries work as before
    assert store.names() == ["other"] and store.get("other") == FILES
    store.delete("other")
    assert store.names() == [] and list((store.root / ".versions").iterdir()) == []


def test_a_link_into_the_versions_of_another_name_is_not_an_adapter(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path / "registry")
    store.put("real", FILES)
    (store.root / "alias").symlink_to(Path(".versions") / store.content_key("real"))
    assert store.names() == ["real"] and not store.contains("alias")
    with pytest.raises(AdapterNotFoundError):
        store.delete("alias")
    assert store.get("real") == FILES


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("redis://host:6379/0?password=s3cret", "redis://host:6379/0?password=***"),
        ("redis://user:s3cret@host:6379/0", "redis://user:***@host:6379/0"),
        ("rediss://:s3cret@host/0?ssl_cert_reqs=none", "rediss://:***@host/0?ssl_cert_reqs=none"),
        ("unix:///run/redis.sock?db=2&Password=s3cret", "unix:/run/redis.sock?db=2&Password=***"),
        ("redis://host:6379/0", "redis://host:6379/0"),
    ],
)
def test_redis_passwords_are_never_shown(url: str, shown: str) -> None:
    """A password in the query (redis-py reads ``?password=``) reached 503 bodies and logs."""
    assert _redact(url) == shown
    store = RedisStore(url)  # connects on first use only
    assert "s3cret" not in repr(store) and "s3cret" not in store.description

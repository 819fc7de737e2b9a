"""The local directory store: adapters as directories under a root, each version published atomically
(the shared store for several replicas: :mod:`.redis_store`)."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Hashable, Iterator, Mapping
from pathlib import Path

from .catalog import AdapterCatalog, PollingCatalog
from .errors import AdapterExistsError, AdapterNotFoundError, RegistryConflictError
from .store import ADAPTER_NAME_PATTERN, AdapterStore, validate_adapter_name, validate_file_names

logger = logging.getLogger(__name__)


class LocalDirStore(AdapterStore):
    """Adapters as directories under ``root``, published atomically.

    Layout: ``root/.versions/<name>.<id>/<file>`` holds one immutable version; ``root/<name>`` is a
    relative symlink to the current version. A put writes and fsyncs a new version directory, then
    creates (or atomically replaces) the symlink, so a crash leaves at worst an unreferenced
    version directory and readers always see a complete adapter.
    """

    _VERSIONS = ".versions"
    _LOCKS = ".locks"
    _NUM_READ_ATTEMPTS = 5
    # Unreferenced versions older than this are left by crashed writers and are removed on start-up;
    # younger ones may belong to a put still in progress in another process.
    _ORPHAN_AGE_S = 3600.0

    # Directory mtimes are as coarse as the kernel's clock tick (and NFS caches them): a change this
    # recent may share its mtime with a later one, so the change token says "cannot tell".
    _RACY_MTIME_S = 2.0

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._versions = self.root / self._VERSIONS
        self._versions.mkdir(parents=True, exist_ok=True)
        self._locks = self.root / self._LOCKS  # made at the first put or delete
        self._remove_orphans()

    def __repr__(self) -> str:
        return f"LocalDirStore({str(self.root)!r})"

    def put(self, name: str, files: Mapping[str, bytes], *, overwrite: bool = False) -> None:
        link = self.root / validate_adapter_name(name)
        validate_file_names(files)
        version = self._write_version(name, files)
        target = os.path.join(self._VERSIONS, version.name)
        with self._name_lock(name):  # so two writers never both replace (and remove) the same version
            try:
                self._check_not_foreign(name)
            except RegistryConflictError:
                shutil.rmtree(version, ignore_errors=True)
                raise
            if not overwrite:
                try:
                    os.symlink(target, link)  # atomic create-if-absent
                except FileExistsError:
                    shutil.rmtree(version, ignore_errors=True)
                    raise AdapterExistsError(f"adapter {name!r} already exists") from None
                _fsync_dir(self.root)
                self._notify(name, version.name)
                return
            previous = self._current_version(name)
            temp_link = self.root / f".link-{name}.{uuid.uuid4().hex}"
            os.symlink(target, temp_link)
            try:
                os.replace(temp_link, link)  # atomic swap: readers see the old or the new version
            except BaseException:
                temp_link.unlink(missing_ok=True)
                shutil.rmtree(version, ignore_errors=True)
                raise
            _fsync_dir(self.root)
            self._notify(name, version.name)
            if previous is not None and previous != version:
                shutil.rmtree(previous, ignore_errors=True)

    def get(self, name: str) -> dict[str, bytes]:
        validate_adapter_name(name)
        # A concurrent overwrite or delete may remove the version being read; then re-resolve and retry.
        for _ in range(self._NUM_READ_ATTEMPTS):
            version = self._current_version(name)
            if version is None:
                break
            try:
                files = {path.name: path.read_bytes() for path in sorted(version.iterdir())}
            except FileNotFoundError:
                continue
            # Writers repoint the link before removing a version, so if it still points here, no
            # removal had started while we read: the files are complete.
            if self._current_version(name) == version:
                return files
        raise AdapterNotFoundError(f"adapter {name!r} not found")

    def delete(self, name: str) -> None:
        with self._name_lock(validate_adapter_name(name)):
            version = self._current_version(name)
            if version is None:  # absent, or an entry this store did not make: left as it is
                raise AdapterNotFoundError(f"adapter {name!r} not found")
            try:
                os.unlink(self.root / name)
            except FileNotFoundError:
                raise AdapterNotFoundError(f"adapter {name!r} not found") from None
            _fsync_dir(self.root)
            self._notify(name, None)
            shutil.rmtree(version, ignore_errors=True)

    def names(self) -> list[str]:
        return sorted(self.index())

    def contains(self, name: str) -> bool:
        return self._current_version(validate_adapter_name(name)) is not None

    def content_key(self, name: str) -> str:
        """The version directory's name (``<name>.<random hex>``)."""
        version = self._current_version(validate_adapter_name(name))
        if version is None:
            raise AdapterNotFoundError(f"adapter {name!r} not found")
        return version.name

    def get_content(self, key: str) -> dict[str, bytes]:
        match = _VERSION_PATTERN.fullmatch(key) if isinstance(key, str) else None
        if match is None:
            raise AdapterNotFoundError(f"no adapter content {key!r} in {self!r}")
        version = self._versions / key
        try:
            files = {path.name: path.read_bytes() for path in sorted(version.iterdir())}
        except FileNotFoundError:
            raise AdapterNotFoundError(f"adapter content {key!r} is no longer stored") from None
        # As in get: writers repoint the link before removing a version, so if the name still points
        # here, no removal had started while we read and the files are complete.
        if self._current_version(match["name"]) != version:
            raise AdapterNotFoundError(f"adapter content {key!r} is no longer stored")
        return files

    def index(self) -> dict[str, str]:
        keys: dict[str, str] = {}
        for entry in self.root.iterdir():
            if ADAPTER_NAME_PATTERN.fullmatch(entry.name):
                version = self._current_version(entry.name)
                if version is not None:
                    keys[entry.name] = version.name
        return keys

    def open_catalog(self) -> AdapterCatalog:
        """A polling catalog whose lookups read the name's link (one ``readlink``, no file contents):
        a change made by another process is seen at once. The poll keeps the names count and
        whether the directory is reachable."""
        catalog = PollingCatalog(self.index, self.change_token, repr(self), probe=self._probe)
        return self._track(catalog).start()

    def _probe(self, name: str) -> str | None:
        """The content key of ``name`` now, None if it is not stored; raises OSError if the
        directory cannot be read (the catalog then marks the registry down)."""
        if not isinstance(name, str) or ADAPTER_NAME_PATTERN.fullmatch(name) is None:
            return None  # never a path outside root
        version = self._current_version(name)
        return None if version is None else version.name

    def change_token(self) -> Hashable | None:
        """The root directory's inode and mtime (every put and delete changes an entry there)."""
        stat = os.stat(self.root)
        if time.time_ns() - stat.st_mtime_ns < self._RACY_MTIME_S * 1e9:
            return None
        return (stat.st_ino, stat.st_mtime_ns)

    @contextlib.contextmanager
    def _name_lock(self, name: str) -> Iterator[None]:
        """An exclusive lock on ``name`` among the processes and threads using this root (an
        advisory ``flock`` on ``root/.locks/<name>``) for the link change and the removal of the
        version it replaced: one reader of the previous version at a time. Not re-entrant. On a
        file system without ``flock`` (NFS mounted ``nolock``, ...) it goes on unlocked, as before
        the lock existed: concurrent writers of one name may then leave an unreferenced version."""
        self._locks.mkdir(exist_ok=True)
        fd = os.open(self._locks / name, os.O_RDONLY | os.O_CREAT, 0o666)
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
            except OSError as error:
                if error.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                    raise
                logger.warning("%r: no file locks here (%s); writing %r unlocked", self, error.strerror, name)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _current_version(self, name: str) -> Path | None:
        """The version directory ``name``'s link points to; None if ``name`` is absent or is not a
        link this store made (``.versions/<name>.<32 hex>``): an entry someone else put in the
        root, a link to a folder elsewhere, is never read, replaced into or removed as a version."""
        try:
            target = os.readlink(self.root / name)
        except OSError as error:
            if error.errno in (errno.ENOENT, errno.EINVAL, errno.ENOTDIR):  # absent, or not a link
                return None
            raise
        parent, _, version = target.partition(os.sep)
        match = _VERSION_PATTERN.fullmatch(version)
        if parent != self._VERSIONS or match is None or match["name"] != name:
            return None
        return self._versions / version

    def _check_not_foreign(self, name: str) -> None:
        """Refuse to write over an entry of the root that is not an adapter link of this store."""
        if os.path.lexists(self.root / name) and self._current_version(name) is None:
            raise RegistryConflictError(
                f"{self.root / name} is in the way: the adapter registry's directory holds an entry by that name "
                "that is not an adapter link it made (move it away, or register the adapter under another name)"
            )

    def _write_version(self, name: str, files: Mapping[str, bytes]) -> Path:
        version = self._versions / f"{name}.{uuid.uuid4().hex}"
        version.mkdir()
        try:
            for file_name, content in files.items():
                with open(version / file_name, "wb") as handle:
                    handle.write(content)
                    handle.flush()
                    os.fsync(handle.fileno())
            _fsync_dir(version)
            _fsync_dir(self._versions)  # the version's own entry, before a link to it is published
        except BaseException:
            shutil.rmtree(version, ignore_errors=True)
            raise
        return version

    def _remove_orphans(self) -> None:
        referenced = {self._current_version(name) for name in self.names()}
        cutoff = time.time() - self._ORPHAN_AGE_S
        for version in self._versions.iterdir():
            try:
                modified = version.stat().st_mtime
            except FileNotFoundError:  # removed meanwhile by another process sharing the root
                continue
            if version not in referenced and modified < cutoff:
                logger.info("removing unreferenced adapter version %s", version)
                shutil.rmtree(version, ignore_errors=True)


# A version directory's name: the adapter's name, a dot, 32 hex digits (see _write_version).
_VERSION_PATTERN = re.compile(r"(?P<name>[A-Za-z0-9][A-Za-z0-9._-]{0,127})\.[0-9a-f]{32}")


def _fsync_dir(path: Path) -> None:
    """Persist a directory entry change (new file, rename) across a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

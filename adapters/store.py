"""Where validated adapter files live, by name: the store interface and the local directory store.

:mod:`.redis_store` holds the shared store for several replicas; :mod:`.store_factory` builds
either from a spec.

Stores hold opaque files; validating their content is :class:`.registry.AdapterRegistry`'s job.
"""

from __future__ import annotations

import abc
import logging
import os
import re
import shutil
import time
import uuid
from collections.abc import Mapping
from pathlib import Path

from .errors import AdapterError, AdapterExistsError, AdapterNotFoundError, InvalidAdapterNameError

logger = logging.getLogger(__name__)

ADAPTER_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# File names inside an adapter: one path component, no leading dot.
FILE_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,254}")


def validate_adapter_name(name: str) -> str:
    """Return ``name`` if it is a valid adapter name, else raise :class:`InvalidAdapterNameError`."""
    if not isinstance(name, str) or ADAPTER_NAME_PATTERN.fullmatch(name) is None:
        raise InvalidAdapterNameError(
            f"invalid adapter name {name!r}: use 1-128 characters from A-Z a-z 0-9 . _ -, starting with a "
            "letter or digit (no path separators)"
        )
    return name


def validate_file_names(files: Mapping[str, bytes]) -> None:
    """Refuse an empty file set, names that are not one safe path component, and non-bytes contents."""
    if not files:
        raise AdapterError("an adapter needs at least one file")
    for file_name, content in files.items():
        if not isinstance(file_name, str) or FILE_NAME_PATTERN.fullmatch(file_name) is None:
            raise InvalidAdapterNameError(f"invalid adapter file name {file_name!r}")
        if not isinstance(content, bytes | bytearray | memoryview):
            raise TypeError(f"adapter file {file_name!r} must be bytes, got {type(content).__name__}")


class AdapterStore(abc.ABC):
    """Named sets of adapter files. Implementations are safe to use from several processes.

    A reader sees either a complete adapter or none: never a partly written or partly replaced one.
    """

    @abc.abstractmethod
    def put(self, name: str, files: Mapping[str, bytes], *, overwrite: bool = False) -> None:
        """Store ``files`` under ``name``; raise :class:`AdapterExistsError` if present and not ``overwrite``."""

    @abc.abstractmethod
    def get(self, name: str) -> dict[str, bytes]:
        """Return the files stored under ``name``; raise :class:`AdapterNotFoundError` if absent."""

    @abc.abstractmethod
    def delete(self, name: str) -> None:
        """Remove ``name``; raise :class:`AdapterNotFoundError` if absent."""

    @abc.abstractmethod
    def names(self) -> list[str]:
        """Sorted names of all stored adapters."""

    @abc.abstractmethod
    def version(self, name: str) -> str:
        """A token that changes whenever ``name`` is written again (cheap; no file contents read).

        Raises :class:`AdapterNotFoundError` if ``name`` is not stored.
        """

    @abc.abstractmethod
    def contains(self, name: str) -> bool:
        """Whether ``name`` is stored."""


class LocalDirStore(AdapterStore):
    """Adapters as directories under ``root``, published atomically.

    Layout: ``root/.versions/<name>.<id>/<file>`` holds one immutable version; ``root/<name>`` is a
    relative symlink to the current version. A put writes and fsyncs a new version directory, then
    creates (or atomically replaces) the symlink, so a crash leaves at worst an unreferenced
    version directory and readers always see a complete adapter.
    """

    _VERSIONS = ".versions"
    _NUM_READ_ATTEMPTS = 5
    # Unreferenced versions older than this are left by crashed writers and are removed on start-up;
    # younger ones may belong to a put still in progress in another process.
    _ORPHAN_AGE_S = 3600.0

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self._versions = self.root / self._VERSIONS
        self._versions.mkdir(parents=True, exist_ok=True)
        self._remove_orphans()

    def __repr__(self) -> str:
        return f"LocalDirStore({str(self.root)!r})"

    def put(self, name: str, files: Mapping[str, bytes], *, overwrite: bool = False) -> None:
        link = self.root / validate_adapter_name(name)
        validate_file_names(files)
        version = self._write_version(name, files)
        target = os.path.join(self._VERSIONS, version.name)
        if not overwrite:
            try:
                os.symlink(target, link)  # atomic create-if-absent
            except FileExistsError:
                shutil.rmtree(version, ignore_errors=True)
                raise AdapterExistsError(f"adapter {name!r} already exists") from None
            _fsync_dir(self.root)
            return
        previous = self._current_version(name)
        temp_link = self.root / f".link-{name}.{uuid.uuid4().hex}"
        os.symlink(target, temp_link)
        os.replace(temp_link, link)  # atomic swap: readers see the old or the new version
        _fsync_dir(self.root)
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
        version = self._current_version(validate_adapter_name(name))
        try:
            os.unlink(self.root / name)
        except FileNotFoundError:
            raise AdapterNotFoundError(f"adapter {name!r} not found") from None
        _fsync_dir(self.root)
        if version is not None:
            shutil.rmtree(version, ignore_errors=True)

    def names(self) -> list[str]:
        return sorted(
            entry.name
            for entry in self.root.iterdir()
            if entry.is_symlink() and ADAPTER_NAME_PATTERN.fullmatch(entry.name)
        )

    def contains(self, name: str) -> bool:
        return (self.root / validate_adapter_name(name)).is_symlink()

    def version(self, name: str) -> str:
        version = self._current_version(validate_adapter_name(name))
        if version is None:
            raise AdapterNotFoundError(f"adapter {name!r} not found")
        return version.name

    def _current_version(self, name: str) -> Path | None:
        try:
            target = os.readlink(self.root / name)
        except OSError:  # absent, or not a link
            return None
        return self.root / target

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
        except BaseException:
            shutil.rmtree(version, ignore_errors=True)
            raise
        return version

    def _remove_orphans(self) -> None:
        referenced = {self._current_version(name) for name in self.names()}
        cutoff = time.time() - self._ORPHAN_AGE_S
        for version in self._versions.iterdir():
            if version not in referenced and version.stat().st_mtime < cutoff:
                logger.info("removing unreferenced adapter version %s", version)
                shutil.rmtree(version, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    """Persist a directory entry change (new file, rename) across a crash."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)

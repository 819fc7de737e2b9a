"""Safe extraction of an uploaded adapter archive (.zip, .tar.gz/.tgz, or plain .tar) into memory.

Nothing is written to disk. Every member name is checked (no absolute paths, no ``..``), links
and device files are refused, and both the member count and the uncompressed size are bounded
*while* decompressing, so a zip or gzip bomb costs at most the limit in memory and time.
"""

from __future__ import annotations

import io
import logging
import posixpath
import stat
import struct
import tarfile
import zipfile
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import IO

from .errors import AdapterError, AdapterTooLargeError
from .peft_format import CONFIG_FILE, PICKLE_SUFFIXES, WEIGHTS_FILE

logger = logging.getLogger(__name__)

DEFAULT_MAX_MEMBERS = 256
DEFAULT_MAX_TOTAL_BYTES = 2 * 1024**3
_CHUNK_BYTES = 1024 * 1024
# Tar framing around file data: one 512-byte header per member (pax headers may add more), data
# padded to 512 bytes, and the end-of-archive blocks padded to a 10 KiB record.
_TAR_BYTES_PER_MEMBER = 3 * 512
_TAR_TRAILER_BYTES = 20 * 512


@dataclass(frozen=True)
class _Member:
    """A regular file in the archive: its normalised path and declared size."""

    path: str
    size: int


def extract_adapter_archive(
    data: bytes,
    *,
    max_members: int = DEFAULT_MAX_MEMBERS,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
) -> dict[str, bytes]:
    """Return ``{"adapter_config.json": ..., "adapter_model.safetensors": ...}`` from an archive.

    The PEFT files may sit at the archive root or inside one top-level folder. Raises
    :class:`AdapterTooLargeError` when the archive has more than ``max_members`` members or more
    than ``max_total_bytes`` of uncompressed content, and :class:`AdapterError` for anything else
    wrong (unknown format, corrupt archive, unsafe member, missing or ambiguous files).
    """
    if data.startswith((b"PK\x03\x04", b"PK\x05\x06")):
        return _as_adapter_error("zip", lambda: _extract_zip(data, max_members, max_total_bytes))
    if data.startswith(b"\x1f\x8b"):
        limit = max_total_bytes + max_members * _TAR_BYTES_PER_MEMBER + _TAR_TRAILER_BYTES
        tar = _gunzip_bounded(data, limit, max_total_bytes)
        return _as_adapter_error("tar", lambda: _extract_tar(tar, max_members, max_total_bytes))
    if data[257:262] == b"ustar":
        return _as_adapter_error("tar", lambda: _extract_tar(data, max_members, max_total_bytes))
    raise AdapterError("upload is not a .zip, .tar.gz/.tgz or .tar archive")


def _as_adapter_error(kind: str, extract: Callable[[], dict[str, bytes]]) -> dict[str, bytes]:
    """``extract()``, where any other error than ours is a damaged archive: the standard library's
    readers raise many kinds on one (``ValueError``, ``IndexError``, ``NotImplementedError``,
    ``UnicodeDecodeError``, lzma's ...), and each must be a 400 naming the archive, not a 500."""
    try:
        return extract()
    except (AdapterError, MemoryError):
        raise
    except Exception as exc:
        raise AdapterError(f"corrupt {kind} archive: {type(exc).__name__}: {exc}") from exc


def _safe_path(name: str) -> str:
    """Normalise a member name; refuse absolute paths, drive letters and parent references."""
    if "\x00" in name or "\\" in name:
        raise AdapterError(f"archive member {name!r}: unsafe characters in name")
    if name.startswith("/") or (len(name) > 1 and name[1] == ":"):
        raise AdapterError(f"archive member {name!r}: absolute paths are not allowed")
    parts = [part for part in name.split("/") if part not in ("", ".")]
    if ".." in parts:
        raise AdapterError(f"archive member {name!r}: path traversal ('..') is not allowed")
    return posixpath.join(*parts) if parts else ""


def _check_members(members: list[_Member], num_members: int, max_members: int, max_total_bytes: int) -> None:
    """Enforce the limits on declared sizes, and refuse duplicate paths (which copy would win is ambiguous)."""
    if num_members > max_members:
        raise AdapterTooLargeError(f"archive has {num_members} members; the limit is {max_members}")
    seen: set[str] = set()
    for member in members:
        if member.path in seen:
            raise AdapterError(f"archive member {member.path!r} appears more than once")
        seen.add(member.path)
    total = sum(member.size for member in members)
    if total > max_total_bytes:
        raise AdapterTooLargeError(f"archive expands to {total} bytes; the limit is {max_total_bytes} bytes")


def _select_adapter_files(members: Iterable[_Member]) -> dict[str, str]:
    """Pick the PEFT files at the root or one folder deep; map file name -> member path."""
    by_folder: dict[str, dict[str, str]] = {}
    for member in members:
        folder, file_name = posixpath.split(member.path)
        if "/" in folder:
            continue
        by_folder.setdefault(folder, {})[file_name] = member.path
    candidates = {folder: files for folder, files in by_folder.items() if CONFIG_FILE in files}
    if not candidates:
        raise AdapterError(f"archive has no {CONFIG_FILE} at its root or one folder deep")
    if len(candidates) > 1:
        raise AdapterError(f"archive holds several adapters (folders {sorted(candidates)}); upload one")
    folder, files = next(iter(candidates.items()))
    if WEIGHTS_FILE not in files:
        pickled = sorted(f for f in files if f.startswith("adapter_model.") and f.endswith(PICKLE_SUFFIXES))
        if pickled:
            raise AdapterError(
                f"archive member {files[pickled[0]]!r}: pickle checkpoints are refused (they can run code "
                f"when loaded); save the adapter with safetensors ({WEIGHTS_FILE})"
            )
        raise AdapterError(f"archive has {CONFIG_FILE} but no {WEIGHTS_FILE} beside it (folder {folder!r})")
    return {CONFIG_FILE: files[CONFIG_FILE], WEIGHTS_FILE: files[WEIGHTS_FILE]}


def _read_bounded(stream: IO[bytes], path: str, size: int, budget: int) -> bytes:
    """Read one member, trusting neither its declared size nor the remaining budget to hold."""
    buffer = bytearray()
    while True:
        chunk = stream.read(_CHUNK_BYTES)
        if not chunk:
            break
        buffer += chunk
        if len(buffer) > min(size, budget):
            if len(buffer) > budget:
                raise AdapterTooLargeError(f"archive member {path!r} expands past the size limit")
            raise AdapterError(f"archive member {path!r} is larger than its declared size {size}")
    return bytes(buffer)


# The most central-directory bytes a member may take: its 46-byte record, a name and extra fields
# far longer than any adapter file's. Checked before zipfile parses the directory, which it holds
# whole in memory (~9x its size), whatever entry count the archive declares.
_ZIP_DIRECTORY_BYTES_PER_MEMBER = 46 + 4096 + 1024


def _zip_directory_extent(data: bytes) -> tuple[int, int]:
    """(entries, bytes) of the central directory as zipfile will read them (its own end-record
    reader, zip64's record included: zipfile parses ``bytes`` of directory whatever the count says);
    AdapterError if there is no end record."""
    try:
        end_record = zipfile._EndRecData(io.BytesIO(data))  # type: ignore[attr-defined]
    except (zipfile.BadZipFile, OSError, struct.error) as exc:
        raise AdapterError(f"corrupt zip archive: {exc}") from exc
    if not end_record:
        raise AdapterError("corrupt zip archive: no end of central directory record")
    return int(end_record[zipfile._ECD_ENTRIES_TOTAL]), int(end_record[zipfile._ECD_SIZE])  # type: ignore[attr-defined]


def _extract_zip(data: bytes, max_members: int, max_total_bytes: int) -> dict[str, bytes]:
    entries, directory_bytes = _zip_directory_extent(data)
    if entries > max_members or directory_bytes > max_members * _ZIP_DIRECTORY_BYTES_PER_MEMBER:
        raise AdapterTooLargeError(
            f"zip archive declares {entries} members in a {directory_bytes}-byte directory: more than the "
            f"limit of {max_members} members"
        )
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
        infos = archive.infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, OSError) as exc:
        raise AdapterError(f"corrupt zip archive: {exc}") from exc
    members: list[_Member] = []
    infos_by_path: dict[str, zipfile.ZipInfo] = {}
    for info in infos:
        # Windows PowerShell 5.1's Compress-Archive (and .NET before 4.6.1) separate folders with "\";
        # the zip format knows only "/", so they are read as separators, then checked as any path.
        path = _safe_path(info.filename.replace("\\", "/"))
        # Unix type bits, when the creator set any (many tools store permissions only).
        file_type = stat.S_IFMT(info.external_attr >> 16)
        if file_type not in (0, stat.S_IFREG, stat.S_IFDIR):
            raise AdapterError(f"archive member {info.filename!r}: links and special files are not allowed")
        if info.flag_bits & 0x1:
            raise AdapterError(f"archive member {info.filename!r}: encrypted members are not supported")
        if not info.is_dir():
            members.append(_Member(path, info.file_size))
            infos_by_path[path] = info
    _check_members(members, len(infos), max_members, max_total_bytes)
    selected = _select_adapter_files(members)
    sizes = {member.path: member.size for member in members}
    files: dict[str, bytes] = {}
    budget = max_total_bytes
    try:
        for file_name, path in selected.items():
            info = infos_by_path[path]
            with archive.open(info) as stream:
                files[file_name] = _read_bounded(stream, path, sizes[path], budget)
            budget -= len(files[file_name])
    except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, OSError) as exc:
        raise AdapterError(f"corrupt zip archive: {exc}") from exc
    return files


def _gunzip_bounded(data: bytes, limit: int, max_total_bytes: int) -> bytes:
    """Decompress (possibly multi-member) gzip data, stopping as soon as output passes ``limit``."""
    output = bytearray()
    remaining = data
    try:
        while remaining:
            decompressor = zlib.decompressobj(wbits=31)
            pending = remaining
            while pending and not decompressor.eof:
                output += decompressor.decompress(pending, _CHUNK_BYTES)
                pending = decompressor.unconsumed_tail
                if len(output) > limit:
                    raise AdapterTooLargeError(f"archive expands past the size limit of {max_total_bytes} bytes")
            if not decompressor.eof:
                raise AdapterError("corrupt gzip stream: truncated")
            remaining = decompressor.unused_data
            if not remaining.strip(b"\0"):  # zero padding after the last member (tape blocks), as gzip reads it
                break
    except zlib.error as exc:
        raise AdapterError(f"corrupt gzip stream: {exc}") from exc
    return bytes(output)


def _extract_tar(data: bytes, max_members: int, max_total_bytes: int) -> dict[str, bytes]:
    members: list[_Member] = []
    infos: dict[str, tarfile.TarInfo] = {}
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as archive:
            num_members = 0
            for info in archive:
                num_members += 1
                if num_members > max_members:
                    raise AdapterTooLargeError(f"archive has more than {max_members} members")
                path = _safe_path(info.name)
                if info.isdir():
                    continue
                if not info.isfile():
                    raise AdapterError(f"archive member {info.name!r}: links and special files are not allowed")
                members.append(_Member(path, info.size))
                infos[path] = info
            _check_members(members, num_members, max_members, max_total_bytes)
            selected = _select_adapter_files(members)
            files: dict[str, bytes] = {}
            for file_name, path in selected.items():
                stream = archive.extractfile(infos[path])
                if stream is None:
                    raise AdapterError(f"archive member {path!r} cannot be read")
                files[file_name] = stream.read()
    except tarfile.TarError as exc:
        raise AdapterError(f"corrupt tar archive: {exc}") from exc
    logger.debug("extracted %s from a tar archive of %d members", sorted(files), len(members))
    return files

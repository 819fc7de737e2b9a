"""Getting adapter files into memory safely: size-limited multipart uploads, archives, and
server-side directories confined to the allowed roots. Nothing here unpickles anything: only
``adapter_config.json`` and ``adapter_model.safetensors`` are ever accepted."""

from __future__ import annotations

import asyncio
import os
import posixpath
import stat
from collections.abc import Sequence
from dataclasses import dataclass

from fastapi import Request
from loraserve.adapters import CONFIG_FILE, WEIGHTS_FILE, AdapterError, AdapterTooLargeError, extract_adapter_archive
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.formparsers import MultiPartException
from starlette.types import Message

from .errors import APIError

ARCHIVE_SUFFIXES = (".zip", ".tar.gz", ".tgz", ".tar")
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")
FORM_OVERHEAD_BYTES = 64 * 1024  # multipart boundaries, headers and the name field
_MAX_FORM_FILES = 4
_MAX_FORM_FIELDS = 8


class _BodyTooLargeError(Exception):
    pass


@dataclass
class AdapterUpload:
    name: str
    files: dict[str, bytes]


def upload_too_large(limit: int) -> APIError:
    return APIError(413, f"the upload exceeds the limit of {limit} bytes")


async def read_adapter_upload(request: Request, limit: int) -> AdapterUpload:
    """Parse ``multipart/form-data`` with ``name`` and the PEFT files (or one archive).

    The body is counted while it arrives and refused (413) as soon as it passes ``limit``
    (plus a little multipart framing), so an oversized upload is never buffered whole.
    """
    content_type = request.headers.get("content-type", "")
    if not content_type.startswith("multipart/form-data"):
        raise APIError(
            400,
            "send multipart/form-data with a `name` field and the files adapter_config.json and "
            "adapter_model.safetensors (or one .zip/.tar.gz of the adapter directory)",
        )
    body_limit = limit + FORM_OVERHEAD_BYTES
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > body_limit:
        raise upload_too_large(limit)
    received = 0

    async def limited_receive() -> Message:
        nonlocal received
        message = await request.receive()
        if message["type"] == "http.request":
            received += len(message.get("body", b""))
            if received > body_limit:
                raise _BodyTooLargeError
        return message

    limited = Request(request.scope, limited_receive)
    try:
        form = await limited.form(max_files=_MAX_FORM_FILES, max_fields=_MAX_FORM_FIELDS)
    except _BodyTooLargeError:
        raise upload_too_large(limit) from None
    except (MultiPartException, HTTPException) as error:
        detail = getattr(error, "message", None) or getattr(error, "detail", str(error))
        raise APIError(400, f"malformed multipart body: {detail}") from None
    try:
        name = form.get("name")
        if not isinstance(name, str) or not name:
            raise APIError(400, "the form field `name` (the adapter's name) is required", param="name")
        uploads = [(key, value) for key, value in form.multi_items() if isinstance(value, UploadFile)]
        raw: dict[str, bytes] = {}
        for _, upload in uploads:
            file_name = posixpath.basename((upload.filename or "").replace("\\", "/"))
            if not file_name:
                raise APIError(400, "every uploaded file needs a file name", param="files")
            if file_name in raw:
                raise APIError(400, f"file {file_name!r} was uploaded twice", param="files")
            raw[file_name] = await upload.read()
        total = sum(len(data) for data in raw.values())
        if total > limit:
            raise upload_too_large(limit)
        return AdapterUpload(name, await _adapter_files(raw, limit))
    finally:
        await form.close()


async def _adapter_files(raw: dict[str, bytes], limit: int) -> dict[str, bytes]:
    """The two PEFT files from the uploaded files (extracting a single archive)."""
    if not raw:
        raise APIError(
            400, f"no files uploaded: send {CONFIG_FILE} and {WEIGHTS_FILE}, or one .zip/.tar.gz", param="files"
        )
    archives = [name for name in raw if name.lower().endswith(ARCHIVE_SUFFIXES)]
    if archives:
        if len(raw) != 1:
            raise APIError(400, "upload either one archive or the adapter files, not both", param="files")
        try:
            return await asyncio.to_thread(extract_adapter_archive, raw[archives[0]], max_total_bytes=limit)
        except AdapterTooLargeError as error:
            raise APIError(413, str(error)) from None
        except AdapterError as error:
            raise APIError(400, f"{archives[0]}: {error}", param="files") from None
    for name in raw:
        if name.lower().endswith(PICKLE_SUFFIXES):
            raise APIError(
                400,
                f"{name}: pickle checkpoints are refused (loading them can run code); upload {WEIGHTS_FILE}",
                param="files",
            )
        if name not in (CONFIG_FILE, WEIGHTS_FILE):
            raise APIError(400, f"unexpected file {name!r}: only {CONFIG_FILE} and {WEIGHTS_FILE}", param="files")
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if name not in raw]
    if missing:
        raise APIError(400, f"missing {missing[0]} (got {sorted(raw)})", param="files")
    return raw


def confine_path(path: str, allowed_dirs: Sequence[str]) -> str:
    """The real path of ``path`` if it lies under one of ``allowed_dirs`` (already real paths).

    Relative paths are taken relative to the first allowed directory. Symlinks are resolved
    before the check, so a link inside an allowed directory cannot lead outside it.
    """
    if not allowed_dirs:
        raise APIError(
            403,
            "loading adapters from server paths is disabled: start the server with --allowed-lora-dir DIR",
            param="lora_path",
        )
    if "\x00" in path:
        raise APIError(400, "lora_path contains a NUL byte", param="lora_path")
    joined = os.path.join(allowed_dirs[0], os.path.expanduser(path))
    real = os.path.realpath(joined)
    if not any(real == root or real.startswith(root.rstrip(os.sep) + os.sep) for root in allowed_dirs):
        raise APIError(
            403,
            f"lora_path {path!r} is outside the allowed directories {list(allowed_dirs)}",
            param="lora_path",
        )
    return real


def read_confined_adapter_dir(path: str, allowed_dirs: Sequence[str], limit: int) -> dict[str, bytes]:
    """Read the two PEFT files of the directory ``path`` (confined; ``limit`` bytes in all)."""
    directory = confine_path(path, allowed_dirs)
    if not os.path.isdir(directory):
        raise APIError(404, f"lora_path {path!r} is not a directory", param="lora_path")
    files: dict[str, bytes] = {}
    for file_name in (CONFIG_FILE, WEIGHTS_FILE):
        file_path = os.path.join(directory, file_name)
        if not os.path.lexists(file_path):
            pickled = [
                f for f in os.listdir(directory) if f.startswith("adapter_model.") and f.endswith(PICKLE_SUFFIXES)
            ]
            hint = f" ({pickled[0]} is a pickle checkpoint, which is refused)" if pickled else ""
            raise APIError(400, f"lora_path {path!r} has no {file_name}{hint}", param="lora_path")
        real = confine_path(file_path, allowed_dirs)  # the file itself may be a symlink
        try:  # non-blocking: opening a FIFO for reading would wait for a writer forever
            fd = os.open(real, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_NOFOLLOW", 0))
        except OSError as error:
            status = 403 if isinstance(error, PermissionError) else 400
            raise APIError(
                status, f"{file_name} in {path!r} cannot be read: {error.strerror}", param="lora_path"
            ) from None
        with os.fdopen(fd, "rb") as handle:
            info = os.fstat(handle.fileno())
            if not stat.S_ISREG(info.st_mode):
                raise APIError(400, f"{file_name} in {path!r} is not a regular file", param="lora_path")
            if info.st_size + sum(len(data) for data in files.values()) > limit:
                raise upload_too_large(limit)
            files[file_name] = handle.read(limit + 1)
    return files

"""Upload archives (zip, tar, tar.gz) of adapters: the two files extracted, nesting and extras
tolerated; traversal, links, special files, corrupt or ambiguous archives and archive bombs refused."""

from __future__ import annotations

import io
import struct
import tarfile
import zipfile
from collections.abc import Callable

import pytest
from loraserve.adapters import (
    CONFIG_FILE,
    WEIGHTS_FILE,
    AdapterError,
    AdapterTooLargeError,
    extract_adapter_archive,
)
from small_adapter import Files, adapter_files_fixture, shapes_and_files_fixture  # noqa: F401 (pytest fixtures)


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
        lambda f: _tar(f) + b"\0" * 1024,  # zero padding after the gzip member, as tape tools write it
        lambda f: _zip({name.replace("/", "\\"): data for name, data in _nest(f, "lora").items()}),  # PowerShell 5
    ],
    ids=[
        "zip-root",
        "zip-nested-with-extras",
        "tgz-nested",
        "tar-root",
        "tgz-extras",
        "tgz-zero-padded",
        "zip-backslashes",
    ],
)
def test_good_archives_extract_the_two_files(build: Callable[[Files], bytes], adapter_files: Files) -> None:
    assert extract_adapter_archive(build(adapter_files)) == adapter_files


BAD_ARCHIVES: dict[str, tuple[Callable[[Files], bytes], str]] = {
    "zip-traversal": (lambda f: _zip({**f, "../evil": b"x"}), "path traversal"),
    "zip-traversal-backslashes": (lambda f: _zip({**f, "..\\..\\evil": b"x"}), "path traversal"),
    "zip-drive-letter": (lambda f: _zip({**f, "C:\\evil": b"x"}), "absolute"),
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
    "tar-bad-sparse-map": (lambda f: _pax(f, {"GNU.sparse.map": "x"}), "corrupt tar"),
    "tar-bad-sparse-version": (lambda f: _pax(f, {"GNU.sparse.major": "1", "GNU.sparse.minor": "0"}), "corrupt tar"),
}


def _pax(files: Files, headers: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, content in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(content)
            info.pax_headers = headers
            archive.addfile(info, io.BytesIO(content))
    return buffer.getvalue()


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


@pytest.mark.parametrize("pack", [_zip, lambda f: _tar(f, mode="w"), _tar], ids=["zip", "tar", "tgz"])
def test_a_damaged_archive_is_an_adapter_error_wherever_it_is_damaged(
    pack: Callable[[Files], bytes], adapter_files: Files
) -> None:
    """Every byte of the headers (the first and last 600 bytes) set to three values in turn: each
    damaged archive is refused as ours (``AdapterError``: a 400) or extracts (the same files, or,
    where the format has no checksum over the data, others, which the adapter's own validation then
    judges), never raises another exception (which the API would answer with a 500)."""
    good = pack(adapter_files)
    positions = [*range(min(600, len(good))), *range(max(600, len(good) - 600), len(good))]
    refused = 0
    for position in positions:
        for value in (0x00, 0xFF, good[position] ^ 0x55):
            damaged = bytearray(good)
            damaged[position] = value
            try:
                extract_adapter_archive(bytes(damaged))
            except AdapterError:  # any other exception fails the test
                refused += 1
    assert refused > 0  # the damage is seen (headers carry magic numbers, sizes, checksums)


def test_a_zip_directory_past_the_member_limit_is_refused_before_zipfile_parses_it(
    adapter_files: Files, monkeypatch: pytest.MonkeyPatch
) -> None:
    """zipfile holds a whole central directory in memory (~9x its bytes) before the member count
    could be checked: a 512 MiB upload of empty entries took GBs. The end record is read first."""
    many = _zip({**adapter_files, **{f"extra{i}.txt": b"" for i in range(300)}})
    parsed: list[object] = []
    monkeypatch.setattr(zipfile, "ZipFile", lambda *a, **k: parsed.append(a) or pytest.fail("parsed"))
    with pytest.raises(AdapterTooLargeError, match="declares 302 members"):
        extract_adapter_archive(many)
    assert parsed == []
    with pytest.raises(AdapterError, match="no end of central directory record"):
        extract_adapter_archive(many[:-22])


def test_a_zip64_archive_is_counted_by_its_zip64_end_record(
    adapter_files: Files, monkeypatch: pytest.MonkeyPatch
) -> None:
    with monkeypatch.context() as patched:
        patched.setattr(zipfile, "ZIP_FILECOUNT_LIMIT", 0)  # zipfile then writes the zip64 end records
        data = bytearray(_zip(adapter_files))
    end = data.rfind(b"PK\x05\x06")
    assert data[end - 20 : end - 16] == b"PK\x06\x07"
    data[end + 8 : end + 12] = b"\xff\xff\xff\xff"  # the classic record defers both counts to zip64's
    assert extract_adapter_archive(bytes(data)) == adapter_files
    with pytest.raises(AdapterTooLargeError, match="declares 2 members"):
        extract_adapter_archive(bytes(data), max_members=1)


def test_a_zip_whose_classic_end_record_understates_its_directory_is_still_refused(adapter_files: Files) -> None:
    """zipfile reads a zip64 end record placed before the classic one whatever the classic one says:
    the limit is checked on what zipfile will parse, not on the classic record's small numbers."""
    data = _zip({**adapter_files, **{f"f{i}": b"" for i in range(300)}})
    end = data.rfind(b"PK\x05\x06")
    classic = bytearray(data[end:])
    entries, size, offset = struct.unpack_from("<HLL", classic, 10)
    zip64 = struct.pack("<4sQHHLLQQQQ", b"PK\x06\x06", 44, 45, 45, 0, 0, entries, entries, size, offset)
    locator = struct.pack("<4sLQL", b"PK\x06\x07", 0, end, 1)
    struct.pack_into("<HHL", classic, 8, 1, 1, 46)  # one member in 46 bytes, it claims
    forged = data[:end] + zip64 + locator + bytes(classic)
    assert len(zipfile.ZipFile(io.BytesIO(forged)).infolist()) == 302
    with pytest.raises(AdapterTooLargeError, match="declares 302 members"):
        extract_adapter_archive(forged)

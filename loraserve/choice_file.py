"""Kernel choices timed on this kind of CPU, kept in one JSON file per CPU signature.

``ChoiceFile(directory)`` reads ``<directory>/<cpu signature>.json`` (an unreadable file counts as
empty). ``put`` merges into the file as it is on disk, under an exclusive lock, and replaces it
atomically: processes that start together keep each other's entries, and a concurrent start reads
the old or the new file. Keys name what a choice depends on; ``build_key`` adds what every timing
depends on: torch's thread count and version, the digest of loraserve's kernel sources and the
caller's format number.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from loraserve.kernels import cpu_build, cpu_features

logger = logging.getLogger(__name__)


def build_key(what: str, cache_format: int) -> str:
    """``what`` (a shape) with what every timing depends on: a new torch or kernel build is timed anew."""
    versions = f"torch={torch.__version__} | kernels={cpu_build.source_digest()} | format={cache_format}"
    return f"{what} | threads={torch.get_num_threads()} | {versions}"


class ChoiceFile:
    """The choices of this CPU kind under ``directory`` (None: nothing is read or written);
    ``kind`` names them in warnings."""

    def __init__(self, directory: Path | None, kind: str) -> None:
        self.kind = kind
        self.path = directory / f"{cpu_features.signature()}.json" if directory is not None else None
        self.entries: dict[str, Any] = self._read()

    def _read(self) -> dict[str, Any]:
        """The file's entries; empty where it is missing or unreadable."""
        if self.path is None or not self.path.exists():
            return {}
        try:
            entries = json.loads(self.path.read_text())
        except (OSError, ValueError) as error:
            logger.warning("ignoring the %s choice cache %s: %s", self.kind, self.path, error)
            return {}
        return entries if isinstance(entries, dict) else {}

    def get(self, key: str) -> Any:
        """The entry under ``key``, or None."""
        return self.entries.get(key)

    def put(self, key: str, entry: Any) -> None:
        """Record ``entry`` under ``key``, here and in the file (the other entries as on disk)."""
        if self.path is None:
            return
        self.entries[key] = entry
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.path.with_suffix(".lock"), "a") as lock:
                # Another process may have written since this one read the file: merge into what
                # is there now, under the lock, instead of overwriting its entries.
                fcntl.flock(lock, fcntl.LOCK_EX)
                self.entries = {**self.entries, **self._read(), key: entry}
                scratch = self.path.with_suffix(f".{os.getpid()}.tmp")
                scratch.write_text(json.dumps(self.entries, indent=1))
                scratch.replace(self.path)  # atomic: a concurrent start reads the old or the new file
        except OSError as error:
            logger.warning("could not write the %s choice cache %s: %s", self.kind, self.path, error)

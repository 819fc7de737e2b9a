"""Kernel choices timed on this kind of CPU, kept in one JSON file per CPU signature.

``ChoiceFile(directory)`` reads ``<directory>/<cpu signature>.json`` (an unreadable file counts as
empty) and writes it atomically, so a concurrent start reads the old or the new file. Keys name
what a choice depends on; ``build_key`` adds what every timing depends on: torch's thread count and
version, the digest of loraserve's kernel sources and the caller's format number.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Any

import torch

from loraserve.kernels import cpu, cpu_features

logger = logging.getLogger(__name__)


def build_key(what: str, cache_format: int) -> str:
    """``what`` (a shape) with what every timing depends on: a new torch or kernel build is timed anew."""
    versions = f"torch={torch.__version__} | kernels={cpu.source_digest()} | format={cache_format}"
    return f"{what} | threads={torch.get_num_threads()} | {versions}"


class ChoiceFile:
    """The choices of this CPU kind under ``directory`` (None: nothing is read or written);
    ``kind`` names them in warnings."""

    def __init__(self, directory: Path | None, kind: str) -> None:
        self.kind = kind
        self.path = directory / f"{cpu_features.signature()}.json" if directory is not None else None
        self.entries: dict[str, Any] = {}
        if self.path is not None and self.path.exists():
            try:
                entries = json.loads(self.path.read_text())
            except (OSError, ValueError) as error:
                logger.warning("ignoring the %s choice cache %s: %s", self.kind, self.path, error)
            else:
                self.entries = entries if isinstance(entries, dict) else {}

    def get(self, key: str) -> Any:
        """The entry under ``key``, or None."""
        return self.entries.get(key)

    def put(self, key: str, entry: Any) -> None:
        if self.path is None:
            return
        self.entries[key] = entry
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            scratch = self.path.with_suffix(f".{os.getpid()}.tmp")
            scratch.write_text(json.dumps(self.entries, indent=1))
            scratch.replace(self.path)  # atomic: a concurrent start reads the old or the new file
        except OSError as error:
            logger.warning("could not write the %s choice cache %s: %s", self.kind, self.path, error)

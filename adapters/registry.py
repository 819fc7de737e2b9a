"""The adapter registry: validates adapters against the base model before they reach the store."""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import AdapterError, InvalidAdapterError, RegistryConflictError
from .lora_weights import BaseModelShapes, LoRAAdapter
from .peft_format import CONFIG_FILE, WEIGHTS_FILE, parse_adapter_files, read_adapter_dir
from .store import AdapterStore, validate_adapter_name

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterInfo:
    """Summary of a stored adapter, suitable for listing endpoints (see :meth:`to_dict`)."""

    name: str
    digest: str
    rank: int
    ranks: dict[str, int]
    target_modules: tuple[str, ...]
    num_bytes: int
    num_parameters: int

    @classmethod
    def from_adapter(cls, adapter: LoRAAdapter) -> AdapterInfo:
        return cls(
            name=adapter.name,
            digest=adapter.digest,
            rank=adapter.max_rank,
            ranks=adapter.ranks,
            target_modules=adapter.target_modules,
            num_bytes=adapter.num_bytes,
            num_parameters=adapter.num_parameters,
        )

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return {
            "name": self.name,
            "digest": self.digest,
            "rank": self.rank,
            "ranks": dict(self.ranks),
            "target_modules": list(self.target_modules),
            "num_bytes": self.num_bytes,
            "num_parameters": self.num_parameters,
        }


@dataclass(frozen=True)
class AdapterLimits:
    """What an operator lets clients register: the largest rank of any module, and how many
    adapters the store may hold."""

    max_rank: int = 512
    max_adapters: int = 10_000

    def __post_init__(self) -> None:
        if self.max_rank < 1 or self.max_adapters < 1:
            raise ValueError(f"adapter limits must be positive, got rank {self.max_rank}, count {self.max_adapters}")


class AdapterRegistry:
    """Adapters for one base model, kept in an :class:`AdapterStore`.

    Everything stored has been parsed and validated against ``shapes``, so ``load`` fails only if
    the store was changed behind the registry's back. ``allowed_roots``, when given, confines
    :meth:`register_from_path` to directories under those roots (after resolving symlinks);
    ``None`` allows any path, so a server exposing that call to clients should pass roots.
    """

    def __init__(
        self,
        store: AdapterStore,
        shapes: BaseModelShapes,
        *,
        allowed_roots: Sequence[str | os.PathLike[str]] | None = None,
        limits: AdapterLimits | None = None,
    ) -> None:
        self.store = store
        self.shapes = shapes
        self.limits = limits or AdapterLimits()
        self.allowed_roots = None if allowed_roots is None else tuple(Path(r).resolve() for r in allowed_roots)

    def register(self, name: str, files: Mapping[str, bytes], *, overwrite: bool = False) -> AdapterInfo:
        """Validate ``files`` (a PEFT adapter) and store them under ``name``.

        Raises :class:`AdapterError` (nothing is stored) if the adapter is invalid or does not fit
        the base model, and :class:`AdapterExistsError` if ``name`` is taken and not ``overwrite``.
        Only the two PEFT files are stored; anything else in ``files`` is dropped.
        """
        validate_adapter_name(name)
        adapter = self._validated(name, files)
        if len(self.store.names()) >= self.limits.max_adapters and not self.store.contains(name):
            raise RegistryConflictError(
                f"this server holds its limit of {self.limits.max_adapters} registered adapters (max_adapters): "
                "delete one first"
            )
        self.store.put(name, {CONFIG_FILE: files[CONFIG_FILE], WEIGHTS_FILE: files[WEIGHTS_FILE]}, overwrite=overwrite)
        logger.info("registered adapter %s (digest %s, rank %d)", name, adapter.digest, adapter.max_rank)
        return AdapterInfo.from_adapter(adapter)

    def register_from_path(self, name: str, path: str | os.PathLike[str], *, overwrite: bool = False) -> AdapterInfo:
        """Register the PEFT adapter directory at ``path`` on this machine (see ``allowed_roots``)."""
        directory = Path(path).resolve()
        # The files themselves may be symlinks leading elsewhere; confine what is actually read.
        for candidate in (directory, (directory / CONFIG_FILE).resolve(), (directory / WEIGHTS_FILE).resolve()):
            self._check_confined(candidate, path)
        return self.register(name, read_adapter_dir(directory), overwrite=overwrite)

    def _check_confined(self, resolved: Path, path: str | os.PathLike[str]) -> None:
        roots = self.allowed_roots
        if roots is not None and not any(resolved.is_relative_to(root) for root in roots):
            raise AdapterError(f"{path}: adapter paths must be under one of {[str(r) for r in roots]}")

    def load(self, name: str) -> LoRAAdapter:
        """Parse the stored adapter ``name`` into float32 weights."""
        return self.parse(name, self.store.get(name))

    def parse(self, name: str, files: Mapping[str, bytes]) -> LoRAAdapter:
        """Parse files read from the store (``store.get(name)``) into float32 weights. The rank limit
        is checked here too, not only at registration: a shared or reused store may hold adapters
        that servers with a higher ``max_lora_rank`` registered."""
        return self._validated(name, files)

    def _validated(self, name: str, files: Mapping[str, bytes]) -> LoRAAdapter:
        """The parsed adapter, or :class:`InvalidAdapterError` naming why this server cannot serve it."""
        try:
            adapter = parse_adapter_files(files, self.shapes, name)
        except InvalidAdapterError:
            raise
        except AdapterError as error:
            raise InvalidAdapterError(str(error)) from error
        if adapter.max_rank > self.limits.max_rank:
            raise InvalidAdapterError(
                f"adapter {name!r} has rank {adapter.max_rank}, above this server's limit of {self.limits.max_rank} "
                "(max_lora_rank)"
            )
        return adapter

    def info(self, name: str) -> AdapterInfo:
        """Summary of ``name``; parses the adapter, so it costs as much as :meth:`load`."""
        return AdapterInfo.from_adapter(self.load(name))

    def delete(self, name: str) -> None:
        self.store.delete(name)

    def names(self) -> list[str]:
        return self.store.names()

    def contains(self, name: str) -> bool:
        return self.store.contains(name)

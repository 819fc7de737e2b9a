"""The unified pool's adapter residency set up for tests (CPU, tiny Llama): a registry over a temporary
directory, a pool, its storage and the adapter manager over them; shared by the residency and scheduling tests."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from adapter_factory import PROJECTIONS, make_peft_model, make_tiny_llama
from loraserve.adapters import AdapterRegistry, BaseModelShapes, LocalDirStore

from loraserve.lora.layout import LORA_GROUPS
from loraserve.lora.residency import AdapterManager
from loraserve.lora.weights import group_weights, write_adapter_load
from loraserve.page_pool import PagePool

BLOCK_SIZE = 4
PAGE_ELEMS = 2 * BLOCK_SIZE * 2 * 16  # one KV block of the tiny model: K and V, 2 kv heads of dim 16
QV = ("q_proj", "v_proj")
# Per rank unit and layer: in + out of each module (hidden 64, q/o 64, k/v 32, intermediate 128).
ELEMS_PER_RANK = dict(zip(PROJECTIONS, (128, 96, 96, 128, 192, 192, 192), strict=True))


@pytest.fixture(scope="module", name="base")
def base_fixture() -> Any:
    return make_tiny_llama()


class CountingRegistry(AdapterRegistry):
    """Counts parses of stored files (host-tier misses)."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.loads: list[str] = []
        self.parse_threads: list[str] = []  # the thread of each parse

    def parse(self, name: str, files: Any) -> Any:
        self.loads.append(name)
        self.parse_threads.append(threading.current_thread().name)
        return super().parse(name, files)


class Env:
    """A registry over a temporary directory, a pool, its storage and the manager over them."""

    def __init__(
        self, root: Path, base: Any, num_pages: int, host_cache_bytes: int = 1 << 30, parse_in_background: bool = False
    ) -> None:
        self.root, self.base = root, base
        shapes = BaseModelShapes.from_hf_config(base.config)
        self.registry = CountingRegistry(LocalDirStore(root / "store"), shapes)
        self.pool = PagePool(num_pages)
        self.storage = torch.zeros(base.config.num_hidden_layers, num_pages, PAGE_ELEMS)
        self.manager = AdapterManager(
            self.registry,
            self.pool,
            base.config.num_hidden_layers,
            PAGE_ELEMS,
            host_cache_bytes,
            parse_in_background=parse_in_background,
        )
        self.peft: dict[str, Any] = {}

    def add(self, name: str, rank: int, targets: tuple[str, ...] = PROJECTIONS, **kwargs: Any) -> str:
        """Register a random PEFT adapter and resolve it (into the host tier); return its digest."""
        self.peft[name] = make_peft_model(
            self.base, rank=rank, target_modules=list(targets), seed=len(self.peft), **kwargs
        )
        self.peft[name].save_pretrained(self.root / name, safe_serialization=True)
        self.manager.resolver.register_from_path(name, str(self.root / name))
        return self.manager.resolve(name)

    def check_weights(self, name: str, adapter_id: str) -> None:
        """Every group's stacked A, B^T and scale read from the pages equal PEFT's tensors (after
        writing the loads the manager handed out, as the runner does)."""
        for load in self.manager.take_loads():
            write_adapter_load(self.storage, load)
        layers = self.peft[name].base_model.model.model.layers
        for layer in range(len(layers)):
            views = group_weights(self.storage, self.manager.pages(adapter_id), layer)
            for group, modules in LORA_GROUPS.items():
                peft_modules = [_module(layers[layer], m) for m in modules]
                adapted = [m for m in peft_modules if m is not None]
                if not adapted:
                    assert group not in views
                    continue
                a, outputs = views[group]
                torch.testing.assert_close(a, torch.cat([m.lora_A["default"].weight for m in adapted]), rtol=0, atol=0)
                column = 0
                for peft_module, out in zip(peft_modules, outputs, strict=True):
                    assert (peft_module is None) == (out is None)
                    if peft_module is None or out is None:
                        continue
                    b = peft_module.lora_B["default"].weight
                    assert (out.column, out.rank) == (column, b.shape[1])
                    assert out.scale == pytest.approx(peft_module.scaling["default"], rel=1e-12)
                    torch.testing.assert_close(out.b_t, b.T, rtol=0, atol=0)
                    column += out.rank


def _module(layer: Any, name: str) -> Any:
    module = getattr(layer.self_attn if name[0] in "qkvo" else layer.mlp, name)
    return module if hasattr(module, "lora_A") else None

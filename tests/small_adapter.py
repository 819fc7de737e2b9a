"""A small valid PEFT adapter of a tiny Llama, shared by the store and archive tests (module-scoped fixtures)."""

from __future__ import annotations

import pytest
from adapter_factory import make_peft_adapter, make_tiny_llama
from loraserve.adapters import BaseModelShapes, read_adapter_dir

Files = dict[str, bytes]


@pytest.fixture(scope="module", name="shapes_and_files")
def shapes_and_files_fixture(tmp_path_factory: pytest.TempPathFactory) -> tuple[BaseModelShapes, Files]:
    model = make_tiny_llama(num_layers=2, hidden=32, intermediate=64, heads=2, kv_heads=1)
    path = make_peft_adapter(model, tmp_path_factory.mktemp("adapter"), rank=2, target_modules=["q_proj", "down_proj"])
    return BaseModelShapes.from_hf_config(model.config), read_adapter_dir(path)


@pytest.fixture(name="adapter_files")
def adapter_files_fixture(shapes_and_files: tuple[BaseModelShapes, Files]) -> Files:
    return dict(shapes_and_files[1])

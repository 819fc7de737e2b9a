"""A PEFT adapter of a tiny Llama saved as files, shared by the format and validation tests: module-scoped
fixtures (base_model, shapes, adapter_dir, files) and helpers that edit the files or name PEFT's keys."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from adapter_factory import make_peft_adapter, make_tiny_llama
from loraserve.adapters import CONFIG_FILE, WEIGHTS_FILE, BaseModelShapes, read_adapter_dir
from safetensors.torch import load as load_safetensors
from safetensors.torch import save
from transformers import LlamaForCausalLM

ALL_PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
Files = dict[str, bytes]


@pytest.fixture(scope="module", name="base_model")
def base_model_fixture() -> LlamaForCausalLM:
    return make_tiny_llama(num_layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2)


@pytest.fixture(scope="module", name="shapes")
def shapes_fixture(base_model: LlamaForCausalLM) -> BaseModelShapes:
    return BaseModelShapes.from_hf_config(base_model.config)


@pytest.fixture(scope="module", name="adapter_dir")
def adapter_dir_fixture(base_model: LlamaForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out_dir = tmp_path_factory.mktemp("adapter")
    return make_peft_adapter(base_model, out_dir, rank=4, target_modules=ALL_PROJECTIONS, alpha=8, seed=1)


@pytest.fixture(name="files")
def files_fixture(adapter_dir: Path) -> Files:
    return read_adapter_dir(adapter_dir)


def edit_files(
    files: Files,
    config: Callable[[dict[str, Any]], None] | None = None,
    tensors: Callable[[dict[str, torch.Tensor]], None] | None = None,
) -> Files:
    """A copy of ``files`` with the config dict and/or the tensor dict edited in place by callbacks."""
    edited = dict(files)
    if config is not None:
        raw = json.loads(files[CONFIG_FILE])
        config(raw)
        edited[CONFIG_FILE] = json.dumps(raw).encode()
    if tensors is not None:
        loaded = load_safetensors(files[WEIGHTS_FILE])
        tensors(loaded)
        edited[WEIGHTS_FILE] = save(loaded)
    return edited


def peft_key(layer: int, module: str, factor: str) -> str:
    parent = "self_attn" if module in ALL_PROJECTIONS[:4] else "mlp"
    return f"base_model.model.model.layers.{layer}.{parent}.{module}.lora_{factor}.weight"

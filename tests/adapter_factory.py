"""Test helpers: a tiny random Llama and real PEFT LoRA adapters with non-zero weights.

Used across the test suite (``from adapter_factory import make_tiny_llama, make_peft_adapter``).
"""

from __future__ import annotations

import copy
import math
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from loraserve.adapters import BaseModelShapes
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import check_target_module_exists
from peft.utils.other import get_pattern_key
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_PARENTS = {
    "q_proj": "self_attn",
    "k_proj": "self_attn",
    "v_proj": "self_attn",
    "o_proj": "self_attn",
    "gate_proj": "mlp",
    "up_proj": "mlp",
    "down_proj": "mlp",
}


def tiny_llama_config(
    num_layers: int = 2,
    hidden: int = 64,
    intermediate: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 128,
    **overrides: Any,
) -> LlamaConfig:
    """A small LlamaConfig (GQA when ``kv_heads < heads``); ``overrides`` are passed through."""
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=num_layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        **overrides,
    )


def make_tiny_llama(
    num_layers: int = 2,
    hidden: int = 64,
    intermediate: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    vocab: int = 128,
    seed: int = 0,
) -> LlamaForCausalLM:
    """A randomly initialised float32 LlamaForCausalLM in eval mode, deterministic for ``seed``."""
    config = tiny_llama_config(num_layers, hidden, intermediate, heads, kv_heads, vocab)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).to(torch.float32).eval()


def _lora_config(
    *,
    rank: int,
    target_modules: Sequence[str] | str,
    alpha: float | None,
    use_rslora: bool,
    rank_pattern: dict[str, int] | None,
    alpha_pattern: dict[str, float] | None,
    **lora_kwargs: Any,
) -> LoraConfig:
    return LoraConfig(
        r=rank,
        lora_alpha=rank if alpha is None else alpha,
        target_modules=target_modules if isinstance(target_modules, str) else list(target_modules),
        use_rslora=use_rslora,
        rank_pattern=dict(rank_pattern or {}),
        alpha_pattern=dict(alpha_pattern or {}),
        lora_dropout=0.0,
        **lora_kwargs,
    )


def _random_factor(shape: Sequence[int], fan_in: int, gain: float, generator: torch.Generator) -> torch.Tensor:
    return torch.randn(*shape, generator=generator) * (gain / math.sqrt(fan_in))


def make_peft_model(
    base_model: LlamaForCausalLM,
    *,
    rank: int,
    target_modules: Sequence[str] | str,
    alpha: float | None = None,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    seed: int = 0,
    **lora_kwargs: Any,
) -> PeftModel:
    """Wrap a deep copy of ``base_model`` with LoRA (adapter name "default") and random A and B.

    ``alpha=None`` means ``lora_alpha = rank``. All lora_A and lora_B weights are set to seeded,
    non-zero random values (PEFT initialises B to zero, which would make the adapter a no-op);
    the adapter's delta is of the order of 0.1x the input. ``base_model`` is not modified.
    """
    config = _lora_config(
        rank=rank,
        target_modules=target_modules,
        alpha=alpha,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        **lora_kwargs,
    )
    peft_model = get_peft_model(copy.deepcopy(base_model), config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if ".lora_A." in name:
                param.copy_(_random_factor(param.shape, param.shape[1], 1.0, generator))
            elif ".lora_B." in name:
                param.copy_(_random_factor(param.shape, param.shape[1], 0.1, generator))
    return peft_model.eval()


def make_peft_adapter(
    base_model: LlamaForCausalLM,
    out_dir: str | os.PathLike[str],
    *,
    rank: int,
    target_modules: Sequence[str] | str,
    alpha: float | None = None,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    seed: int = 0,
    **lora_kwargs: Any,
) -> Path:
    """Save a random non-zero PEFT LoRA adapter for ``base_model`` to ``out_dir`` (safetensors).

    See :func:`make_peft_model` for the arguments; ``base_model`` is not modified.
    """
    peft_model = make_peft_model(
        base_model,
        rank=rank,
        target_modules=target_modules,
        alpha=alpha,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
        seed=seed,
        **lora_kwargs,
    )
    path = Path(out_dir)
    peft_model.save_pretrained(path, safe_serialization=True)
    return path


def make_peft_adapter_for_config(
    config: LlamaConfig,
    out_dir: str | os.PathLike[str],
    *,
    rank: int,
    target_modules: Sequence[str] | str,
    alpha: float | None = None,
    use_rslora: bool = False,
    rank_pattern: dict[str, int] | None = None,
    alpha_pattern: dict[str, float] | None = None,
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
) -> Path:
    """Write a PEFT-format adapter for a Llama ``config`` without instantiating the model.

    For base models too large to build in tests. Targets, ranks and the config file come from
    peft itself (its LoraConfig, ``check_target_module_exists`` and ``get_pattern_key``); tensors
    use PEFT's key names and are random and non-zero as in :func:`make_peft_model`.
    """
    lora_config = _lora_config(
        rank=rank,
        target_modules=target_modules,
        alpha=alpha,
        use_rslora=use_rslora,
        rank_pattern=rank_pattern,
        alpha_pattern=alpha_pattern,
    )
    shapes = BaseModelShapes.from_hf_config(config).module_shapes
    keys = [
        f"model.layers.{layer}.{_PARENTS[module]}.{module}"
        for layer in range(config.num_hidden_layers)
        for module in PROJECTIONS
    ]
    if isinstance(target_modules, str) and target_modules == "all-linear":
        # peft expands the shorthand against the model; mirror the result (every projection).
        lora_config.target_modules = set(keys)
    generator = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for key in keys:
        if not check_target_module_exists(lora_config, key):
            continue
        module_rank = lora_config.rank_pattern.get(get_pattern_key(lora_config.rank_pattern.keys(), key), rank)
        in_features, out_features = shapes[key.rsplit(".", 1)[1]]
        lora_a = _random_factor((module_rank, in_features), in_features, 1.0, generator)
        lora_b = _random_factor((out_features, module_rank), module_rank, 0.1, generator)
        tensors[f"base_model.model.{key}.lora_A.weight"] = lora_a.to(dtype)
        tensors[f"base_model.model.{key}.lora_B.weight"] = lora_b.to(dtype)
    path = Path(out_dir)
    path.mkdir(parents=True, exist_ok=True)
    lora_config.inference_mode = True
    lora_config.save_pretrained(str(path))
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    return path

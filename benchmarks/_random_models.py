"""Random-weight Llama models of real shapes, PEFT adapters and prompts for them (no downloads).

Used by ``benchmarks.gpu`` on machines that can download nothing: the models get the default
model's tokenizer; the adapters are ``tests/adapter_factory.py``'s random non-zero ones.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import torch

from benchmarks._workload import _load_factory

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
SHAPES: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, tie_word_embeddings=True, rope_theta=100000.0),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, tie_word_embeddings=True, rope_theta=500000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, tie_word_embeddings=True),
}  # fmt: skip


def make_model(shape: str, tokenizer_dir: Path, out_dir: Path, dtype: torch.dtype, device: str) -> Path:
    """A random-weight Llama of ``shape`` saved as a Hugging Face directory with the tokenizer."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    if (out_dir / "config.json").is_file():
        return out_dir
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    config = LlamaConfig(vocab_size=len(tokenizer), max_position_embeddings=4096, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, **SHAPES[shape])  # fmt: skip
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config)
        torch.nn.Module.to(model, dtype)  # in place (transformers' typed wrapper of `to` confuses mypy)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir


def make_adapters(model_dir: Path, out_dir: Path, ranks: list[int]) -> list[tuple[str, Path]]:
    from transformers import AutoConfig

    factory, config = _load_factory(), AutoConfig.from_pretrained(model_dir)
    adapters = []
    for i, rank in enumerate(ranks):
        path = out_dir / f"a{i}-r{rank}"
        if not (path / "adapter_model.safetensors").is_file():
            factory.make_peft_adapter_for_config(config, path, rank=rank, target_modules=TARGETS, seed=i)
        adapters.append((f"a{i}", path))
    return adapters


def random_prompts(lens: list[int], vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(32, vocab, (n,), generator=gen).tolist() for n in lens]


def setup_default_model_dir(tokenizer_dir: Path) -> None:
    """For the test fixtures on a machine without the default model: its tokenizer and config only."""
    from loraserve.models.loader import DEFAULT_MODEL_NAME, cache_root

    target = cache_root() / "models" / DEFAULT_MODEL_NAME
    target.mkdir(parents=True, exist_ok=True)
    for name in (*TOKENIZER_FILES, "config.json"):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, target / name)

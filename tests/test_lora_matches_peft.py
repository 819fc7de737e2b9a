"""Mixed-adapter batches on the default model equal PEFT token for token (fp32, CPU)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from adapter_factory import make_peft_model

from loraserve import LLM, SamplingParams

MAX_TOKENS = 16
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS: dict[str, dict[str, Any]] = {
    "r4-attn": dict(rank=4, target_modules=["q_proj", "v_proj"], alpha=8),
    "r8-all": dict(rank=8, target_modules=ALL),
    "r16-rslora": dict(rank=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], use_rslora=True),
    "r32-alpha": dict(rank=32, target_modules=ALL, alpha=16),
    "r64-mlp": dict(rank=64, target_modules=["gate_proj", "up_proj", "down_proj"]),
    "r8-pattern": dict(
        rank=8,
        target_modules=ALL,
        rank_pattern={"down_proj": 24, "model.layers.3.self_attn.q_proj": 12},
        alpha_pattern={"o_proj": 3.0},
    ),
}
PROMPTS = [
    "The capital of France is",
    "Write a haiku about autumn leaves.",
    "def add(a, b):",
    "Once upon a time, in a small village,",
    "The three primary colours are",
    "Question: Why is the sky blue?\nAnswer:",
    "List five fruits:",
]
# (prompt index, adapter or None for the base model)
REQUESTS: list[tuple[int, str | None]] = [(0, None), *[(i + 1, name) for i, name in enumerate(ADAPTERS)]]
REQUESTS += [(0, "r64-mlp"), (2, "r8-all"), (3, None), (4, "r4-attn")]


@pytest.fixture(scope="module")
def adapters_and_reference(hf_model: Any, tokenizer: Any, tmp_path_factory: Any) -> tuple[dict[str, Path], list]:
    root = tmp_path_factory.mktemp("adapters")
    paths: dict[str, Path] = {}
    reference: list[list[int] | None] = [None] * len(REQUESTS)
    models: dict[str | None, Any] = {None: hf_model}
    for seed, (name, spec) in enumerate(ADAPTERS.items()):
        models[name] = make_peft_model(hf_model, seed=seed, **spec)
        paths[name] = root / name
        models[name].save_pretrained(paths[name], safe_serialization=True)
        with torch.inference_mode():
            for index, (prompt_index, adapter) in enumerate(REQUESTS):
                if adapter == name:
                    reference[index] = _hf_generate(models[name], tokenizer, PROMPTS[prompt_index])
        del models[name]
        gc.collect()
    with torch.inference_mode():
        for index, (prompt_index, adapter) in enumerate(REQUESTS):
            if adapter is None:
                reference[index] = _hf_generate(hf_model, tokenizer, PROMPTS[prompt_index])
    return paths, reference


def _hf_generate(model: Any, tokenizer: Any, prompt: str) -> list[int]:
    ids = tokenizer.encode(prompt)
    out = model.generate(input_ids=torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(ids) :].tolist()


def _run(llm: LLM, paths: dict[str, Path], preload: bool = False) -> list[list[int]]:
    """Generate REQUESTS; ``preload``: resolve every adapter first, so that no request waits for a
    background load and the scheduler sees them all at once, in arrival order."""
    for name, path in paths.items():
        llm.add_adapter(name, path)
        if preload:
            llm.engine.adapters.resolve(name)
    outputs = llm.generate(
        [PROMPTS[p] for p, _ in REQUESTS],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        adapters=[a for _, a in REQUESTS],
        use_tqdm=False,
    )
    return [o.token_ids for o in outputs]


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_mixed_adapter_batch_matches_peft(adapters_and_reference: tuple[dict[str, Path], list], kernels: str) -> None:
    """Both LoRA paths: grouped MKL GEMMs over pool pages (C++) and the torch segment loop."""
    paths, reference = adapters_and_reference
    llm = LLM(kernels=kernels)
    assert llm.engine.kernels.name == kernels
    assert _run(llm, paths) == reference
    assert llm.engine.adapters.num_loads == len(ADAPTERS)
    assert llm.engine.adapters.num_evictions == 0


def test_eviction_and_reload_matches_peft(adapters_and_reference: tuple[dict[str, Path], list]) -> None:
    """A pool too small for all adapters at once: idle ones are evicted and loaded again."""
    paths, reference = adapters_and_reference
    llm = LLM(num_pages=100, max_num_seqs=2, watermark=0.0)
    assert _run(llm, paths, preload=True) == reference
    manager = llm.engine.adapters
    assert manager.num_evictions > 0
    assert manager.num_loads > len(ADAPTERS)
    pool = llm.engine.pool
    assert pool.num_free_pages + pool.num_evictable_pages == pool.num_pages

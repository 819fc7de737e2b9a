"""Mixed-adapter batches on the default model equal PEFT token for token (fp32, CPU)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import pytest
import torch
from adapter_factory import make_peft_model

from loraserve import LLM, SamplingParams
from loraserve.models import gemm_choice
from loraserve.models.gemm_cache import ChoiceCache
from loraserve.models.packed_linear import GemmKernel, PackedLinearGroup, kernels_for

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


def test_silu_in_the_gemm_epilogue_matches_peft(
    adapters_and_reference: tuple[dict[str, Path], list], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every row bucket on ``torch`` with SiLU-and-mul in oneDNN's epilogues (the timings stubbed,
    no choice cache): steps whose adapters leave gate and up alone run the epilogues, the others
    take the two outputs for their LoRA, and both equal PEFT."""
    if GemmKernel.ONEDNN not in kernels_for(torch.float32):
        pytest.skip("no oneDNN in this torch build")
    monkeypatch.setattr(gemm_choice, "ChoiceCache", lambda directory: ChoiceCache(None))
    monkeypatch.setattr(
        gemm_choice, "time_kernels", lambda members, rows, kernels: {k: [1.0] * len(rows) for k in kernels}
    )
    monkeypatch.setattr(
        gemm_choice,
        "time_gated",  # every kernel with the pass 1 s, torch with its epilogue 0.5 s
        lambda members, rows, kernels: ({k: [1.0] * len(rows) for k in kernels}, {GemmKernel.TORCH: [0.5] * len(rows)}),
    )
    epilogues: list[int] = []
    run = PackedLinearGroup.run_silu_and_mul

    def counted(group: PackedLinearGroup, kernel: GemmKernel, x: torch.Tensor) -> torch.Tensor:
        epilogues.append(x.shape[0])
        return run(group, kernel, x)

    monkeypatch.setattr(PackedLinearGroup, "run_silu_and_mul", counted)
    paths, reference = adapters_and_reference
    llm = LLM(kernels="cpu")
    assert llm.engine.gemm_plan.silu_epilogue and all(all(on) for on in llm.engine.gemm_plan.silu_epilogue.values())
    assert _run(llm, paths) == reference  # gate/up adapters in most steps
    epilogues.clear()
    # base-model requests and adapters on attention alone: every step in the epilogues
    subset = [
        i
        for i, (_, name) in enumerate(REQUESTS)
        if name is None or "gate_proj" not in ADAPTERS[name].get("target_modules", ALL)
    ]
    outputs = llm.generate(
        [PROMPTS[REQUESTS[i][0]] for i in subset],
        SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS),
        adapters=[REQUESTS[i][1] for i in subset],
        use_tqdm=False,
    )
    assert [o.token_ids for o in outputs] == [reference[i] for i in subset]
    num_layers = llm.engine.hf_config.num_hidden_layers
    assert len(subset) == 5 and epilogues and len(epilogues) % num_layers == 0


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

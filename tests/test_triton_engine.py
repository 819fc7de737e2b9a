"""The engine on the Triton kernels generates what it generates on the torch references.

A mixed batch (base model and three adapters of different ranks and targets) on the tiny
random Llama, greedy. On a CUDA machine it runs compiled on the GPU; elsewhere in Triton's
interpreter (see conftest.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from adapter_factory import make_peft_adapter

from loraserve import LLM, SamplingParams

pytest.importorskip("triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS: dict[str, dict[str, Any]] = {
    "r4-qv": dict(rank=4, target_modules=["q_proj", "v_proj"]),
    "r16-all": dict(rank=16, target_modules=ALL),
    "r40-mlp": dict(rank=40, target_modules=["gate_proj", "up_proj", "down_proj"]),
}
PROMPTS = ["The capital of France is", "def add(a, b):", "Once upon a time", "List five fruits:", "Hi"]
REQUESTS: list[tuple[int, str | None]] = [(0, None), (1, "r4-qv"), (2, "r16-all"), (3, "r40-mlp"), (4, "r16-all")]
REQUESTS += [(0, "r40-mlp"), (2, None), (4, "r4-qv")]


def _generate(model_dir: Path, adapter_dirs: dict[str, Path], kernels: str) -> list[list[int]]:
    llm = LLM(str(model_dir), kernels=kernels, device=DEVICE, block_size=4, num_pages=400)
    assert llm.engine.kernels.name == kernels
    for name, path in adapter_dirs.items():
        llm.add_adapter(name, path)
    outputs = llm.generate(
        [PROMPTS[p] for p, _ in REQUESTS],
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
        adapters=[a for _, a in REQUESTS],
        use_tqdm=False,
    )
    return [o.token_ids for o in outputs]


def test_mixed_adapter_batch_equals_torch_kernels(
    tiny_model_dir: Path, tiny_hf_model: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    root = tmp_path_factory.mktemp("triton-adapters")
    adapter_dirs = {
        name: make_peft_adapter(tiny_hf_model, root / name, seed=seed, **spec)
        for seed, (name, spec) in enumerate(ADAPTERS.items())
    }
    expected = _generate(tiny_model_dir, adapter_dirs, "torch")
    assert len({tuple(tokens) for tokens in expected}) > 4  # adapters and prompts change the outputs
    assert _generate(tiny_model_dir, adapter_dirs, "triton") == expected


def test_triton_on_cpu_without_interpreter_is_refused() -> None:
    from loraserve.kernels.triton_attention import runs_interpreted

    from loraserve.kernel_backend import select_backend

    if runs_interpreted():
        assert select_backend("triton", torch.device("cpu"), torch.float32).name == "triton"
    else:
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
            select_backend("triton", torch.device("cpu"), torch.float32)

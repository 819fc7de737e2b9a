"""Greedy outputs of the engine equal Hugging Face generate token for token (fp32, CPU)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loraserve import LLM, SamplingParams

MAX_TOKENS = 32
HISTORY = (
    "The history of the Roman Empire spans many centuries, from the founding of the city to the fall of "
    "Constantinople. Historians still debate the causes of its decline. "
)
PROMPTS = [
    HISTORY * 34,  # over 1,000 tokens
    "Hi",
    "Write a short story about a robot who learns to paint.",
    "1, 2, 3, 4, 5,",
    HISTORY * 4 + "Summarise the text above in one sentence:",
    "The capital of France is",
    "def fibonacci(n):",
    "Question: What is the boiling point of water at sea level?\nAnswer:",
    "Translate to French: I would like a cup of coffee, please.",
]


@pytest.fixture(scope="module")
def prompt_ids(tokenizer: Any) -> list[list[int]]:
    ids = [tokenizer.encode(p) for p in PROMPTS]
    assert max(len(i) for i in ids) > 1000 and min(len(i) for i in ids) <= 3
    return ids


@pytest.fixture(scope="module")
def reference(hf_model: Any, prompt_ids: list[list[int]]) -> list[list[int]]:
    """Hugging Face greedy generation, one prompt at a time (no padding)."""
    outputs = []
    with torch.inference_mode():
        for ids in prompt_ids:
            out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_TOKENS, do_sample=False)
            outputs.append(out[0, len(ids) :].tolist())
    return outputs


def _generate(llm: LLM, prompt_ids: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(prompt_ids, SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS), use_tqdm=False)
    return [o.token_ids for o in outputs]


def _assert_all_pages_free(llm: LLM) -> None:
    pool = llm.engine.pool
    # Nothing is referenced any more; cached prefix blocks stay as evictable pages.
    assert pool.num_free_pages + pool.num_evictable_pages == pool.num_pages
    assert pool.num_pages_by_kind()["kv"] == 0
    assert not llm.engine.requests


@pytest.mark.parametrize("kernels", ["cpu", "torch"])
def test_batch_matches_hf(prompt_ids: list[list[int]], reference: list[list[int]], kernels: str) -> None:
    """Both kernel backends: the compiled C++ one (the CPU default) and the torch references."""
    llm = LLM(max_num_batched_tokens=512, kernels=kernels)
    assert llm.engine.kernels.name == kernels
    assert _generate(llm, prompt_ids) == reference
    assert llm.engine.scheduler.num_preemptions == 0
    _assert_all_pages_free(llm)


def test_recompute_preemption_matches_hf(prompt_ids: list[list[int]], reference: list[list[int]]) -> None:
    llm = LLM(num_pages=84, watermark=0.0, max_num_batched_tokens=128)
    assert _generate(llm, prompt_ids) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    _assert_all_pages_free(llm)


def test_swap_preemption_matches_hf(prompt_ids: list[list[int]], reference: list[list[int]]) -> None:
    llm = LLM(num_pages=84, watermark=0.0, max_num_batched_tokens=128, preemption_mode="swap", num_swap_pages=128)
    assert _generate(llm, prompt_ids) == reference
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_manager.host_pool is not None
    assert llm.engine.kv_manager.host_pool.num_free_pages == 128
    _assert_all_pages_free(llm)

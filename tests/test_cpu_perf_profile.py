"""benchmarks/cpu_perf_profile.py's profiler scopes over a live engine with adapters (its decode profile)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from adapter_factory import make_peft_adapter
from engine_steps import step_until_decoding
from torch.profiler import ProfilerActivity, profile

from benchmarks.cpu_perf_profile import SCOPE, profiler_scopes
from loraserve import LLM, SamplingParams


@pytest.mark.parametrize("kernels", ["torch", "cpu"])
def test_profiler_scopes_record_lora_and_leave_the_hook_as_it_was(
    kernels: str, tiny_model_dir: Path, tiny_hf_model: Any, tmp_path: Path
) -> None:
    adapter = make_peft_adapter(tiny_hf_model, tmp_path / "a", rank=4, target_modules=["q_proj", "down_proj"], seed=3)
    llm = LLM(str(tiny_model_dir), kernels=kernels, num_pages=128, block_size=4)
    llm.add_adapter("a", adapter)
    engine = llm.engine
    params = SamplingParams(max_tokens=8, ignore_eos=True, temperature=0)
    for i in range(3):
        engine.add_request(str(i), list(range(40, 46 + i)), params, "a" if i else None)
    step_until_decoding(engine)
    assert any(request.adapter_name == "a" for request in engine.requests.values())
    hook = engine.runner.lora_hook
    methods = {name: getattr(hook, name) for name in ("prepare", "apply", "upload_parts")}
    with profiler_scopes(engine), profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(2):
            engine.step()
    names = {event.name for event in prof.events()}
    assert {SCOPE + "lora", SCOPE + "sampling", SCOPE + "prepare", SCOPE + "schedule"} <= names
    assert engine.runner.lora_hook is hook
    assert {name: getattr(hook, name) for name in methods} == methods and "apply" not in vars(hook)
    while engine.has_unfinished_requests():
        engine.step()

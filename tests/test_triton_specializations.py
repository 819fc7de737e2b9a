"""No Triton compilation in steady state: whatever a step holds, each kernel launch with the same
constexprs selects the same compiled variant.

Triton compiles a kernel once per combination of its constexprs and of its arguments'
specialisations: an integer equal to 1 or divisible by 16 (unless ``do_not_specialize`` names
it), a pointer 16-byte aligned or not (unless ``do_not_specialize_on_alignment`` names it), and
each argument's type. A per-step value that moved one of these (a token count, a view of the
step's upload starting at an odd int64) would compile mid-run on a GPU, stalling that step for
a second. Under Triton's interpreter nothing compiles, so this test computes the variant key of
every launch by those rules and asserts one key per kernel and constexpr set, over an engine run
of mixed steps, prefills over cached prefixes, chunked prefills and decode steps with adapters.
"""

from __future__ import annotations

import inspect
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from adapter_factory import make_peft_adapter

from loraserve import LLM, SamplingParams

pytest.importorskip("triton")
interpreter = pytest.importorskip("triton.runtime.interpreter")

Key = tuple[Any, ...]


def _is_constexpr(parameter: inspect.Parameter) -> bool:
    return "constexpr" in str(parameter.annotation)


def variant_key(kernel: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Key, Key]:
    """``(constexprs, specialisations)`` of one launch of an interpreted kernel, by Triton's rules."""
    parameters = list(inspect.signature(kernel.fn).parameters.values())
    bound = dict(zip([p.name for p in parameters], args, strict=False)) | kwargs
    options = kernel.kwargs

    def named(option: str) -> set[str]:
        return {parameters[n].name if isinstance(n, int) else n for n in options.get(option) or ()}

    no_value, no_alignment = named("do_not_specialize"), named("do_not_specialize_on_alignment")
    constexprs: list[Any] = []
    specialised: list[Any] = []
    for parameter in parameters:
        value = bound.get(parameter.name, parameter.default)
        if _is_constexpr(parameter):
            constexprs.append((parameter.name, value))
        elif isinstance(value, torch.Tensor):
            aligned = parameter.name in no_alignment or value.data_ptr() % 16 == 0
            specialised.append((parameter.name, value.dtype, aligned))
        elif isinstance(value, bool) or not isinstance(value, int):
            specialised.append((parameter.name, type(value).__name__))
        else:
            width = "i32" if -(2**31) <= value < 2**31 else "i64"
            kind = "any" if parameter.name in no_value else "1" if value == 1 else "16n" if value % 16 == 0 else "any"
            specialised.append((parameter.name, width, kind))
    return tuple(constexprs), tuple(specialised)


@pytest.fixture
def launches(monkeypatch: pytest.MonkeyPatch) -> Iterator[dict[tuple[str, Key], set[Key]]]:
    """Every interpreted kernel launch while the test runs: (kernel, constexprs) -> variant keys."""
    seen: dict[tuple[str, Key], set[Key]] = defaultdict(set)
    original: Callable[..., Any] = interpreter.InterpretedFunction.run

    def recording_run(self: Any, *args: Any, grid: Any, warmup: bool, **kwargs: Any) -> Any:
        constexprs, specialised = variant_key(self, args, kwargs)
        seen[(self.fn.__name__, constexprs)].add(specialised)
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    monkeypatch.setattr(interpreter.InterpretedFunction, "run", recording_run)
    yield seen


def test_one_variant_per_kernel_whatever_the_steps_hold(
    launches: dict[tuple[str, Key], set[Key]],
    tiny_model_dir: Path,
    tiny_hf_model: Any,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    from loraserve.kernels.triton_attention import runs_interpreted

    if not runs_interpreted():
        pytest.skip("counts variants of interpreted launches (TRITON_INTERPRET=1)")
    root = tmp_path_factory.mktemp("variant-adapters")
    llm = LLM(str(tiny_model_dir), kernels="triton", device="cpu", block_size=4, num_pages=600,
              max_num_batched_tokens=24, enable_prefix_caching=True)  # fmt: skip
    for seed, (name, rank) in enumerate([("r3", 3), ("r16", 16)]):
        llm.add_adapter(name, make_peft_adapter(tiny_hf_model, root / name, seed=seed, rank=rank,
                                                target_modules=["q_proj", "v_proj", "down_proj"]))  # fmt: skip
    shared = "A long shared prefix that several requests reuse, " * 2
    rounds = [
        (["Hi", "The capital of France is", shared + "one", "x" * 37], [None, "r3", "r16", "r3"], 5),
        ([shared + "two", "def f(a):", "ok " * 9], ["r16", None, "r16"], 9),
        (["a", "b c", shared + "three", "Once upon a time there was", "z" * 50], ["r3", "r16", None, None, "r16"], 3),
    ]
    for prompts, adapters, max_tokens in rounds:
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
        llm.generate(prompts, params, adapters=adapters, use_tqdm=False)
    slot_kernels = {"_slot_shrink_kernel", "_slot_expand_kernel"}
    assert {kernel for kernel, _ in launches} >= {"_unified_attention_kernel", *slot_kernels}
    several = {f"{kernel} {dict(constexprs)}": sorted(map(str, keys))
               for (kernel, constexprs), keys in launches.items() if len(keys) > 1}  # fmt: skip
    assert not several, f"kernels compiled more than once for one constexpr set: {several}"


# Integers whose value a step chooses (how many sequences or slots, how wide this step's page
# tables and LoRA intermediate are): a value equal to 1 or divisible by 16 would select a new
# variant mid-run. The engine run above meets such values only by chance, so they are listed.
PER_STEP_INTEGERS = {
    "loraserve.kernels.triton_unified_attention": {
        "_unified_attention_kernel": {"num_seqs", "stride_table_seq"},
        "_merge_splits_kernel": {"num_seqs"},
    },
    "loraserve.kernels.triton_lora": {  # v's row stride: the most rank rows of the step's adapters
        "_shrink_kernel": {"stride_v", "stride_table"},
        "_expand_kernel": {"stride_v", "stride_table"},
    },
    "loraserve.kernels.triton_lora_slots": {  # the intermediate's strides: the step's tokens, the slots' row bound
        "_slot_shrink_kernel": {"num_slots", "stride_table", "stride_part_chunk", "stride_part_token"},
        "_slot_expand_kernel": {"num_slots", "stride_table", "stride_part_chunk", "stride_part_token"},
    },
}


@pytest.mark.parametrize("module", sorted(PER_STEP_INTEGERS))
def test_per_step_integers_are_not_specialised(module: str) -> None:
    import importlib

    for name, integers in PER_STEP_INTEGERS[module].items():
        kernel = getattr(importlib.import_module(module), name)
        options = getattr(kernel, "kwargs", None)  # interpreted: the triton.jit options
        if options is None:  # compiled: JITFunction's own record of them
            params = {p.name: p for p in kernel.params}
            assert all(params[n].do_not_specialize for n in integers), name
        else:
            assert integers <= set(options.get("do_not_specialize") or ()), name

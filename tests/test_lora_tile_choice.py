"""The choice of AMX tiles, vector loops or GEMMs per LoRA segment length, and of the vector expand's
rank block and pair dots (``lora/tile_choice.py``): timed per dtype and cached per CPU kind, forced by
option, refused where it cannot run, and the engine's hook and ``/health`` following it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from fixed_load import QuietLoad
from loraserve.kernels import cpu, cpu_features

from loraserve import timed_choice
from loraserve.config import ConfigError, EngineConfig
from loraserve.lora import lora_timing, tile_choice
from loraserve.lora.tile_choice import LoRAKernelPolicy, LoRAWay, choose_lora_kernels, group_shapes

pytestmark = pytest.mark.skipif(cpu.load_extension() is None, reason="the C++ CPU kernels could not be built")

# The four LoRA groups of a small model: q/k/v, o, gate/up, down.
SHAPES = group_shapes({
    "q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
    "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64),
})  # fmt: skip
PAGE_ELEMS = 1024
EVERY_CLASS = 0b11111111
LONG_CLASSES = 0b11111000  # 33-64 tokens and longer: the GEMM can run them


def test_the_classes_and_the_groups_shapes() -> None:
    plan = choose_lora_kernels(SHAPES, torch.float32, PAGE_ELEMS, LoRAKernelPolicy("vector"))
    assert plan.class_names() == ["3-8", "9-16", "17-32", "33-64", "65-128", "129-256", "257-512", "513+"]
    assert SHAPES == ((64, (64, 32, 32)), (64, (64,)), (64, (128, 128)), (128, (64,)))


def test_forced_ways_need_no_timing_and_amx_is_refused_where_it_cannot_run() -> None:
    for dtype in (torch.float32, torch.bfloat16):
        vector = choose_lora_kernels(SHAPES, dtype, PAGE_ELEMS, LoRAKernelPolicy("vector"))
        assert (vector.source, vector.seconds, vector.expand_rank_block) == ("forced", 0, cpu.EXPAND_RANK_BLOCK)
        assert not vector.expand_pairs and vector.as_dict()["expand"] == "float"
        assert (vector.tile_lengths, vector.loop_lengths) == (0, EVERY_CLASS)
        assert set(vector.as_dict()["segment_tokens"].values()) == {"vector"}
    with pytest.raises(ValueError, match="cpu_lora='amx' needs a bfloat16 pool on a CPU with AMX tiles"):
        choose_lora_kernels(SHAPES, torch.float32, PAGE_ELEMS, LoRAKernelPolicy("amx"))
    if cpu.lora_amx():
        amx = choose_lora_kernels(SHAPES, torch.bfloat16, PAGE_ELEMS, LoRAKernelPolicy("amx"))
        assert (amx.source, amx.tile_lengths, amx.loop_lengths) == ("forced", EVERY_CLASS, 0)
    else:
        with pytest.raises(ValueError, match=r"needs a bfloat16 pool on a CPU with AMX .*this is torch\.bfloat16"):
            choose_lora_kernels(SHAPES, torch.bfloat16, PAGE_ELEMS, LoRAKernelPolicy("amx"))
    with pytest.raises(ValueError, match="cpu_lora must be one of"):
        LoRAKernelPolicy("tiles")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ways_are_timed_per_length_class_then_read_from_the_cache(
    dtype: torch.dtype, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each class is timed on the ways that can run it (the GEMM: above 32 tokens; AMX: bfloat16 on a
    CPU with the tiles), and a way other than the class's default (the loops, the GEMM above 32
    tokens) is kept only where more than a tie faster."""
    monkeypatch.setattr(timed_choice, "OtherLoad", QuietLoad)
    monkeypatch.setattr(tile_choice, "_DISTURBED", {})  # this test's own memory of disturbed timings
    plan = choose_lora_kernels(SHAPES, dtype, PAGE_ELEMS, LoRAKernelPolicy(cache_dir=tmp_path))
    assert plan.source == "measured" and plan.seconds > 0
    tiles = dtype == torch.bfloat16 and cpu.lora_amx()
    pairs = dtype == torch.bfloat16 and cpu.lora_pair_dots()  # the pair-dot expand is timed too
    ways_of_pairs = (False, True) if pairs else (False,)
    expands = [lora_timing.Expand(b, by_pairs) for by_pairs in ways_of_pairs for b in (cpu.EXPAND_RANK_BLOCK, 0)]
    blocks = {expand.key: expand for expand in expands}
    assert "expand rank block whole, pair dots" in blocks if pairs else len(blocks) == 2
    assert sorted(plan.ms) == sorted((["amx", "gemm", "vector"] if tiles else ["gemm", "vector"]) + list(blocks))
    for c in range(8):
        long = (LONG_CLASSES >> c) & 1 == 1
        timed = {way: ms[c] for way, ms in plan.ms.items() if way not in blocks and ms[c] > 0}
        assert set(timed) == ({"amx", "vector"} if tiles else set()) | ({"vector", "gemm"} if long else set())
        default = "gemm" if long else "vector"
        best = min(timed, key=timed.__getitem__, default=default)
        faster = best != default and timed[best] < timed[default] * (1 - tile_choice.TIE_TOLERANCE)
        assert plan.ways[c] is LoRAWay(best if faster else default)
    assert plan.tile_lengths | plan.loop_lengths | LONG_CLASSES == EVERY_CLASS  # the GEMM: long classes only
    # The expand: another than the default only where more than a tie faster over both timed lengths.
    totals = {key: sum(plan.ms[key]) for key in blocks}
    assert all(len(plan.ms[key]) == len(lora_timing.EXPAND_LENGTHS) for key in blocks)
    best = min(totals, key=totals.__getitem__)
    default = f"expand rank block {cpu.EXPAND_RANK_BLOCK}"
    chosen = blocks[best] if totals[best] < totals[default] * 0.97 else blocks[default]
    assert (plan.expand_rank_block, plan.expand_pairs) == chosen
    assert plan.as_dict()["expand_rank_block"] == (chosen.rank_block or "whole rank")
    assert plan.as_dict()["expand"] == ("pair dots" if chosen.pairs else "float")
    entries = json.loads((tmp_path / f"{cpu_features.signature()}.json").read_text())
    (entry,) = entries.values()
    assert entry["tiles"] == [[way.value for way in plan.ways], [plan.expand_rank_block, plan.expand_pairs]]
    assert entry["cpu"] == cpu_features.summary()
    again = choose_lora_kernels(SHAPES, dtype, PAGE_ELEMS, LoRAKernelPolicy(cache_dir=tmp_path))
    assert (again.source, again.ways, again.seconds) == ("cached", plan.ways, 0.0)
    assert (again.expand_rank_block, again.expand_pairs) == (plan.expand_rank_block, plan.expand_pairs)
    wider = ((64, (64, 32, 16)), *SHAPES[1:])  # another model: timed anew, beside the first entry
    other = choose_lora_kernels(wider, dtype, PAGE_ELEMS, LoRAKernelPolicy(cache_dir=tmp_path))
    assert other.source == "measured" and other.seconds > 0
    assert len(json.loads((tmp_path / f"{cpu_features.signature()}.json").read_text())) == 2


def test_the_option_is_validated_and_applies_only_to_the_cpu_backend() -> None:
    with pytest.raises(ConfigError, match="cpu_lora must be one of"):
        EngineConfig(cpu_lora="tiles")
    with pytest.raises(ConfigError, match="cpu_lora='vector' applies to the compiled CPU backend only"):
        EngineConfig(cpu_lora="vector", kernels="torch")


def test_the_engine_hook_runs_the_plan_and_health_shows_it(tiny_model_dir: Path) -> None:
    from loraserve import LLM
    from loraserve.lora.apply_cpu import CompiledLoRAApplier

    llm = LLM(str(tiny_model_dir), num_pages=64, kernels="cpu", dtype="bfloat16", cpu_lora="vector")
    hook = llm.engine.runner.lora_hook
    assert isinstance(hook, CompiledLoRAApplier) and (hook.tile_lengths, hook.loop_lengths) == (0, EVERY_CLASS)
    shown = llm.engine.stats().cpu_lora
    assert shown["source"] == "forced" and set(shown["segment_tokens"].values()) == {"vector"}  # type: ignore[union-attr]
    auto = LLM(str(tiny_model_dir), num_pages=64, kernels="cpu", dtype="bfloat16")
    plan = auto.engine.lora_plan
    hook = auto.engine.runner.lora_hook
    assert plan is not None and (hook.tile_lengths, hook.loop_lengths) == (plan.tile_lengths, plan.loop_lengths)  # type: ignore[attr-defined]
    assert hook.expand_rank_block == plan.expand_rank_block  # type: ignore[attr-defined]
    assert hook.expand_pairs == plan.expand_pairs  # type: ignore[attr-defined]
    assert plan.source in ("measured", "cached", "disturbed")
    assert LLM(str(tiny_model_dir), num_pages=64, kernels="torch", dtype="bfloat16").engine.stats().cpu_lora == {}


def test_another_expand_is_kept_only_where_more_than_a_tie_faster() -> None:
    Expand = lora_timing.Expand
    default, whole = Expand(cpu.EXPAND_RANK_BLOCK), Expand(0)
    pairs, whole_pairs = Expand(cpu.EXPAND_RANK_BLOCK, True), Expand(0, True)
    candidates = (default, whole, pairs, whole_pairs)

    def pick(*totals: list[float]) -> lora_timing.Expand:
        times = {expand.key: ms for expand, ms in zip(candidates, totals, strict=True)}
        return tile_choice.pick_expand(times, candidates)

    assert pick([1.0, 4.0], [0.9, 3.8], [1.0, 4.0], [1.0, 4.0]) == whole  # 6 % faster in all
    assert pick([1.0, 4.0], [0.5, 4.4], [1.0, 4.1], [1.1, 4.2]) == default  # 2 %: a tie
    assert pick([1.0, 4.0], [0.9, 3.8], [0.8, 3.5], [0.8, 3.6]) == pairs  # the fastest of those past a tie
    assert pick([1.0, 4.0], [1.1, 4.2], [1.0, 3.9], [1.0, 4.0]) == default
    assert lora_timing.expand_candidates(torch.float32) == (default, whole)
    has_pairs = cpu.lora_pair_dots()
    assert lora_timing.expand_candidates(torch.bfloat16) == (candidates if has_pairs else (default, whole))

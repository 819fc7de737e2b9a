"""The choice of AMX tiles or vector loops for the bfloat16 prefill attention
(``models/attention_choice.py``): timed on CPUs with AMX and cached per CPU kind, forced by option,
refused where it cannot run, and the engine's model and ``/health`` following it."""

from __future__ import annotations

import functools
import itertools
import json
from pathlib import Path

import pytest
import torch
from fixed_load import QuietLoad
from loraserve.kernels import cpu, cpu_features

from loraserve import timed_choice
from loraserve.config import ConfigError, EngineConfig
from loraserve.models import attention_choice
from loraserve.models.attention_choice import (
    AttentionShape,
    PrefillAttentionPolicy,
    choose_prefill_attention,
    prefill_attention_kernels,
)
from loraserve.models.model_kernels import ModelKernels

BUILT = cpu.load_extension() is not None
pytestmark = pytest.mark.skipif(not BUILT, reason="the C++ CPU kernels could not be built")
needs_tiles = pytest.mark.skipif(
    not BUILT or not cpu.prefill_attention_amx(),
    reason="the prefill attention's AMX tiles are not in this CPU's build or the OS refused them",
)
SHAPE = AttentionShape(num_heads=6, num_kv_heads=2, head_dim=32, block_size=16)
ROWS = 256


def test_the_shape_of_a_model() -> None:
    from transformers import LlamaConfig

    grouped = LlamaConfig(hidden_size=96, num_attention_heads=6, num_key_value_heads=2)
    assert AttentionShape.of_model(grouped, 8) == AttentionShape(6, 2, 16, 8)
    assert AttentionShape.of_model(LlamaConfig(hidden_size=96, num_attention_heads=6, head_dim=32), 16) == (
        AttentionShape(6, 6, 32, 16)
    )


def test_other_dtypes_and_forced_ways_need_no_timing_and_amx_is_refused_where_it_cannot_run() -> None:
    for dtype in (torch.float32, torch.float16):
        plan = choose_prefill_attention(SHAPE, dtype, ROWS, PrefillAttentionPolicy())
        assert (plan.tiles, plan.source, plan.seconds) == (False, "no tiles", 0.0)
        with pytest.raises(ValueError, match="cpu_prefill_attention='amx' needs bfloat16 on a CPU with AMX tiles"):
            choose_prefill_attention(SHAPE, dtype, ROWS, PrefillAttentionPolicy("amx"))
    vector = choose_prefill_attention(SHAPE, torch.bfloat16, ROWS, PrefillAttentionPolicy("vector"))
    assert (vector.tiles, vector.source, vector.seconds) == (False, "forced", 0.0)
    assert vector.as_dict()["kernel"] == "vector" and "ms" not in vector.as_dict()
    if cpu.prefill_attention_amx():
        amx = choose_prefill_attention(SHAPE, torch.bfloat16, ROWS, PrefillAttentionPolicy("amx"))
        assert (amx.tiles, amx.source) == (True, "forced")
    else:
        with pytest.raises(ValueError, match=r"needs bfloat16 on a CPU with AMX .*this is torch\.bfloat16"):
            choose_prefill_attention(SHAPE, torch.bfloat16, ROWS, PrefillAttentionPolicy("amx"))
        plain = choose_prefill_attention(SHAPE, torch.bfloat16, ROWS, PrefillAttentionPolicy())
        assert (plain.tiles, plain.source) == (False, "no tiles")
    with pytest.raises(ValueError, match="cpu_prefill_attention must be one of"):
        PrefillAttentionPolicy("tiles")


@needs_tiles
def test_the_tiles_are_timed_then_read_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timed_choice, "OtherLoad", QuietLoad)
    monkeypatch.setattr(attention_choice, "_DISTURBED", {})  # this test's own memory of disturbed timings
    plan = choose_prefill_attention(SHAPE, torch.bfloat16, ROWS, PrefillAttentionPolicy(cache_dir=tmp_path))
    assert plan.source == "measured" and plan.seconds > 0
    assert all(len(plan.ms[way]) == 2 and min(plan.ms[way]) > 0 for way in ("amx", "vector"))
    # the tiles only where more than a tie faster over both timed steps
    assert plan.tiles == (sum(plan.ms["amx"]) < sum(plan.ms["vector"]) * (1 - attention_choice.TIE_TOLERANCE))
    assert set(plan.as_dict()["ms"]["amx"]) == {"prompts", "chunk over cache"}
    entries = json.loads((tmp_path / f"{cpu_features.signature()}.json").read_text())
    (entry,) = entries.values()
    assert entry["tiles"] == plan.tiles and entry["cpu"] == cpu_features.summary()
    again = choose_prefill_attention(SHAPE, torch.bfloat16, ROWS, PrefillAttentionPolicy(cache_dir=tmp_path))
    assert (again.tiles, again.source, again.seconds, again.ms) == (plan.tiles, "cached", 0.0, plan.ms)
    other = AttentionShape(6, 2, 64, 16)  # another model: timed anew, beside the first entry
    assert choose_prefill_attention(other, torch.bfloat16, ROWS, PrefillAttentionPolicy(cache_dir=tmp_path)).seconds
    assert len(json.loads((tmp_path / f"{cpu_features.signature()}.json").read_text())) == 2


def test_the_timed_steps_are_the_model_s_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """A full step of 64-128 token prompts from scratch, and one chunk over a cached prefix."""
    calls = []
    real = cpu.paged_prefill_attention

    def recording(*args: object, tiles: bool) -> torch.Tensor:
        calls.append((args, tiles))
        return real(*args, tiles=tiles)  # type: ignore[arg-type]

    monkeypatch.setattr(attention_choice.cpu, "paged_prefill_attention", recording)
    attention_choice.time_both_ways(SHAPE, 300)
    assert {tiles for _, tiles in calls} == {True, False}
    shapes = {(tuple(a[0].shape), tuple(a[2].tolist()), tuple(a[3].tolist())) for a, _ in calls}  # type: ignore[union-attr]
    prompts, chunk = sorted(shapes, key=lambda s: len(s[1]), reverse=True)
    starts = prompts[1]
    lengths = [b - a for a, b in itertools.pairwise(starts)]
    assert prompts[0] == (300, 6, 32) and starts[-1] == 300 and set(prompts[2]) == {0}
    assert all(64 <= n <= 128 for n in lengths[:-1]) and len(set(lengths)) > 2
    assert chunk == ((300, 6, 32), (0, 300), (attention_choice.CACHED_TOKENS,))
    kv = calls[-1][0][1]
    assert kv.dtype == torch.bfloat16 and tuple(kv.shape[1:]) == (2, 16, 2, 32)  # type: ignore[union-attr]


def test_the_option_is_validated_and_applies_only_to_the_cpu_backend() -> None:
    with pytest.raises(ConfigError, match="cpu_prefill_attention must be one of"):
        EngineConfig(cpu_prefill_attention="tiles")
    with pytest.raises(ConfigError, match="cpu_prefill_attention='vector' applies to the compiled CPU backend only"):
        EngineConfig(cpu_prefill_attention="vector", kernels="torch")
    with pytest.raises(ConfigError, match="cpu_prefill_attention='amx' needs the compiled CPU kernels"):
        prefill_attention_kernels("triton", ModelKernels(), SHAPE, torch.bfloat16, ROWS, PrefillAttentionPolicy("amx"))
    kernels = ModelKernels()
    assert prefill_attention_kernels("torch", kernels, SHAPE, torch.bfloat16, ROWS, PrefillAttentionPolicy()) == (
        kernels,
        None,
    )


def test_the_engine_model_runs_the_plan_and_health_shows_it(tiny_model_dir: Path) -> None:
    from loraserve import LLM

    def tiles_of(llm: LLM) -> bool:
        attention = llm.engine.model.model.layers[0].self_attn.prefill_attention  # type: ignore[union-attr]
        assert isinstance(attention, functools.partial) and attention.func is cpu.paged_prefill_attention
        return bool(attention.keywords["tiles"])

    llm = LLM(str(tiny_model_dir), num_pages=64, kernels="cpu", dtype="bfloat16", cpu_prefill_attention="vector")
    assert tiles_of(llm) is False
    assert llm.engine.stats().cpu_prefill_attention == llm.engine.attention_plan.as_dict()  # type: ignore[union-attr]
    assert llm.engine.stats().cpu_prefill_attention["source"] == "forced"
    auto = LLM(str(tiny_model_dir), num_pages=64, kernels="cpu", dtype="bfloat16")
    plan = auto.engine.attention_plan
    assert plan is not None and tiles_of(auto) is plan.tiles
    assert plan.source in (("measured", "cached", "disturbed") if cpu.prefill_attention_amx() else ("no tiles",))
    assert (
        LLM(str(tiny_model_dir), num_pages=64, kernels="torch", dtype="bfloat16").engine.stats().cpu_prefill_attention
        == {}
    )

"""The choice of the compiled decode attention's variant (``models/decode_attention_choice.py``):
timed where the build has two and cached per CPU kind, forced by option, refused where the build
lacks it, and the engine's model and ``/health`` following it."""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from fixed_load import QuietLoad
from loraserve.kernels import cpu, cpu_features

from loraserve import timed_choice
from loraserve.config import ConfigError, EngineConfig
from loraserve.models import decode_attention_choice
from loraserve.models.attention_choice import AttentionShape
from loraserve.models.decode_attention_choice import DecodeAttentionPolicy, choose_decode_attention

BUILT = cpu.load_extension() is not None
pytestmark = pytest.mark.skipif(not BUILT, reason="the C++ CPU kernels could not be built")
TWO_VARIANTS = BUILT and len(cpu.decode_attention_variants()) >= 2
needs_two = pytest.mark.skipif(
    not TWO_VARIANTS, reason="this build has one decode attention variant (its target lacks AVX-512)"
)
SHAPE = AttentionShape(num_heads=6, num_kv_heads=2, head_dim=32, block_size=16)


def test_forced_variants_need_no_timing_and_a_missing_one_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    tilings = cpu.decode_attention_tilings(torch.float32, SHAPE.head_dim, SHAPE.block_size)
    for variant in cpu.decode_attention_variants():
        plan = choose_decode_attention(SHAPE, torch.float32, 8, DecodeAttentionPolicy(variant))
        assert (plan.variant, plan.source, plan.seconds, plan.ms) == (variant, "forced", 0.0, {})
        # float32 is not the pairs variant's: the next one that tiles it runs
        assert plan.as_dict()["kernel"] == (variant if variant in tilings else tilings[0])
        assert "ms" not in plan.as_dict()
    with pytest.raises(ValueError, match="cpu_decode_attention must be one of"):
        DecodeAttentionPolicy("avx2")
    monkeypatch.setattr(decode_attention_choice.cpu, "decode_attention_variants", lambda: ["vec8"])
    with pytest.raises(ConfigError, match=r"cpu_decode_attention='avx512' is not compiled for this CPU .*\['vec8'\]"):
        choose_decode_attention(SHAPE, torch.float32, 8, DecodeAttentionPolicy("avx512"))
    only = choose_decode_attention(SHAPE, torch.float32, 8, DecodeAttentionPolicy())
    assert (only.variant, only.source, only.seconds) == ("vec8", "only one", 0.0)


@pytest.mark.parametrize(("wide_ms", "chosen"), [(0.9, "avx512"), (0.98, "vec8"), (1.2, "vec8")])
def test_the_wider_variant_only_when_more_than_a_tie_faster(
    wide_ms: float, chosen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(decode_attention_choice.cpu, "decode_attention_variants", lambda: ["avx512", "vec8"])
    monkeypatch.setattr(decode_attention_choice.cpu, "decode_attention_tilings", lambda *args: ["avx512", "vec8"])
    monkeypatch.setattr(timed_choice, "OtherLoad", QuietLoad)
    timings = {"avx512": [wide_ms / 1e3], "vec8": [1.0 / 1e3]}
    monkeypatch.setattr(decode_attention_choice, "time_variants", lambda *args: timings)
    plan = choose_decode_attention(SHAPE, torch.float32, 8, DecodeAttentionPolicy())
    assert (plan.variant, plan.source) == (chosen, "measured")
    assert plan.ms == {"avx512": [wide_ms], "vec8": [1.0]}


@pytest.mark.parametrize(
    ("pairs_ms", "wide_ms", "chosen"),
    [(0.8, 0.9, "pairs"), (0.9, 0.8, "avx512"), (0.98, 0.99, "vec8"), (0.8, 1.2, "pairs"), (1.3, 0.9, "avx512")],
)
def test_of_three_variants_the_fastest_where_it_beats_the_narrowest_by_more_than_a_tie(
    pairs_ms: float, wide_ms: float, chosen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    three = ["pairs", "avx512", "vec8"]
    monkeypatch.setattr(decode_attention_choice.cpu, "decode_attention_variants", lambda: three)
    monkeypatch.setattr(decode_attention_choice.cpu, "decode_attention_tilings", lambda *args: three)
    monkeypatch.setattr(timed_choice, "OtherLoad", QuietLoad)
    timed: list[tuple[str, ...]] = []

    def timings(
        shape: AttentionShape, dtype: torch.dtype, seqs: int, variants: tuple[str, ...]
    ) -> dict[str, list[float]]:
        timed.append(variants)
        return {"pairs": [pairs_ms / 1e3], "avx512": [wide_ms / 1e3], "vec8": [1.0 / 1e3]}

    monkeypatch.setattr(decode_attention_choice, "time_variants", timings)
    plan = choose_decode_attention(SHAPE, torch.bfloat16, 8, DecodeAttentionPolicy())
    assert (plan.variant, plan.kernel, plan.source) == (chosen, chosen, "measured")
    assert timed == [("pairs", "avx512", "vec8")]


def test_nothing_is_timed_where_at_most_one_variant_tiles_the_dtype_and_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """float16 runs the generic loops under either variant name; a shape only the 8-lane tiling
    takes (bfloat16 heads of 48) runs it under either name; neither is timed."""

    def untimed(*args: object) -> dict[str, list[float]]:
        raise AssertionError("timed a choice that has one outcome")

    monkeypatch.setattr(decode_attention_choice, "time_variants", untimed)
    half = choose_decode_attention(SHAPE, torch.float16, 8, DecodeAttentionPolicy())
    assert cpu.decode_attention_tilings(torch.float16, SHAPE.head_dim, SHAPE.block_size) == []
    assert (half.source, half.kernel, half.seconds) == ("only one", "generic", 0.0)
    assert half.as_dict()["kernel"] == "generic"
    heads_of_48 = AttentionShape(num_heads=6, num_kv_heads=2, head_dim=48, block_size=16)
    assert cpu.decode_attention_tilings(torch.bfloat16, 48, 16) == ["vec8"]
    narrow = choose_decode_attention(heads_of_48, torch.bfloat16, 8, DecodeAttentionPolicy())
    assert (narrow.variant, narrow.kernel, narrow.source) == ("vec8", "vec8", "only one")
    for variant in cpu.decode_attention_variants():  # forced: what runs is shown, not only the name
        forced = choose_decode_attention(heads_of_48, torch.bfloat16, 8, DecodeAttentionPolicy(variant))
        assert (forced.variant, forced.kernel, forced.source) == (variant, "vec8", "forced")
        assert forced.as_dict()["kernel"] == "vec8" and forced.as_dict()["variant"] == variant


@needs_two
def test_the_variant_is_timed_then_read_from_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timed_choice, "OtherLoad", QuietLoad)
    monkeypatch.setattr(decode_attention_choice, "_DISTURBED", {})  # this test's own memory of disturbed timings
    monkeypatch.setattr(decode_attention_choice, "TIMED_BYTES", 4 << 20)
    policy = DecodeAttentionPolicy(cache_dir=tmp_path)
    plan = choose_decode_attention(SHAPE, torch.bfloat16, 8, policy)
    assert plan.source == "measured" and plan.seconds > 0
    tilings = cpu.decode_attention_tilings(torch.bfloat16, SHAPE.head_dim, SHAPE.block_size)
    assert set(plan.ms) == set(tilings) and all(ms[0] > 0 for ms in plan.ms.values())
    fastest = min(tilings, key=lambda variant: plan.ms[variant][0])
    tie = 1 - decode_attention_choice.TIE_TOLERANCE
    assert plan.variant == (fastest if plan.ms[fastest][0] < plan.ms["vec8"][0] * tie else "vec8")
    (entry,) = json.loads((tmp_path / f"{cpu_features.signature()}.json").read_text()).values()
    assert entry["tiles"] == plan.variant and entry["cpu"] == cpu_features.summary()
    again = choose_decode_attention(SHAPE, torch.bfloat16, 8, policy)
    assert (again.variant, again.source, again.seconds, again.ms) == (plan.variant, "cached", 0.0, plan.ms)
    assert choose_decode_attention(SHAPE, torch.float32, 8, policy).source == "measured"  # another dtype: its own
    # an entry that names no variant of this build is timed anew
    path = tmp_path / f"{cpu_features.signature()}.json"
    entries = json.loads(path.read_text())
    path.write_text(json.dumps({key: {**value, "tiles": "avx1024"} for key, value in entries.items()}))
    assert choose_decode_attention(SHAPE, torch.bfloat16, 8, policy).source == "measured"


def test_the_timed_step_is_the_model_s_shape(monkeypatch: pytest.MonkeyPatch) -> None:
    """A batch of sequences of 96-160 cached tokens on scattered pages, every variant alike."""
    calls: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, str]] = []
    real = cpu.paged_decode_attention

    def recording(q: torch.Tensor, kv: torch.Tensor, tables: torch.Tensor, lens: torch.Tensor, scale: float, *,
                  variant: str) -> torch.Tensor:  # fmt: skip
        calls.append((q, kv, tables, lens, variant))
        return real(q, kv, tables, lens, scale, variant=variant)

    monkeypatch.setattr(decode_attention_choice.cpu, "paged_decode_attention", recording)
    monkeypatch.setattr(decode_attention_choice, "TIMED_BYTES", 1 << 20)
    times = decode_attention_choice.time_variants(SHAPE, torch.bfloat16, 12, ("avx512", "vec8"))
    assert set(times) == {"avx512", "vec8"} and {c[4] for c in calls} == {"avx512", "vec8"}
    q, kv, tables, lens, _ = calls[0]
    assert tuple(q.shape) == (12, 6, 32) and q.dtype == kv.dtype == torch.bfloat16
    assert tuple(kv.shape[1:]) == (2, 16, 2, 32) and min(lens.tolist()) == 96 and max(lens.tolist()) < 160
    used = [p for row, n in zip(tables.tolist(), lens.tolist(), strict=True) for p in row[: -(-n // 16)]]
    assert sorted(used) == list(range(kv.shape[0])) and used != sorted(used)  # every page once, scattered


def test_the_option_is_validated_and_applies_only_to_the_cpu_backend() -> None:
    with pytest.raises(ConfigError, match="cpu_decode_attention must be one of"):
        EngineConfig(cpu_decode_attention="avx2")
    with pytest.raises(ConfigError, match="cpu_decode_attention='vec8' applies to the compiled CPU backend only"):
        EngineConfig(cpu_decode_attention="vec8", kernels="torch")


def test_the_engine_model_runs_the_plan_and_health_shows_it(tiny_model_dir: Path) -> None:
    from loraserve import LLM

    def variant_of(llm: LLM) -> str:
        attention = llm.engine.model.model.layers[0].self_attn.decode_attention  # type: ignore[union-attr]
        assert isinstance(attention, functools.partial) and attention.func is cpu.paged_decode_attention
        return str(attention.keywords["variant"])

    llm = LLM(str(tiny_model_dir), num_pages=64, kernels="cpu", cpu_decode_attention="vec8")
    assert variant_of(llm) == "vec8"
    assert llm.engine.stats().cpu_decode_attention == llm.engine.decode_attention_plan.as_dict()  # type: ignore[union-attr]
    assert llm.engine.stats().cpu_decode_attention["source"] == "forced"
    auto = LLM(str(tiny_model_dir), num_pages=64, kernels="cpu", dtype="bfloat16")
    plan = auto.engine.decode_attention_plan
    assert plan is not None and variant_of(auto) == plan.variant
    head_dim = auto.engine.model.model.layers[0].self_attn.head_dim  # type: ignore[union-attr]
    tilings = cpu.decode_attention_tilings(torch.bfloat16, int(head_dim), auto.engine.config.block_size)
    assert plan.source in (("measured", "cached", "disturbed") if len(tilings) >= 2 else ("only one",))
    assert plan.kernel == (plan.variant if tilings else "generic")
    assert LLM(str(tiny_model_dir), num_pages=64, kernels="torch").engine.stats().cpu_decode_attention == {}

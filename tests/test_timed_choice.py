"""The timed tile choices (``timed_choice.py``) of the LoRA kernel and the prefill attention: a
timing that other processes disturbed is repeated once, then serves this process without being
cached, and the process remembers it instead of timing it again."""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch
from fixed_load import BusyLoad
from loraserve.kernels import cpu, cpu_features

from loraserve import timed_choice
from loraserve.choice_file import ChoiceFile
from loraserve.lora import tile_choice
from loraserve.lora.tile_choice import LoRAKernelPolicy, choose_lora_kernels, group_shapes
from loraserve.models import attention_choice
from loraserve.models.attention_choice import (
    AttentionShape,
    PrefillAttentionPlan,
    PrefillAttentionPolicy,
    choose_prefill_attention,
)

BUILT = cpu.load_extension() is not None
pytestmark = pytest.mark.skipif(not BUILT, reason="the C++ CPU kernels could not be built")
NO_TILES = "the kernel's AMX tiles are not in this CPU's build (no amx_bf16/avx512_bf16) or the OS refused them"

LORA_SHAPES = group_shapes({
    "q_proj": (64, 64), "k_proj": (64, 32), "v_proj": (64, 32), "o_proj": (64, 64),
    "gate_proj": (64, 128), "up_proj": (64, 128), "down_proj": (128, 64),
})  # fmt: skip


def _lora(cache_dir: Path) -> Any:
    return choose_lora_kernels(LORA_SHAPES, torch.bfloat16, 1024, LoRAKernelPolicy(cache_dir=cache_dir))


def _attention(cache_dir: Path) -> Any:
    shape = AttentionShape(6, 2, 32, 16)
    return choose_prefill_attention(shape, torch.bfloat16, 256, PrefillAttentionPolicy(cache_dir=cache_dir))


CHOICES = [
    pytest.param(tile_choice, _lora, "LoRA kernel", "time_ways", id="lora"),
    pytest.param(
        attention_choice,
        _attention,
        "prefill attention",
        "time_both_ways",
        marks=pytest.mark.skipif(BUILT and not cpu.prefill_attention_amx(), reason=NO_TILES),
        id="prefill-attention",
    ),
]


@pytest.mark.parametrize(("module", "choose", "kind", "timer"), CHOICES)
def test_a_disturbed_timing_serves_the_process_but_is_not_cached(
    module: ModuleType,
    choose: Callable[[Path], Any],
    kind: str,
    timer: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setattr(timed_choice, "OtherLoad", BusyLoad)
    monkeypatch.setattr(module, "_DISTURBED", {})  # this test's own memory of disturbed timings
    timings = []
    real = getattr(module, timer)

    def counting(*args: object) -> dict[str, list[float]]:
        timings.append(args)
        return real(*args)  # type: ignore[no-any-return]

    monkeypatch.setattr(module, timer, counting)
    with caplog.at_level(logging.WARNING):
        plan = choose(tmp_path)
    assert plan.source == "disturbed" and len(timings) == 2  # timed again once
    assert f"the {kind} timing was disturbed (other processes kept 1.0 CPUs busy)" in caplog.text
    assert not (tmp_path / f"{cpu_features.signature()}.json").exists()
    again = choose(tmp_path)
    choice = "ways" if module is tile_choice else "tiles"
    assert (again.source, getattr(again, choice)) == ("disturbed", getattr(plan, choice)) and len(timings) == 2


def test_the_policies_name_their_option() -> None:
    with pytest.raises(ValueError, match="cpu_lora must be one of"):
        LoRAKernelPolicy("tiles")
    with pytest.raises(ValueError, match="cpu_prefill_attention must be one of"):
        PrefillAttentionPolicy("tiles")
    assert PrefillAttentionPolicy("amx").kernel == "amx" and LoRAKernelPolicy().cache_dir is None


def test_a_hand_edited_cache_entry_keeps_its_choice_and_only_its_timings_that_are_timings(tmp_path: Path) -> None:
    file = tmp_path / f"{cpu_features.signature()}.json"

    def never_timed() -> dict[str, list[float]]:
        raise AssertionError("a cached choice is not timed again")

    for ms, read_back in (
        (["not", "per way"], {}),
        ({"amx": [1, "2"], "vector": [3.5], "7": 4}, {"vector": [3.5]}),
        ({"amx": [1.0, 2.0, 3.0], "vector": [0.5, 2]}, {"amx": [1.0, 2.0, 3.0], "vector": [0.5, 2.0]}),
    ):
        file.write_text(json.dumps({"key": {"tiles": True, "ms": ms}}))
        choice = timed_choice.timed_choice(
            ChoiceFile(tmp_path, "test"), "key", {}, never_timed, lambda times: False,
            lambda tiles: tiles if isinstance(tiles, bool) else None,
        )  # fmt: skip
        assert (choice.value, choice.source, choice.ms) == (True, "cached", read_back)
    # /health labels the timings by case only where there is one per case
    shown = PrefillAttentionPlan(True, "cached", ms=choice.ms).as_dict()["ms"]
    assert shown == {"amx": [1.0, 2.0, 3.0], "vector": {"prompts": 0.5, "chunk over cache": 2.0}}

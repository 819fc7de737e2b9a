"""The GEMM kernel of each linear layer shape, chosen by timing on this CPU and cached per CPU kind."""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import Any, ClassVar

import pytest
import torch
from fixed_load import BusyLoad, QuietLoad
from loraserve.kernels import cpu, cpu_features, cpu_linear
from torch import nn

from loraserve.config import ConfigError, EngineConfig
from loraserve.models import gemm_choice
from loraserve.models.gemm_choice import GemmPolicy, pack_linears, pick_kernels
from loraserve.models.packed_linear import ROW_BUCKETS, GemmKernel, PackedLinear, PackedLinearGroup, kernels_for

pytestmark = pytest.mark.skipif(cpu.load_extension() is None, reason="the C++ CPU kernels could not be built")

P, D, T, B = GemmKernel.PANELS, GemmKernel.ONEDNN, GemmKernel.TORCH, GemmKernel.DOT  # D: oneDNN, B: bfloat16 dots


def test_pick_takes_the_fastest_with_one_packed_copy_and_prefers_torch_in_a_tie() -> None:
    # per bucket the fastest; panels and oneDNN never both (each would be a copy of the weights)
    assert pick_kernels({P: [1.0, 1.0, 9.0], D: [2.0, 2.0, 3.0], T: [5.0, 5.0, 5.0]}) == (P, P, T)
    assert pick_kernels({P: [1.0, 9.0, 9.0], D: [2.0, 2.0, 3.0], T: [5.0, 5.0, 5.0]}) == (D, D, D)
    assert pick_kernels({P: [1.0, 9.0, 9.0], D: [9.0, 9.0, 9.0], T: [5.0, 2.0, 2.0]}) == (P, T, T)
    # within the tolerance torch wins: no copy at all
    assert pick_kernels({P: [1.0, 1.0], D: [2.0, 2.0], T: [1.02, 1.01]}) == (T, T)
    assert pick_kernels({P: [1.0], T: [1.5]}) == (P,)
    assert pick_kernels({T: [1.0, 2.0]}) == (T, T)


def test_one_bucket_clearly_faster_on_a_packed_copy_keeps_the_copy_for_that_bucket() -> None:
    # 12 % faster at the largest row count alone (a prefill step): packed there, torch elsewhere
    assert pick_kernels({D: [2.0] * 6 + [0.88], T: [1.0] * 7}) == (T,) * 6 + (D,)
    assert pick_kernels({D: [2.0] * 6 + [0.98], T: [1.0] * 7}) == (T,) * 7  # 2 %: a tie, no copy


def test_pick_uses_the_dot_kernel_where_it_is_fastest_beside_one_packed_copy() -> None:
    # dot needs no copy, like torch: it takes the few-row buckets beside oneDNN's packed copy
    assert pick_kernels({D: [2.0, 2.0, 1.0, 1.0], T: [2.5, 2.5, 3.0, 3.0], B: [1.0, 1.5, 4.0, 9.0]}) == (B, B, D, D)
    # torch wins a tie with dot (torch's own op), an unpacked kernel a tie with a packed one
    assert pick_kernels({D: [1.0, 1.0], T: [1.02, 2.0], B: [1.0, 1.0]}) == (T, B)
    # the unpacked kernels alone within the tolerance of the best schedule: no copy at all
    assert pick_kernels({D: [1.0, 1.0], T: [1.5, 1.01], B: [1.0, 3.0]}) == (B, T)
    assert pick_kernels({T: [2.0, 1.0], B: [1.0, 2.0]}) == (B, T)


class _Block(nn.Module):
    fused_groups: ClassVar[dict[str, tuple[str, ...]]] = {"qk_packed": ("q", "k")}

    def __init__(self) -> None:
        super().__init__()
        self.q, self.k, self.o = nn.Linear(32, 48, bias=False), nn.Linear(32, 16, bias=False), nn.Linear(48, 32)
        self.qk_packed: PackedLinearGroup | None = None


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleDict({"layers": nn.ModuleList(_Block() for _ in range(3)), "lm_head": nn.Linear(32, 100)})


@pytest.fixture
def quiet_machine(monkeypatch: pytest.MonkeyPatch) -> None:
    """Timings count as undisturbed whatever else runs beside the tests."""
    monkeypatch.setattr(gemm_choice, "OtherLoad", QuietLoad)


@pytest.mark.usefixtures("quiet_machine")
def test_auto_times_every_shape_and_bucket_then_reads_the_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = GemmPolicy("auto", max_rows=100, row_limits=(("lm_head", 4),), cache_dir=tmp_path)
    model = _model()
    reference = copy.deepcopy(model)
    plan = pack_linears(model, policy)
    assert plan.source == "measured" and plan.seconds > 0 and plan.num_layers == 3 * 3 + 1
    assert set(plan.choices) == {"float32 32->48+16", "float32 48->32 +bias", "float32 32->100 +bias"}
    assert len(plan.choices["float32 32->48+16"]) == 5  # rows up to 100: buckets 1, 4, 16, 64, 256
    assert len(plan.choices["float32 32->100 +bias"]) == 2  # the LM head: one row per sequence, at most 4

    # the file records what was timed, and the choice is what those timings pick
    entries = json.loads((tmp_path / f"{cpu_features.signature()}.json").read_text())
    assert len(entries) == 3
    for key, entry in entries.items():
        shape = key.split(" | ")[0]
        times = {GemmKernel(k): [t / 1e3 for t in ms] for k, ms in entry["ms"].items()}
        assert set(times) == {P, D, T} and entry["cpu"] == cpu_features.summary()
        assert pick_kernels(times) == plan.choices[shape]
        assert list(entry["kernels"]) == [str(r) for r in ROW_BUCKETS[: len(plan.choices[shape])]]
        assert list(entry["kernels"].values()) == [k.value for k in plan.choices[shape]]

    # each layer runs its shape's kernels and computes what the plain layers compute
    layer = model["layers"][1]
    assert isinstance(layer.qk_packed, PackedLinearGroup) and isinstance(layer.o, PackedLinear)
    assert layer.qk_packed.kernels == plan.choices["float32 32->48+16"]
    for rows in (1, 3, 20, 100):
        x = torch.randn(rows, 32)
        q, k = layer.qk_packed(x)
        torch.testing.assert_close(q, reference["layers"][1].q(x), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k, reference["layers"][1].k(x), rtol=1e-5, atol=1e-5)

    # a second start on this CPU reads the choice: nothing is timed
    def no_timing(*args: Any) -> None:
        raise AssertionError("timed although the choice was cached")

    monkeypatch.setattr(gemm_choice, "time_kernels", no_timing)
    again = pack_linears(copy.deepcopy(reference), policy)
    assert again.source == "cached" and again.seconds == 0 and again.choices == plan.choices
    # a larger step budget needs buckets the cache lacks: those shapes are timed again
    monkeypatch.undo()
    wider = pack_linears(copy.deepcopy(reference), GemmPolicy("auto", 2000, (("lm_head", 4),), tmp_path))
    assert wider.source == "mixed" and len(wider.choices["float32 32->48+16"]) == 7  # ... 1,024, 2,048
    assert wider.choices["float32 32->100 +bias"] == plan.choices["float32 32->100 +bias"]


def test_a_timing_disturbed_by_other_processes_is_used_but_not_cached(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(gemm_choice, "OtherLoad", BusyLoad)
    monkeypatch.setattr(gemm_choice, "_DISTURBED_CHOICES", {})  # this test's own process memory
    timed = gemm_choice.time_kernels
    calls: list[int] = []

    def counting(*args: Any) -> Any:
        calls.append(1)
        return timed(*args)

    monkeypatch.setattr(gemm_choice, "time_kernels", counting)
    policy = GemmPolicy("auto", max_rows=8, cache_dir=tmp_path)
    with caplog.at_level(logging.WARNING):
        plan = pack_linears(_model(), policy)
    assert plan.source == "measured" and len(calls) == 2 * 3  # each of the 3 shapes timed twice
    assert sorted(plan.disturbed) == sorted(plan.choices) and plan.as_dict()["disturbed"] == plan.disturbed
    assert "GEMM timing of float32 32->48+16 was disturbed (other processes kept 1.0 CPUs busy" in caplog.text
    assert not (tmp_path / f"{cpu_features.signature()}.json").exists()  # nothing written
    # a later engine of this process reuses the choice instead of timing again
    calls.clear()
    again = pack_linears(_model(), policy)
    assert calls == [] and again.choices == plan.choices and sorted(again.disturbed) == sorted(plan.disturbed)
    # the next clean timing (another process, or the machine quiet again) is written
    monkeypatch.setattr(gemm_choice, "OtherLoad", QuietLoad)
    gemm_choice._DISTURBED_CHOICES.clear()
    clean = pack_linears(_model(), policy)
    assert clean.source == "measured" and clean.disturbed == [] and len(calls) == 3
    assert len(json.loads((tmp_path / f"{cpu_features.signature()}.json").read_text())) == 3


@pytest.mark.skipif(not Path("/proc/stat").exists(), reason="reads /proc/stat (Linux)")
def test_other_load_counts_other_processes_and_not_this_one() -> None:
    import subprocess
    import sys
    import time

    from loraserve.models.cpu_load import OtherLoad

    with OtherLoad() as own:  # this process busy: not counted
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            pass
    assert own.cores is not None and own.cores < 0.6, own.cores
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.3)  # the interpreter started and spins
        with OtherLoad() as busy:
            time.sleep(1.0)
    finally:
        spinner.kill()
        spinner.wait()
    assert busy.cores is not None and busy.cores >= 0.6 and busy.disturbed, busy.cores


@pytest.mark.usefixtures("quiet_machine")
def test_a_corrupt_cache_is_timed_again(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    (tmp_path / f"{cpu_features.signature()}.json").write_text("{not json")
    with caplog.at_level(logging.WARNING):
        plan = pack_linears(_model(), GemmPolicy("auto", 8, cache_dir=tmp_path))
    assert plan.source == "measured" and "ignoring the GEMM choice cache" in caplog.text
    assert json.loads((tmp_path / f"{cpu_features.signature()}.json").read_text())  # rewritten whole


def test_a_forced_kernel_runs_everywhere_and_is_checked() -> None:
    model = _model()
    plan = pack_linears(model, GemmPolicy("onednn"))
    assert plan.source == "forced" and set(plan.choices.values()) == {(D,)}
    assert model["layers"][0].qk_packed.onednn_weights and model["layers"][0].qk_packed.panels is None
    if not cpu_linear.linear_pair_panels_available():  # bfloat16 panels need avx512_bf16
        with pytest.raises(ValueError, match=r"cannot run torch\.bfloat16"):
            pack_linears(_model().bfloat16(), GemmPolicy("panels"))
    else:
        bf16 = _model().bfloat16()
        pack_linears(bf16, GemmPolicy("panels"))
        group = bf16["layers"][0].qk_packed
        assert isinstance(group, PackedLinearGroup) and group.panels is not None and not group.onednn_weights
        assert group.panels.dtype == torch.bfloat16
    with pytest.raises(ValueError, match=r"cpu_gemm='dot' cannot run torch\.float32"):  # dot is bfloat16 only
        pack_linears(_model(), GemmPolicy("dot"))
    with pytest.raises(ValueError, match=r"cpu_gemm='amx' cannot run torch\.float32"):  # so is amx
        pack_linears(_model(), GemmPolicy("amx"))
    with pytest.raises(ValueError, match="cpu_gemm must be one of"):
        GemmPolicy("mkl")


def test_the_option_is_validated_and_applies_only_to_the_cpu_backend() -> None:
    with pytest.raises(ConfigError, match="cpu_gemm must be one of"):
        EngineConfig(cpu_gemm="fast")
    with pytest.raises(ConfigError, match="applies to the compiled CPU backend only"):
        EngineConfig(cpu_gemm="panels", kernels="torch")
    assert EngineConfig(cpu_gemm="panels").cpu_gemm == "panels"


def test_every_forced_kernel_generates_the_same_greedy_tokens(tiny_model_dir: Path) -> None:
    from loraserve import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    prompts = ["The capital of France is", "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20"]
    outputs = {}
    for kernel in ("panels", "onednn", "torch"):
        llm = LLM(str(tiny_model_dir), num_pages=64, kernels="cpu", cpu_gemm=kernel)
        assert set(llm.engine.gemm_plan.choices.values()) == {(GemmKernel(kernel),)}
        outputs[kernel] = [o.token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert outputs["panels"] == outputs["onednn"] == outputs["torch"]


def test_bfloat16_weights_run_on_onednn_and_follow_the_float32_model(tiny_model_dir: Path) -> None:
    """oneDNN (AMX or AVX-512-BF16 where the CPU has them) runs bfloat16 weights when forced."""
    from loraserve import LLM, SamplingParams

    if not cpu_features.cpu_info().onednn_bfloat16:
        pytest.skip("oneDNN's bfloat16 linear needs AVX-512 BW/VL/DQ or AVX-NE-CONVERT, which this CPU lacks")

    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    prompt = ["1 2 3 4 5 6 7 8 9 10 11 12"]
    llm = LLM(str(tiny_model_dir), num_pages=64, kernels="cpu", dtype="bfloat16", cpu_gemm="onednn")
    assert set(llm.engine.gemm_plan.choices) == {"bfloat16 64->64+32+32", "bfloat16 64->128+128", "bfloat16 64->64",
                                                 "bfloat16 128->64", "bfloat16 64->49152"}  # fmt: skip
    group = llm.engine.model.model.layers[0].self_attn.qkv_packed
    assert group is not None and group.kernels == (D,) and group.onednn_weights[0].dtype == torch.bfloat16
    bf16 = llm.generate(prompt, params, use_tqdm=False)[0].token_ids
    fp32 = LLM(str(tiny_model_dir), num_pages=64, kernels="cpu").generate(prompt, params, use_tqdm=False)
    assert len(bf16) == 6 and bf16[:2] == fp32[0].token_ids[:2]  # bfloat16 rounding may part them later


def test_bfloat16_where_onednn_cannot_run_it_uses_torch(tiny_model_dir: Path) -> None:
    """On a CPU without oneDNN's bfloat16 path (AVX2 only) bfloat16 weights run on ``F.linear``, not
    on a oneDNN reorder that raises; forcing oneDNN is refused by name."""
    from loraserve import LLM, SamplingParams

    if cpu_features.cpu_info().onednn_bfloat16:
        pytest.skip("this CPU runs oneDNN's bfloat16 path (the test above covers it)")
    assert D not in kernels_for(torch.bfloat16)
    llm = LLM(str(tiny_model_dir), num_pages=64, kernels="cpu", dtype="bfloat16")
    assert all(set(kernels) == {T} for kernels in llm.engine.gemm_plan.choices.values())
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    assert len(llm.generate(["1 2 3 4"], params, use_tqdm=False)[0].token_ids) == 4
    with pytest.raises(ValueError, match="cpu_gemm='onednn' cannot run"):
        LLM(str(tiny_model_dir), num_pages=64, kernels="cpu", dtype="bfloat16", cpu_gemm="onednn")

"""A gated MLP's SiLU-and-mul in the GEMM's epilogue (oneDNN's post-ops, the bfloat16 panels'
tiles): its arithmetic against a float64 reference (the panels': bit for bit the pass's), the
buckets that run it, its timing with the kernel choice and cache, and the MLP taking the two
outputs whenever the step's adapters add LoRA to gate or up."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any, ClassVar

import pytest
import torch
import torch.nn.functional as F
from fixed_load import QuietLoad
from loraserve.kernels import cpu, cpu_features
from torch import nn

from loraserve.lora.batch import AdapterPages, LoRABatch
from loraserve.lora.layout import AdapterLayout, GroupSlot, ModuleSlot
from loraserve.models import gemm_choice
from loraserve.models.gemm_choice import GemmPolicy, pack_linears
from loraserve.models.llama import LlamaMLP
from loraserve.models.model_kernels import ModelKernels
from loraserve.models.packed_linear import GemmKernel, PackedLinearGroup, kernels_for, silu_epilogue_kernels
from loraserve.models.silu_epilogue import pick_gated, time_gated

pytestmark = pytest.mark.skipif(
    cpu.load_extension() is None or GemmKernel.ONEDNN not in kernels_for(torch.float32),
    reason="needs the C++ CPU kernels and oneDNN",
)
D, T, P = GemmKernel.ONEDNN, GemmKernel.TORCH, GemmKernel.PANELS
DTYPES = [torch.float32] + ([torch.bfloat16] if GemmKernel.ONEDNN in kernels_for(torch.bfloat16) else [])


def _pair(dtype: torch.dtype, bias: bool, seed: int = 0) -> list[nn.Linear]:
    torch.manual_seed(seed)
    return [nn.Linear(40, 72, bias=bias).to(dtype) for _ in range(2)]


FUSING = [(dtype, kernel) for dtype in (torch.float32, torch.bfloat16) for kernel in silu_epilogue_kernels(dtype)]


@pytest.mark.parametrize(("dtype", "kernel"), FUSING, ids=[f"{str(d)[6:]}-{k.value}" for d, k in FUSING])
@pytest.mark.parametrize("bias", [False, True])
def test_the_epilogue_gives_silu_of_the_first_output_times_the_second(
    dtype: torch.dtype, kernel: GemmKernel, bias: bool
) -> None:
    gate, up = _pair(dtype, bias)
    group = PackedLinearGroup([gate, up], (kernel,), (True,))
    for rows in (1, 7, 300):
        x = torch.randn(rows, 40).to(dtype)
        exact = F.silu(F.linear(x.double(), gate.weight.double(), _double(gate.bias)))
        exact = exact * F.linear(x.double(), up.weight.double(), _double(up.bias))  # [rows, 72]
        after = group.run(kernel, x)
        passed = F.silu(after[0].float()) * after[1].float()  # the two outputs, combined after
        epilogue = group.silu_and_mul(x)
        assert epilogue.shape == (rows, 72) and epilogue.dtype == dtype
        allowed = 2 * (passed.double() - exact).abs().max().item() + (1e-5 if dtype == torch.float32 else 2e-2)
        assert (epilogue.double() - exact).abs().max().item() <= allowed
        if kernel is P:  # the tiles' epilogue rounds as the two outputs and the pass over them do
            cpu.silu_and_mul_(after[0], after[1])
            assert torch.equal(epilogue.view(torch.int16), after[0].view(torch.int16))


@pytest.mark.skipif(GemmKernel.PANELS not in silu_epilogue_kernels(torch.bfloat16), reason="needs avx512_bf16")
@pytest.mark.parametrize("rows", [1, 6, 13, 144, 301])
@pytest.mark.parametrize("width", [16, 40, 64, 100, 1536])
def test_the_panels_epilogue_matches_the_pass_bit_for_bit(rows: int, width: int) -> None:
    """Every tiling of the gated tiles (one or two gate panels, 1-12 rows, a partial last panel,
    several row blocks) gives the bits of the plain call and silu_and_mul_."""
    torch.manual_seed(width + rows)
    gate, up = (nn.Linear(65, width, bias=True).to(torch.bfloat16) for _ in range(2))
    group = PackedLinearGroup([gate, up], (P,), (True,))
    x = (3 * torch.randn(rows, 65)).to(torch.bfloat16)
    after = group.run(P, x)
    cpu.silu_and_mul_(after[0], after[1])
    assert torch.equal(group.silu_and_mul(x).view(torch.int16), after[0].view(torch.int16))


def _double(bias: torch.Tensor | None) -> torch.Tensor | None:
    return bias.double() if bias is not None else None


def test_a_group_runs_the_epilogue_only_in_the_row_buckets_that_chose_it() -> None:
    gate, up = _pair(torch.float32, bias=False)
    group = PackedLinearGroup([gate, up], (T, D, P), (False, True, False))  # buckets 1, 4, 16 and beyond
    assert [group.runs_silu_epilogue(torch.randn(rows, 40)) for rows in (1, 4, 5, 16, 500)] == [0, 1, 1, 0, 0]
    assert not group.runs_silu_epilogue(torch.randn(2, 4, 40))  # not a 2-D input: F.linear per member
    with pytest.raises(ValueError, match="bucket of 16 rows does not run"):
        group.silu_and_mul(torch.randn(16, 40))
    assert PackedLinearGroup([gate, up], (T, P)).silu_epilogue == (False, False)  # none by default
    with pytest.raises(ValueError, match=r"only in buckets of \['onednn', 'torch'\]"):
        PackedLinearGroup([gate, up], (T, P), (False, True))
    with pytest.raises(ValueError, match="one entry per row bucket"):
        PackedLinearGroup([gate, up], (T, D), (True,))
    with pytest.raises(ValueError, match="two outputs of one width"):
        PackedLinearGroup([gate, up, nn.Linear(40, 72)], (T,), (True,))
    with pytest.raises(ValueError, match="two outputs of one width"):
        PackedLinearGroup([gate, nn.Linear(40, 8)], (T,), (True,))


def test_a_kernel_counts_with_its_epilogue_where_that_was_timed_clearly_faster() -> None:
    with_pass = {T: [1.0, 1.0, 1.0], P: [2.0, 2.0, 2.0]}  # seconds with the pass, per bucket
    with_epilogue = {T: [0.5, 0.99, 1.5]}  # panels in float32: no epilogue
    times, epilogue = pick_gated(with_pass, with_epilogue)
    assert times == {T: [0.5, 1.0, 1.0], P: [2.0, 2.0, 2.0]}
    assert epilogue == {T: (True, False, False), P: (False, False, False)}
    pair = _pair(torch.float32, bias=True)
    passed, fused = time_gated([pair, _pair(torch.float32, True, seed=1)], (1, 4), (P, T, D))
    assert sorted(passed) == sorted([P, T, D]) and sorted(fused) == sorted([T, D])  # float32 panels: no epilogue
    assert all(len(ts) == 2 and min(ts) > 0 for ts in [*passed.values(), *fused.values()])


def test_a_gated_group_that_cannot_be_combined_is_timed_on_its_gemms_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A module naming two outputs of different widths as gated: no SiLU-and-mul to time, so its
    kernels are timed as any other group's and no bucket runs an epilogue."""
    monkeypatch.setattr(gemm_choice, "OtherLoad", QuietLoad)
    monkeypatch.setattr(gemm_choice, "_DISTURBED_CHOICES", {})
    monkeypatch.setattr(gemm_choice, "time_gated", _no_timing)
    model = _gated_model()
    for layer in model:
        layer.up = nn.Linear(32, 24, bias=False)
    plan = pack_linears(model, GemmPolicy("auto", max_rows=4, cache_dir=tmp_path))
    assert plan.silu_epilogue == {"float32 32->48+24 gated": (False, False)}


class _Gated(nn.Module):
    fused_groups: ClassVar[dict[str, tuple[str, ...]]] = {"gate_up": ("gate", "up")}
    gated_groups: ClassVar[tuple[str, ...]] = ("gate_up",)

    def __init__(self) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(32, 48, bias=False), nn.Linear(32, 48, bias=False)
        self.gate_up: PackedLinearGroup | None = None


def _gated_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.ModuleList(_Gated() for _ in range(2))


def test_pack_linears_times_a_gated_groups_epilogue_with_its_kernels_and_caches_both(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gemm_choice, "OtherLoad", QuietLoad)
    monkeypatch.setattr(gemm_choice, "_DISTURBED_CHOICES", {})
    # with the pass: torch fastest in the first two buckets, panels in the third; torch's epilogue
    # clearly faster in the first bucket only; onednn's in the third, but still slower than panels
    with_pass = {P: [9.0, 9.0, 0.5], D: [9.0] * 3, T: [1.0] * 3}
    with_epilogue = {D: [9.0, 9.0, 0.6], T: [0.5, 0.99, 1.0]}
    timed: list[tuple[GemmKernel, ...]] = []

    def time_gated(members: Any, rows: tuple[int, ...], kernels: tuple[GemmKernel, ...]) -> tuple[dict, dict]:
        timed.append(tuple(kernels))
        return with_pass, with_epilogue

    monkeypatch.setattr(gemm_choice, "time_kernels", _no_timing)  # a gated shape is timed on the whole MLP
    monkeypatch.setattr(gemm_choice, "time_gated", time_gated)
    policy = GemmPolicy("auto", max_rows=16, cache_dir=tmp_path)
    model = _gated_model()
    plan = pack_linears(model, policy)
    assert timed == [tuple(kernels_for(torch.float32))]
    assert plan.choices == {"float32 32->48+48 gated": (T, T, P)}
    assert plan.silu_epilogue == {"float32 32->48+48 gated": (True, False, False)}
    assert plan.as_dict()["silu_epilogue_rows"] == {"float32 32->48+48 gated": [1]}
    assert all(layer.gate_up.silu_epilogue == (True, False, False) for layer in model)
    entry = json.loads((tmp_path / f"{cpu_features.signature()}.json").read_text())
    (key,) = entry
    assert entry[key]["silu_epilogue"] == {"1": True, "4": False, "16": False}
    assert entry[key]["silu_epilogue_ms"] == {"1": [1000.0, 500.0], "4": [1000.0, 990.0]}  # torch's
    assert entry[key]["ms"]["torch"] == [500.0, 1000.0, 1000.0]  # with the epilogue where it was chosen

    # a later start reads both: nothing is timed
    monkeypatch.setattr(gemm_choice, "time_gated", _no_timing)
    again = pack_linears(_gated_model(), policy)
    assert again.source == "cached" and again.silu_epilogue == plan.silu_epilogue

    # a hand-edited entry that is not a choice is timed again
    for bad in ({"1": "yes", "4": False, "16": False}, {"1": False, "4": False, "16": True}, ["1"]):
        entry[key]["silu_epilogue"] = bad
        (tmp_path / f"{cpu_features.signature()}.json").write_text(json.dumps(entry))
        with pytest.raises(AssertionError, match="timed although"):
            pack_linears(_gated_model(), policy)

    # a forced kernel runs as it is: no epilogue, no timing
    forced = pack_linears(_gated_model(), GemmPolicy("torch", max_rows=16))
    assert forced.choices == {"float32 32->48+48": (T,)} and forced.silu_epilogue == {}


def _no_timing(*args: Any) -> None:
    raise AssertionError("timed although the choice was cached")


def _adapter_on(group: str) -> AdapterPages:
    module = ModuleSlot(f"{group}_proj", 2, 32, 48, a_offset=0, b_offset=64, column=0, scale=1.0)
    return AdapterPages(group, (0,), AdapterLayout(({group: GroupSlot(0, 2, 32, (module,))},), (160,)))


@pytest.mark.parametrize("adapter_group", [None, "qkv", "gate_up"])
def test_the_mlp_takes_the_two_outputs_only_when_the_steps_adapters_add_to_gate_or_up(
    adapter_group: str | None,
) -> None:
    config = SimpleNamespace(hidden_size=32, intermediate_size=48)
    mlp = LlamaMLP(config, layer_index=0, kernels=ModelKernels())
    reference = copy.deepcopy(mlp)
    mlp.gate_up_packed = PackedLinearGroup([mlp.gate_proj, mlp.up_proj], (T,), (True,))
    lora = (
        None
        if adapter_group is None
        else LoRABatch(((0, 5, adapter_group),), {adapter_group: _adapter_on(adapter_group)})
    )
    batch: Any = SimpleNamespace(lora=lora)
    calls: list[str] = []

    def hook(x: torch.Tensor, layer: int, group: str, outputs: tuple[torch.Tensor, ...], batch: Any) -> None:
        calls.append(group)
        if batch.lora is not None and batch.lora.touches(layer, group) and group == "gate_up":
            outputs[1].add_(1.0)  # a LoRA delta on up

    x = torch.randn(5, 32)
    with torch.no_grad():
        out = mlp(x, batch, hook)
        assert calls == (["gate_up", "down"] if adapter_group == "gate_up" else ["down"])
        expected = reference(x, batch, hook)  # the two outputs, combined after
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
